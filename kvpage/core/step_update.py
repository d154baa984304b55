"""What the engine hands back to the scheduler after a step, and what the scheduler answers.

The engine samples (or runs a beam step) and decides every sequence's fate; it never touches the
scheduler's state. It sends one `RequestUpdate` per request to `Scheduler.update_from_output`,
which applies them in a fixed order — forks first (while every parent still holds its blocks and
its old tokens), then appended tokens, then finished sequences — and answers with a `StepResult`.

    fork:   SeqUpdate(index=3, parent=1, token_id=t)     new sequence 3 = sequence 1's tokens + t
    append: SeqUpdate(index=1, token_id=t)
    jump:   SeqUpdate(index=1, token_id=t, forced=(f1, f2))                 t, then the tokens a grammar forces
    finish: SeqUpdate(index=1, token_id=t, finish_reason="stop", stop_reason=t)   (t is kept)
    prune:  SeqUpdate(index=2, finish_reason="abort")                              (no token)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpage.core.request import Request, Sequence
from kvpage.core.scheduler_output import SeqKey

if TYPE_CHECKING:
    from kvpage.core.kv_cache_manager import KVCacheManager


@dataclass(slots=True)
class SeqUpdate:
    index: int
    token_id: int | None = None  # the token appended this step, if any
    parent: int | None = None  # set for a new sequence: it starts as a fork of this one
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    forced: tuple[int, ...] = ()  # tokens appended after token_id at once (a grammar's jump-forward)


@dataclass(slots=True)
class RequestUpdate:
    request_id: str
    sequences: list[SeqUpdate] = field(default_factory=list)
    error: str | None = None  # the request failed while its output was processed: fail it alone


@dataclass(slots=True)
class StepResult:
    finished: list[str] = field(default_factory=list)  # requests whose every sequence has ended
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed alone


def apply_update(req: Request, update: RequestUpdate, kv: KVCacheManager) -> None:
    """Apply one request's decisions: forks (sharing the parent's blocks), then tokens, then the
    sequences that finished (their blocks go back). Everything is validated before anything changes;
    ValueError / IndexError name what was wrong."""
    for u in update.sequences:
        if u.forced and u.token_id is None:
            raise ValueError(f"sequence {u.index}: forced tokens follow a sampled token")
        if u.parent is None and not 0 <= u.index < len(req.sequences):
            raise IndexError(f"no sequence {u.index}")
        if u.parent is not None and not 0 <= u.parent < len(req.sequences):
            raise IndexError(f"no parent sequence {u.parent}")
    forks = [u for u in update.sequences if u.parent is not None and u.parent != u.index]
    for u in forks:
        if u.index != len(req.sequences):
            raise ValueError(f"a new sequence must take index {len(req.sequences)}, not {u.index}")
        parent = req.sequences[u.parent]  # type: ignore[index]
        if parent.finished or parent.num_uncomputed:
            raise ValueError(f"sequence {parent.index} cannot be forked now")
        child = Sequence(SeqKey(req.request_id, u.index), list(parent.token_ids), parent.num_prompt_tokens,
                         parent.num_computed, plan=parent.plan.fork())  # fmt: skip
        kv.fork(parent.key, child.key)
        req.sequences.append(child)
    for u in update.sequences:
        if u.token_id is not None:
            req.sequences[u.index].token_ids.append(u.token_id)
            req.sequences[u.index].token_ids.extend(u.forced)
    for u in update.sequences:
        if u.finish_reason is not None:
            seq = req.sequences[u.index]
            seq.finish_reason, seq.stop_reason = u.finish_reason, u.stop_reason
            if kv.has_sequence(seq.key):
                kv.free(seq.key, seq.token_ids, seq.num_cacheable)  # (its tail block stays cached)
