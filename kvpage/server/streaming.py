"""Streaming helpers: server-sent events, and interleaving several requests' outputs.

`merge` runs at most `window` of its generators at a time (a generator submits its request to the
engine when first read), so one HTTP request with many prompts takes a bounded share of the batch
and requests that come after it are scheduled beside it, not behind all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from kvpage.outputs import RequestOutput
from kvpage.server.errors import APIError, error_body

log = logging.getLogger("kvpage.server")


def sse(chunks: AsyncIterator[dict], headers: dict | None = None) -> StreamingResponse:
    """Each chunk as a `data:` event, then `data: [DONE]`; an error mid-stream becomes an error event."""

    async def body():
        try:
            async for c in chunks:
                yield f"data: {json.dumps(c)}\n\n"
        except Exception as e:  # noqa: BLE001 - the client gets an error event and [DONE], whatever it was
            if isinstance(e, APIError):
                message, type_ = e.message, e.type
            else:
                log.exception("error in a stream")
                message, type_ = f"{type(e).__name__}: {e}", "server_error"
            yield f"data: {json.dumps(error_body(message, type_))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


async def merge(
    gens: list[AsyncIterator[RequestOutput]], window: int | None = None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave requests' outputs as they come, as (generator index, output); leaving early (or
    an error in one) closes, and so aborts, them all."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    slots = asyncio.Semaphore(window or len(gens))

    async def pump(i, gen):
        try:
            async with slots:
                async for out in gen:
                    await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
