"""`APIKeyAuth`: an ASGI middleware that checks `Authorization: Bearer KEY` before anything else.

The key is checked from the headers alone, before the body is read or parsed, against every
configured key in constant time (`hmac.compare_digest`; all keys are compared, whichever
matches). Every path needs it except `/health` (for load balancers); `/docs`, `/openapi.json` and
`/metrics` included. The request's tenant (a digest of its key, never the key) is put in
`scope["state"]["tenant"]`, which `--salt-cache-per-key` uses to keep tenants' prefix caches apart.

A browser cannot send the header, so the dashboard's paths (/dashboard, /dashboard/events) also take
the key from the cookie `kvpage_key`; `GET /dashboard?api_key=KEY` with a valid key answers 303 to
/dashboard (the key gone from the address bar) and sets that cookie, HttpOnly and SameSite=Strict,
for the dashboard's paths only. Every other path takes the header alone.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from urllib.parse import parse_qs, quote, unquote_to_bytes

from kvpage.server.errors import error_body

OPEN_PATHS = frozenset({"/health"})
DASHBOARD = "/dashboard"
COOKIE = "kvpage_key"


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
        path = route_path(scope)
        if scope["type"] == "lifespan" or (scope["type"] == "http" and path in OPEN_PATHS):
            return await self.app(scope, receive, send)
        dashboard = scope["type"] == "http" and (path == DASHBOARD or path.startswith(DASHBOARD + "/"))
        header = cookie = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                header = value
            elif name == b"cookie" and dashboard:
                cookie = _cookie(value, COOKIE) or cookie
        given = header[7:] if header[:7].lower() == b"bearer " else b""
        from_query = None
        if dashboard and path == DASHBOARD:
            from_query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key", [None])[0]
        tenant = self._tenant(from_query.encode() if from_query is not None else given or cookie)
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
        if from_query is not None:  # a browser's first visit: the key into a cookie, out of the address bar
            where = (scope.get("root_path", "") + DASHBOARD).encode()
            headers = [(b"location", where), (b"content-length", b"0"), (b"cache-control", b"no-store"),
                       (b"set-cookie", COOKIE.encode() + b"=" + quote(from_query, safe="").encode()
                        + b"; HttpOnly; SameSite=Strict; Path=" + where)]  # fmt: skip
            await send({"type": "http.response.start", "status": 303, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    def _tenant(self, given: bytes) -> str | None:
        token = hashlib.sha256(given).digest()
        tenant = None
        for key, key_tenant in self._keys:  # digests of equal length, every key compared: the time tells nothing
            if hmac.compare_digest(token, key):
                tenant = key_tenant
        return tenant


def _cookie(header: bytes, name: str) -> bytes | None:
    for part in header.split(b";"):
        k, sep, v = part.strip().partition(b"=")
        if sep and k == name.encode():
            return unquote_to_bytes(v)
    return None
