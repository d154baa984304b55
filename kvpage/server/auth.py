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

`checked_api_keys` is the one check of the keys themselves: build_app's, `kvpage serve`'s (before its
model loads) and APIKeyAuth's own.
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


def checked_api_keys(api_key: str | list[str] | None, salt_cache_per_key: bool, *, key_option: str = "api_key",
                     salt_option: str = "salt_cache_per_key") -> list[str]:  # fmt: skip
    """The keys every request must present (`api_key`: one, several, or None: no authentication; []
    then), or ValueError for a key that is not a string, an empty key, or a cache salted per key without
    keys. The errors name the options as the caller's user spells them."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not isinstance(k, str) for k in keys):
        raise ValueError(f"{key_option} must be a string or a list of strings")
    if api_key is not None and (not keys or any(not k for k in keys)):
        raise ValueError(f"{key_option} must not be empty (leave it unset to serve without authentication)")
    if salt_cache_per_key and not keys:
        raise ValueError(f"{salt_option} needs API keys ({key_option}): without them every client is the same tenant")
    return keys


class APIKeyAuth:
    def __init__(self, app, keys: list[str]) -> None:
        self.app = app
        self._keys = [(hashlib.sha256(k.encode()).digest(), tenant_of(k)) for k in checked_api_keys(keys, False)]

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
