"""`APIKeyAuth`: an ASGI middleware that checks `Authorization: Bearer KEY` before anything else.

The key is checked from the headers alone, before the body is read or parsed, against every
configured key in constant time (`hmac.compare_digest`; all keys are compared, whichever
matches). Every path needs it except `/health` (for load balancers); `/docs`, `/openapi.json` and
`/metrics` included. The request's tenant (a digest of its key, never the key) is put in
`scope["state"]["tenant"]`, which `--salt-cache-per-key` uses to keep tenants' prefix caches apart.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from kvpage.server.errors import error_body

OPEN_PATHS = frozenset({"/health"})


def tenant_of(key: str) -> str:
    return hashlib.sha256(b"kvpage-tenant:" + key.encode()).hexdigest()[:32]


def route_path(scope) -> str:
    """The path the app routes on: without the server's --root-path (uvicorn puts it in front)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class APIKeyAuth:
    def __init__(self, app, keys: list[str]) -> None:
        if not keys or any(not isinstance(k, str) or not k for k in keys):
            raise ValueError("API keys must be non-empty strings")
        self.app = app
        self._keys = [(hashlib.sha256(k.encode()).digest(), tenant_of(k)) for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan" or (scope["type"] == "http" and route_path(scope) in OPEN_PATHS):
            return await self.app(scope, receive, send)
        header = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                header = value
        token = hashlib.sha256(header[7:] if header[:7].lower() == b"bearer " else b"").digest()
        tenant = None
        for key, key_tenant in self._keys:  # digests of equal length, every key compared: the time tells nothing
            if hmac.compare_digest(token, key):
                tenant = key_tenant
        if tenant is None and scope["type"] != "http":  # a websocket without a key: closed, policy violation
            await send({"type": "websocket.close", "code": 1008})
            return
        if tenant is None:
            body = json.dumps(error_body("invalid or missing API key (Authorization: Bearer ...)",
                                         "authentication_error", code="invalid_api_key")).encode()  # fmt: skip
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"www-authenticate", b"Bearer")]  # fmt: skip
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
