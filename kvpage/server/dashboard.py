"""/dashboard: a live picture of the KV cache, drawn by a static page from a server-sent-events stream.

    engine thread, between steps --picture (plain data, JSON)--> each watcher's asyncio.Queue(1) --> SSE

`EngineFeed` runs in the engine thread (an `AsyncEngine.between_steps` hook) and does nothing while
nobody watches. While somebody does, it builds one picture after a step that changed something (the
engine replaces its `snapshot` whenever a step runs or a request enters or leaves), at most one per
`min_interval`, and hands it to every watcher's event loop; a watcher's queue holds one picture and a
newer one replaces it, so a slow page skips pictures and never makes the engine wait. The HTTP side
never reads engine state: it only forwards what the engine thread built. A picture holds the step
number, `cache_stats()`, the memory map (core/memory_map.py: every block's state, every block table),
the unfinished requests and the scheduler's counts. A fleet's ingress draws the same page from
kvpage/fleet/fleet_feed.py (its replicas, polled from the KV index actor: index_actor.py).

The page (static/dashboard.html) is plain SVG and JavaScript, no library and no network. It is behind
the API key like every other path; a browser, which cannot send the header, opens
`/dashboard?api_key=KEY` once and gets the key as an HttpOnly cookie for /dashboard (auth.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, StreamingResponse

KEEPALIVE_S = 15.0  # an SSE comment this often keeps proxies from closing a quiet stream


def engine_picture(engine) -> dict:
    """One picture of an LLMEngine, built in its thread between steps."""
    snap = engine.snapshot
    return {
        "step": snap.step,
        "time": time.time(),
        "stats": snap.cache.as_dict(),
        "memory": engine.kv_manager.memory_map().as_dict(),
        "requests": engine.request_summaries(),
        "scheduler": {
            "running": snap.num_running,
            "waiting": snap.num_waiting,
            "swapped": snap.num_swapped,
            "preemptions": snap.num_preemptions,
        },  # fmt: skip
        "fleet": None,
    }


class EngineFeed:
    """Pictures of one engine for the watchers of /dashboard/events (module docstring)."""

    def __init__(self, engine, wake: Callable[[], None] = lambda: None, min_interval: float = 0.05) -> None:
        self.engine, self.wake, self.min_interval = engine, wake, min_interval
        self._watchers: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._drawn = None  # the engine snapshot the last picture was built from
        self._drawn_at = 0.0
        self._newcomer = False
        self.num_pictures = 0

    def __call__(self) -> None:  # the engine thread
        if not self._watchers:
            self._drawn = None
            return
        now = time.monotonic()
        snap = self.engine.snapshot
        if not self._newcomer and (snap is self._drawn or now - self._drawn_at < self.min_interval):
            return  # unchanged, or too soon: a later call (the next step, or the idle loop's) draws it
        self._newcomer = False
        self._drawn, self._drawn_at = snap, now
        text = json.dumps(engine_picture(self.engine), separators=(",", ":"))
        self.num_pictures += 1
        with self._lock:
            watchers = list(self._watchers.values())
        for loop, q in watchers:
            with contextlib.suppress(RuntimeError):  # (its loop closed)
                loop.call_soon_threadsafe(_put_latest, q, text)

    async def pictures(self, timeout: float = 1.0) -> AsyncIterator[str | None]:
        """Each picture as JSON text as it comes; None when none came for `timeout` seconds."""
        q: asyncio.Queue = asyncio.Queue(maxsize=1)
        token = next(self._ids)
        with self._lock:
            self._watchers[token] = (asyncio.get_running_loop(), q)
        self._newcomer = True
        self.wake()
        try:
            while True:
                try:
                    yield await asyncio.wait_for(q.get(), timeout)
                except TimeoutError:
                    yield None
        finally:
            with self._lock:
                self._watchers.pop(token, None)

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)


def _put_latest(q: asyncio.Queue, item) -> None:
    if q.full():
        q.get_nowait()
    q.put_nowait(item)


def install_dashboard(app: FastAPI, feed, closing: Callable[[], bool]) -> None:
    """GET /dashboard (the page) and GET /dashboard/events (the stream of pictures, one `data:` each)."""
    page = resources.files("kvpage.server").joinpath("static/dashboard.html").read_text(encoding="utf-8")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard():
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events():
        async def stream():
            quiet = 0.0
            async with contextlib.aclosing(feed.pictures(timeout=1.0)) as pictures:
                async for text in pictures:
                    if closing():
                        return
                    if text is not None:
                        quiet = 0.0
                        yield f"data: {text}\n\n"
                    else:
                        quiet += 1.0
                        if quiet >= KEEPALIVE_S:
                            quiet = 0.0
                            yield ": keep-alive\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})  # fmt: skip
