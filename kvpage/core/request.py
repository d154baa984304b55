"""A request as the scheduler sees it: plain token lists and counters, no sampling logic.

A request starts with one sequence (its prompt). Parallel sampling (n > 1) and beam search fork it
into more sequences that share blocks; each sequence ends on its own, the request when all have.
Parallel samples are also preempted on their own (`parked`), beams only all together.
The request owns its sequences' token ids (the KV-cache manager only holds blocks); the scheduler
is the only writer, in `update_from_output`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpage.core.eviction import NO_EVICTION, EvictionPolicy
from kvpage.core.scheduler_output import SeqKey


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its blocks are in the CPU pool
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    key: SeqKey  # (request id, index): the name of its block table in the KV-cache manager
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    num_computed: int = 0  # tokens whose KV is in the cache (or shared with the lead, see below)
    # After a recompute, a sibling shares the lead's first `depends_on[1]` tokens of blocks before the
    # lead has recomputed them: it may not run until sequence `depends_on[0]` has computed that far
    # (the condition stays true afterwards; a recompute resets it).
    depends_on: tuple[int, int] | None = None
    # A parallel sample preempted on its own while its request runs on: it holds no GPU block (none
    # after a recompute, or its blocks in the CPU pool after a swap) until the scheduler resumes it.
    parked: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # A prompt of segments (core/segments.py): position spans whose KV was copied from the segments'
    # own cached blocks instead of computed (skipped as the computed count reaches them), and where
    # the exactly computed KV ends (None: all of it is exact): nothing after it is registered.
    filled: list[tuple[int, int]] = field(default_factory=list)
    exact_upto: int | None = None
    # Its decodes read within a budget (a request's read_budget): the KV of every generated token saw
    # only some blocks, so nothing past the prompt is registered (the prompt itself reads in full).
    budgeted: bool = False

    @property
    def index(self) -> int:
        return self.key.index

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def cacheable(self, n: int) -> int:
        """Of its first `n` tokens, the leading ones whose KV is exact: what the prefix cache may hold."""
        if self.budgeted:
            n = min(n, self.num_prompt_tokens)
        return n if self.exact_upto is None else min(n, self.exact_upto)

    @property
    def num_cacheable(self) -> int:
        return self.cacheable(self.num_computed)

    def compute_runs(self, n: int, selective: bool = False) -> list[tuple[int, int, bool]]:
        """(position, tokens, filled) runs of its next `n` tokens to compute. The filled spans are
        skipped, or with `selective` (CacheBlend) computed too, as runs of their own marked filled."""
        runs, pos, end = [], self.num_computed, len(self.token_ids)
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

    def forget_fills(self) -> None:
        """Its KV is gone (a recompute): computed again from scratch, filled again at admission."""
        self.filled, self.exact_upto = [], None


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    arrival: int  # order of arrival; the scheduler serves first come, first served
    cache_salt: str | None = None
    use_prefix_cache: bool = True  # off for requests that want prompt logprobs (every position must run)
    want_prompt_logprobs: bool = False
    width: int = 1  # the most sequences it runs at once: n, or the beam width
    # Parallel samples are independent: preempted and resumed one by one, so the request fails only
    # when one sample alone can never fit. Beams (False) are pruned together and move as a gang.
    independent: bool = False
    sequences: list[Sequence] = field(default_factory=list)  # sequences[i].index == i
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    error: str | None = None  # why it failed alone (e.g. it can never fit in the cache)
    rejected: bool = False  # it failed because it can never run here (the request's fault, not a step's)
    num_cached_tokens: int | None = None  # prompt tokens its first admission found in the prefix cache
    eviction: EvictionPolicy = NO_EVICTION  # StreamingLLM / H2O: blocks released as it grows (core/eviction/)
    # A prompt given as segments (core/segments.py): (start, length) of each in the prompt, and the
    # blocks at the start of each reused segment computed again in the new context
    segments: tuple[tuple[int, int], ...] = ()
    recompute_blocks: int = 1
    # CacheBlend's selective recompute (0: off): the copied spans are computed too, every layer up to
    # the check layer for all their tokens, the later ones for this share of them (worker/selective.py)
    recompute_ratio: float = 0.0
    # Its decodes read at most this many tokens' blocks, chosen by their key bounds (Quest); nothing
    # is freed, so the scheduler only passes it on. None: a full read.
    read_budget: int | None = None

    @property
    def unbounded(self) -> bool:
        """Its positions are those inside the cache (StreamingLLM): it may run past max_model_len."""
        return self.eviction.unbounded

    def __post_init__(self) -> None:
        if self.eviction is None:  # (None also means keep everything)
            self.eviction = NO_EVICTION
        if not self.sequences:
            ids = list(self.prompt_token_ids)
            self.sequences.append(Sequence(SeqKey(self.request_id, 0), ids, len(ids), budgeted=bool(self.read_budget)))

    @property
    def live_sequences(self) -> list[Sequence]:
        return [s for s in self.sequences if not s.finished]

    @property
    def resident_sequences(self) -> list[Sequence]:
        """The live sequences the scheduler runs now (parked samples left out)."""
        return [s for s in self.sequences if not s.finished and not s.parked]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
