"""The two sides of a tensor-parallel step.

    rank 0:   RankZeroRunner.execute(step) = broadcast(("step", step)); its own ModelRunner.execute(step)
    rank r:   serve_steps: receive, ModelRunner.execute(step) (no logits), until ("stop",)

Every rank executes the same `SchedulerOutput` in the same order, so its blocks, swaps, copies and
demotions land under the same ids on every rank; each rank keeps a digest of the steps it executed
(`digests()` gathers them: equal on every rank, checked by the tests). A rank that dies or a step that
fails partway leaves the ranks out of step: the runner raises `TensorParallelFailure` and the engine stops.
"""

from __future__ import annotations

import atexit
import hashlib
import logging

from kvpage.errors import TensorParallelFailure

log = logging.getLogger("kvpage")


def step_digest(digest, step) -> None:
    """Fold a step, as this rank sees it, into the rank's running digest."""
    digest.update(repr(step).encode())


class RankZeroRunner:
    """Rank 0's runner: every step to every rank first, then its own shard. Everything else (the KV
    cache, timings, the model) is its own ModelRunner's."""

    def __init__(self, runner, group, ranks) -> None:
        self.runner, self.group, self.ranks = runner, group, ranks
        self.digest = hashlib.sha256()
        self.failed: str | None = None
        atexit.register(self.close)  # the spawned ranks stop with the program even if nobody closes

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, step):
        if self.failed is not None:
            raise TensorParallelFailure(self.failed)
        dead = self.ranks.dead()
        if dead:
            self._fail(f"rank(s) {dead} of the tensor-parallel group exited")
        try:
            self.group.broadcast(("step", step))
            step_digest(self.digest, step)
            return self.runner.execute(step)
        except Exception as e:  # the ranks may be partway through the step: none can go on
            self._fail(f"a tensor-parallel step failed: {type(e).__name__}: {e}")

    def _fail(self, why: str):
        self.failed = why
        raise TensorParallelFailure(why)

    def digests(self) -> list[str]:
        """Each rank's digest of every step it executed, in rank order."""
        self.group.broadcast(("digest",))
        return self.group.gather(self.digest.hexdigest())

    def close(self) -> None:
        """Tell the ranks to leave, wait for them (by pid where spawned here), and leave the group."""
        if self.group.closed:
            return
        try:
            if self.failed is None:
                self.group.broadcast(("stop",))
        except Exception:  # noqa: BLE001 - a rank already gone: stop the rest by pid
            pass
        self.ranks.stop()
        self.group.close()


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
            group.gather(digest.hexdigest())
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown message {kind!r} from rank 0")
