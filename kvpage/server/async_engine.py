"""`AsyncEngine`: one engine loop in a background thread, shared by every HTTP request.

Handlers submit requests and read outputs through asyncio queues; they never run model code
themselves, so the event loop stays free. Requests that arrive while a step runs join the next
step: the loop drains its command queue before every step.

    handler --add/abort--> command queue --> engine thread: step() --outputs--> per-request asyncio.Queue

Shutting down (`begin_shutdown`, on SIGTERM/SIGINT) refuses new requests and ends every running one
at once with `EngineUnavailable`; if the engine thread dies, every waiting client gets the error,
later requests are refused, and `on_death` is called (the server then exits).

A step's outputs reach the handlers when the next step's forward begins (`_HandOff`, a step hook), not
as the step ends: the forward runs without the GIL, so the event loop's work on them (text, JSON,
the socket) runs beside it; handed out between steps, it took the GIL from the next step's Python
and every token waited for it (one stream on 2 cores: ~1-2 ms a token). Outputs go out at once when
no step follows (the last request finished) or when a step runs no forward.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvpage.engine.llm_engine import LLMEngine
from kvpage.engine.segment_prompts import SegmentedPrompt
from kvpage.heap import return_freed_memory
from kvpage.outputs import RequestOutput
from kvpage.sampling_params import BeamSearchParams, SamplingParams
from kvpage.worker.step_hooks import StepHook


class EngineUnavailable(RuntimeError):
    """The engine takes no more requests: the server is shutting down, or the engine thread died."""


log = logging.getLogger("kvpage.server")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class _HandOff(StepHook):
    """Delivers the outputs the engine thread holds back, as the next forward begins."""

    def __init__(self, aengine: AsyncEngine) -> None:
        self.aengine = aengine

    def before_forward(self) -> None:
        self.aengine._hand_out()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_output=None, on_abort=None) -> None:
        self.engine = engine
        self.on_output = on_output  # called in the engine thread for every output (metrics)
        self.on_abort = on_abort  # called in the engine thread with the id of every aborted request
        self.on_death = None  # called in the engine thread if it dies
        self.between_steps: list = []  # each called in the engine thread after every step, and when idle (~2/s)
        self.closing = False
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvpage-engine", daemon=True)
        self.error: BaseException | None = None
        self._held: list[RequestOutput] = []  # the last step's outputs, until the next forward begins
        engine.add_step_hook(_HandOff(self))

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def begin_shutdown(self) -> None:
        """Refuse new requests and end the running ones now (their clients get EngineUnavailable).
        Safe to call from a signal handler or any thread."""
        self.closing = True
        for rid in list(self._streams):
            self._deliver(rid, EngineUnavailable("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int] | SegmentedPrompt,
        params: SamplingParams | BeamSearchParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; leaving early (a disconnect) aborts it."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        if self.closing or not self.alive:  # checked once registered: a shutdown or death cannot slip between
            self._streams.pop(request_id, None)
            raise EngineUnavailable(
                "the server is shutting down" if self.closing else f"the engine stopped: {self.error!r}"
            )
        self._commands.put(("add", request_id, prompt, params, cache_salt))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def wake(self) -> None:
        """Run the loop now (its hooks included) instead of at the end of an idle wait."""
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # ------------------------------------------------------------------ the engine thread
    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _hand_out(self) -> None:
        held, self._held = self._held, []
        for out in held:
            self._deliver(out.request_id, out)

    def _run(self) -> None:
        engine, busy = self.engine, False
        try:
            while not self._stopped:
                while True:
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if cmd[0] == "add":
                        _, rid, prompt, params, salt = cmd
                        if self.closing:
                            self._deliver(rid, EngineUnavailable("the server is shutting down"))
                            continue
                        try:
                            engine.add_request(rid, prompt, params, cache_salt=salt)
                        except ValueError as e:
                            self._deliver(rid, e)
                    elif engine.has_request(cmd[1]):
                        engine.abort_request(cmd[1])
                        if self.on_abort is not None:
                            self.on_abort(cmd[1])
                if not engine.has_unfinished_requests():
                    if busy:  # just gone idle: the steps' freed buffers go back to the system
                        return_freed_memory(collect=False)
                        busy = False
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                else:
                    busy = True
                    outs = engine.step()  # the held outputs went out as its forward began
                    self._hand_out()  # or now, if it ran none
                    if self.on_output is not None:
                        for out in outs:
                            self.on_output(out)
                    self._held = outs
                    if not engine.has_unfinished_requests():
                        self._hand_out()
                for hook in self.between_steps:
                    hook()
        except BaseException as e:  # noqa: BLE001 - report to every waiting client, then stop
            self.error = e
            self._hand_out()  # what the last step produced, before the error
            for rid in list(self._streams):
                self._deliver(rid, EngineUnavailable(f"the engine stopped: {e!r}"))
            log.critical("the engine thread died", exc_info=e)
            if self.on_death is not None:
                self.on_death()
