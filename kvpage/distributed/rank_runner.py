"""The two sides of a tensor-parallel step.

    rank 0:   RankZeroRunner.execute(step) = broadcast(("step", step)); its own ModelRunner.execute(step)
    rank r:   serve_steps: receive, ModelRunner.execute(step) (no logits), until ("stop",)

Every rank executes the same `SchedulerOutput` in the same order, so its blocks, swaps, copies and
demotions land under the same ids on every rank; each rank keeps a digest of the steps it executed
and counts its all-reduces (`digests()` gathers both: equal on every rank, checked by the tests).

A rank that dies, or a step that fails before its last collective, leaves the ranks out of step: the
runner raises `TensorParallelFailure` and the engine stops. A failure after it (rank 0's logits) fails
only the batch, as in one process. While the engine idles, rank 0 pings the others every
`HEARTBEAT_S` so that their wait for the next step never reaches the group's timeout; one lock keeps
the heartbeat, the steps and `close()` (from whatever thread) one at a time on the group.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import threading
import time

from kvpage.errors import TensorParallelFailure

log = logging.getLogger("kvpage")

HEARTBEAT_S = 20.0  # well inside the group's timeout (group.py), or a third of a shorter one


def step_digest(digest, step) -> None:
    """Fold a step, as this rank received it, into the rank's running digest."""
    digest.update(repr(step).encode())


class RankZeroRunner:
    """Rank 0's runner: every step to every rank first, then its own shard. Everything else (the KV
    cache, timings, the model) is its own ModelRunner's."""

    def __init__(self, runner, group, ranks) -> None:
        self.runner, self.group, self.ranks = runner, group, ranks
        self.digest = hashlib.sha256()
        self.failed: str | None = None
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._every = min(HEARTBEAT_S, group.timeout_s / 3)
        self._closing = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="kvpage-tp-heartbeat", daemon=True)
        self._heartbeat.start()
        atexit.register(self.close)  # the spawned ranks stop with the program even if nobody closes

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, step):
        with self._lock:
            if self.failed is not None:
                raise TensorParallelFailure(self.failed)
            dead = self.ranks.dead()
            if dead:
                self._fail(f"rank(s) {dead} of the tensor-parallel group exited")
            self.runner.collectives_done = False
            try:
                self._send(("step", step))
                step_digest(self.digest, step)
                return self.runner.execute(step)
            except BaseException as e:
                if self.runner.collectives_done and isinstance(e, Exception):
                    raise  # rank 0's own work after the step's last collective: the ranks are in step
                self._fail(f"a tensor-parallel step failed: {type(e).__name__}: {e}", e)

    def _send(self, msg) -> None:
        self.group.broadcast(msg)
        self._last_sent = time.monotonic()

    def _fail(self, why: str, cause: BaseException | None = None):
        self.failed = why
        if cause is not None and not isinstance(cause, Exception):
            raise cause  # (KeyboardInterrupt, SystemExit: as they were, the group marked failed)
        raise TensorParallelFailure(why) from cause

    def _beat(self) -> None:
        while not self._closing.wait(self._every / 4):
            if time.monotonic() - self._last_sent < self._every or not self._lock.acquire(blocking=False):
                continue
            try:
                if self.failed is None and not self.group.closed:
                    self._send(("ping",))
            except Exception as e:  # noqa: BLE001 - a rank gone: the next step finds out and says so
                self.failed = f"the tensor-parallel group lost a rank while idle: {type(e).__name__}: {e}"
            finally:
                self._lock.release()

    def digests(self) -> list[tuple[str, int]]:
        """Each rank's (digest of every step it executed, all-reduces it took part in), in rank order."""
        with self._lock:
            self._send(("digest",))
            return self.group.gather((self.digest.hexdigest(), self.group.num_all_reduces))

    def close(self, wait_s: float = 30.0) -> None:
        """Tell the ranks to leave (after the step in flight, if any), stop them by pid where spawned
        here, and leave the group."""
        atexit.unregister(self.close)
        self._closing.set()
        locked = self._lock.acquire(timeout=wait_s)  # a step stuck past it: the ranks are stopped by pid
        try:
            if self.group.closed:
                return
            try:
                if locked and self.failed is None:
                    self._send(("stop",))
            except Exception:  # noqa: BLE001 - a rank already gone: stop the rest by pid
                pass
            self.ranks.stop()
            self.group.close()
        finally:
            if locked:
                self._lock.release()


def serve_steps(group, runner) -> None:
    """A rank other than 0: execute what rank 0 broadcasts until it says stop."""
    digest = hashlib.sha256()
    while True:
        msg = group.broadcast()
        kind = msg[0]
        if kind == "step":
            step_digest(digest, msg[1])
            runner.execute(msg[1])
        elif kind == "digest":
            group.gather((digest.hexdigest(), group.num_all_reduces))
        elif kind == "stop":
            return
        elif kind != "ping":
            raise RuntimeError(f"unknown message {kind!r} from rank 0")
