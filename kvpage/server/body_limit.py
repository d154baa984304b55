"""`BodyLimit`: an ASGI middleware that bounds request bodies in size and in time.

It reads the whole body before the app sees the request: a body over `limit` bytes is refused
with 413 (whether or not Content-Length is sent), and one that has not fully arrived `timeout`
seconds after the request began (a slowloris client sending a byte now and then) with 408, the
connection closed. The app then receives the body in one message; later receives (the client's
disconnect) go to the server as before.
"""

from __future__ import annotations

import asyncio
import json
import time

from kvpage.server.errors import error_body

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_BODY_TIMEOUT = 30.0


class BodyLimit:
    def __init__(self, app, limit: int = DEFAULT_MAX_BODY_BYTES, timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if self.limit and length is not None and length.isdigit() and int(length) > self.limit:
            return await self._too_large(send)
        chunks, seen = [], 0
        deadline = time.monotonic() + self.timeout if self.timeout else None  # 0: no time limit
        while True:
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                message = await asyncio.wait_for(receive(), left)
            except TimeoutError:
                msg = f"the request body did not arrive within {self.timeout:g} s"
                return await _reject(send, 408, msg, "body_timeout")
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if self.limit and seen > self.limit:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        await _reject(send, 413, f"request body larger than {self.limit} bytes", "body_too_large")


async def _reject(send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]  # fmt: skip
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
