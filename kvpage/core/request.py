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
from kvpage.core.seq_plan import PLAIN, SequencePlan


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
    # What its request's features change (a prompt of segments, a read budget): seq_plan.py
    plan: SequencePlan = PLAIN

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
        return self.plan.cacheable(self, n)

    @property
    def num_cacheable(self) -> int:
        return self.cacheable(self.num_computed)


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
    # The features it asked for (a prompt of segments, a read budget: seq_plan.plan_of), as its
    # first sequence starts with them; each sequence then holds its own plan
    plan: SequencePlan = PLAIN

    @property
    def unbounded(self) -> bool:
        """Its positions are those inside the cache (StreamingLLM): it may run past max_model_len."""
        return self.eviction.unbounded

    def __post_init__(self) -> None:
        if self.eviction is None:  # (None also means keep everything)
            self.eviction = NO_EVICTION
        if not self.sequences:
            ids = list(self.prompt_token_ids)
            self.sequences.append(Sequence(SeqKey(self.request_id, 0), ids, len(ids), plan=self.plan.fork()))

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
