"""A sequence's feature plan: what the features a request asked for change in how the scheduler treats
it, asked as the scheduler asks the eviction policy, so the scheduler names no feature.

A plan is a tuple of features, each answering the same questions (its default answer: nothing
changes); the scheduler asks the sequence's plan, which asks each feature in turn:

    hold / give_way / admitted   intake: what it holds before admission allocates, gives back when
                                 the prompt does not fit beside it, and does once admitted
    cacheable(seq, n)            of its first n tokens, the leading ones whose KV is exact (what the
                                 prefix cache may register): each feature can only lower it
    runs(seq, n)                 its next n tokens as (position, tokens, filled) runs to compute
    annotate(entry, seq, filled) what its step entry (a ScheduledSequence) carries for the worker
    fork()                       what a forked sample or beam inherits (its own copy of any state)
    forget()                     its KV is gone (a recompute): what it must plan again

Two features today: `SegmentFill` (a prompt of segments copies its reused segments' cached KV,
core/segments.py; with CacheBlend's selective recompute the copied spans run too) and `ReadBudget`
(decodes read within a budget, attention/key_bounds.py). A plain request's plan is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from kvpage.core.request import Sequence
    from kvpage.core.scheduler_output import ScheduledSequence, SchedulerOutput

Run = tuple[int, int, bool]  # (position, tokens, filled: its slots hold copied KV)
F = TypeVar("F", bound="Feature")


class Feature:
    """A feature's answers; each default changes nothing."""

    def hold(self, kv, token_ids: list[int], cache_salt: str | None) -> Any:
        return None

    def holds(self, held: Any) -> bool:
        return False

    def give_way(self, kv, held: Any) -> Any:
        return held

    def admitted(self, kv, lead: Sequence, siblings: list[Feature], held: Any, out: SchedulerOutput) -> None:
        pass

    def cacheable(self, seq: Sequence, n: int) -> int:
        return n

    def runs(self, seq: Sequence, n: int) -> list[Run] | None:
        return None  # not this feature's to say

    def annotate(self, entry: ScheduledSequence, seq: Sequence, filled: bool) -> None:
        pass

    def fork(self) -> Feature:
        return self  # stateless: shared

    def forget(self) -> None:
        pass

    @property
    def copies_kv(self) -> bool:
        """Some of its KV is copied rather than computed (no eviction policy may drop it)."""
        return False


@dataclass(slots=True, frozen=True)
class SequencePlan:
    features: tuple[Feature, ...] = ()

    def hold(self, kv, token_ids: list[int], cache_salt: str | None) -> list[Any]:
        return [f.hold(kv, token_ids, cache_salt) for f in self.features]

    def holds(self, held: list[Any]) -> bool:
        return any(f.holds(h) for f, h in zip(self.features, held, strict=True))

    def give_way(self, kv, held: list[Any]) -> list[Any]:
        return [f.give_way(kv, h) for f, h in zip(self.features, held, strict=True)]

    def admitted(self, kv, lead: Sequence, siblings: list[Sequence], held: list[Any], out: SchedulerOutput) -> None:
        """`lead` (this plan's sequence) was just admitted with `siblings` sharing its blocks."""
        for i, (f, h) in enumerate(zip(self.features, held, strict=True)):
            f.admitted(kv, lead, [s.plan.features[i] for s in siblings], h, out)

    def cacheable(self, seq: Sequence, n: int) -> int:
        for f in self.features:
            n = f.cacheable(seq, n)
        return n

    def runs(self, seq: Sequence, n: int) -> list[Run]:
        for f in self.features:
            runs = f.runs(seq, n)
            if runs is not None:
                return runs
        return [(seq.num_computed, n, False)]

    def annotate(self, entry: ScheduledSequence, seq: Sequence, filled: bool) -> None:
        for f in self.features:
            f.annotate(entry, seq, filled)

    def fork(self) -> SequencePlan:
        return SequencePlan(tuple(f.fork() for f in self.features))

    def forget(self) -> None:
        for f in self.features:
            f.forget()

    @property
    def copies_kv(self) -> bool:
        return any(f.copies_kv for f in self.features)

    def get(self, kind: type[F]) -> F | None:
        """Its feature of this kind, if it has one."""
        return next((f for f in self.features if isinstance(f, kind)), None)


@dataclass(slots=True)
class ReadBudget(Feature):
    """Its decodes read at most `tokens` tokens' blocks, chosen by their key bounds (Quest). The KV
    of every generated token saw only some blocks, so nothing past the prompt is registered; the
    prompt itself reads in full."""

    tokens: int

    def cacheable(self, seq: Sequence, n: int) -> int:
        return min(n, seq.num_prompt_tokens)

    def annotate(self, entry: ScheduledSequence, seq: Sequence, filled: bool) -> None:
        # generated tokens only: a prompt's last token computed alone (after a prefix hit) reads in
        # full, as it would inside its prompt's chunk
        if entry.num_computed >= seq.num_prompt_tokens:
            entry.max_read_tokens = self.tokens


@dataclass(slots=True)
class SegmentFill(Feature):
    """A prompt given as segments ((start, length) each): at admission it copies what each reused
    segment's own cached KV holds, recomputing the first `recompute_blocks` blocks of each
    (core/segments.py). The copied spans (`filled`) are skipped as the computed count reaches them,
    or with CacheBlend's selective recompute (`select_ratio` > 0) run too, as runs of their own that
    recompute that share of their tokens past the check layer (worker/selective.py). Where the
    exactly computed KV ends (`exact_upto`; None: all of it is exact) nothing after is registered."""

    spans: tuple[tuple[int, int], ...]
    recompute_blocks: int = 1
    select_ratio: float = 0.0
    filled: list[tuple[int, int]] = field(default_factory=list)
    exact_upto: int | None = None

    @property
    def copies_kv(self) -> bool:
        return True

    def hold(self, kv, token_ids: list[int], cache_salt: str | None) -> list[list[int]]:
        # the segments' cached KV, held first: the prompt's own allocation must not evict it
        return kv.hold_segments(token_ids, self.spans, cache_salt)

    def holds(self, held: list[list[int]]) -> bool:
        return any(held)

    def give_way(self, kv, held: list[list[int]]) -> list[list[int]]:
        # it does not fit beside the blocks it would copy from: they give way, and it computes its
        # prompt in full (a pool too small to hold both must not stall it)
        kv.release_segments(held)
        return [[] for _ in held]

    def admitted(self, kv, lead: Sequence, siblings: list[Feature], held: list[list[int]], out) -> None:
        """The lead copies what `held` caches (the runs go into this step, before its forward) and
        computes the rest; its siblings' shared blocks are the lead's, exact as far as the lead's."""
        fills = kv.fill_segments(lead.key, self.spans, held, self.recompute_blocks, lead.num_computed)
        self.filled = [(f.start, f.end) for f in fills]
        self.exact_upto = fills[0].start if fills else None
        out.slot_copies.extend(r for f in fills for r in f.runs)
        for s in siblings:
            s.exact_upto = self.exact_upto  # type: ignore[attr-defined]

    def cacheable(self, seq: Sequence, n: int) -> int:
        return n if self.exact_upto is None else min(n, self.exact_upto)

    def runs(self, seq: Sequence, n: int) -> list[Run] | None:
        """(position, tokens, filled) runs of its next `n` tokens: the filled spans skipped, or under
        selective recompute computed too, as runs of their own marked filled."""
        if not self.filled:
            return None
        selective = self.select_ratio > 0
        runs, pos, end = [], seq.num_computed, len(seq.token_ids)
        spans = [f for f in self.filled if f[1] > pos]
        while n > 0 and pos < end:
            inside = bool(spans) and spans[0][0] <= pos
            if inside and not selective:
                pos = spans.pop(0)[1]
                continue
            stop = spans[0][1] if inside else (spans[0][0] if spans else end)
            take = min(n, end - pos, stop - pos)
            runs.append((pos, take, inside))
            pos, n = pos + take, n - take
            if inside and pos == stop:
                spans.pop(0)
        return runs

    def annotate(self, entry: ScheduledSequence, seq: Sequence, filled: bool) -> None:
        if filled:
            entry.select_ratio = self.select_ratio

    def fork(self) -> SegmentFill:
        return SegmentFill(self.spans, self.recompute_blocks, self.select_ratio, list(self.filled), self.exact_upto)

    def forget(self) -> None:
        self.filled, self.exact_upto = [], None


PLAIN = SequencePlan()  # (no features: stateless, shared by every plain sequence)


def plan_of(
    segments: tuple[tuple[int, int], ...] = (),
    recompute_blocks: int = 1,
    recompute_ratio: float = 0.0,
    read_budget: int | None = None,
) -> SequencePlan:
    """The plan of a request's first sequence, from what the request asked."""
    features: list[Feature] = []
    if segments:
        features.append(SegmentFill(tuple(segments), recompute_blocks, recompute_ratio))
    if read_budget:
        features.append(ReadBudget(read_budget))
    return SequencePlan(tuple(features)) if features else PLAIN
