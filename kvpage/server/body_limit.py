"""`BodyLimit`: an ASGI middleware that bounds request bodies in size and in time.

It reads the whole body before the app sees the request: a body over `limit` bytes is refused
with 413 (whether or not Content-Length is sent), and one that has not fully arrived `timeout`
seconds after the request began (a slowloris client sending a byte now and then) with 408, the
connection closed. Before a 413 the rest of the body is read and dropped, up to `DRAIN_BYTES` and
within the same time bound: an HTTP client writes its whole body before it reads the answer, and
under load a connection closed under it reads as a connection error, not as the 413 naming the limit.
The app then receives the body in one message; later receives (the client's disconnect) go to the
server as before.
"""

from __future__ import annotations

import asyncio
import json
import time

from kvpage.server.errors import error_body

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_BODY_TIMEOUT = 30.0
DRAIN_BYTES = 64 << 20  # the most of an oversized body read (and dropped) so that its client sees the 413


class BodyLimit:
    def __init__(self, app, limit: int = DEFAULT_MAX_BODY_BYTES, timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        too_large = bool(self.limit and declared is not None and declared > self.limit)
        if too_large and declared > DRAIN_BYTES:
            return await self._too_large(send)
        chunks, seen = [], 0
        deadline = time.monotonic() + self.timeout if self.timeout else None  # 0: no time limit
        while True:
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                message = await asyncio.wait_for(receive(), left)
            except TimeoutError:
                if too_large:
                    return await self._too_large(send)
                msg = f"the request body did not arrive within {self.timeout:g} s"
                return await _reject(send, 408, msg, "body_timeout")
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            too_large = too_large or bool(self.limit and seen > self.limit)
            if too_large:  # dropped: read on only so that the client gets to read the answer
                chunks.clear()
                if not message.get("more_body", False) or seen > DRAIN_BYTES:
                    return await self._too_large(send)
                continue
            chunks.append(chunk)
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
