"""What the engine hands back to the scheduler after a step, and what the scheduler answers.

The engine samples (or runs a beam step) and decides every sequence's fate; it never touches the
scheduler's state. It sends one `RequestUpdate` per request to `Scheduler.update_from_output`,
which applies them in a fixed order — forks first (while every parent still holds its blocks and
its old tokens), then appended tokens, then finished sequences — and answers with a `StepResult`.

    fork:   SeqUpdate(index=3, parent=1, token_id=t)     new sequence 3 = sequence 1's tokens + t
    append: SeqUpdate(index=1, token_id=t)
    finish: SeqUpdate(index=1, token_id=t, finish_reason="stop", stop_reason=t)   (t is kept)
    prune:  SeqUpdate(index=2, finish_reason="abort")                              (no token)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SeqUpdate:
    index: int
    token_id: int | None = None  # the token appended this step, if any
    parent: int | None = None  # set for a new sequence: it starts as a fork of this one
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestUpdate:
    request_id: str
    sequences: list[SeqUpdate] = field(default_factory=list)
    error: str | None = None  # the request failed while its output was processed: fail it alone


@dataclass(slots=True)
class StepResult:
    finished: list[str] = field(default_factory=list)  # requests whose every sequence has ended
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed alone
