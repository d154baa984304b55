"""`EngineStats`: one consistent picture of the engine, published by the engine thread.

The engine builds a new snapshot after every step (and after a request enters or leaves) and
replaces its `snapshot` attribute with it in one assignment; readers on other threads (the HTTP
thread serving /metrics) read that attribute once and see one step's state, never a pool halfway
through a step or queues from one step beside blocks from another (vLLM publishes its scheduler
stats per step the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpage.core.cache_stats import CacheStats

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class StepTokens:
    """Tokens per engine step, as a histogram's cumulative bucket counts (vLLM's iteration_tokens_total);
    the engine thread observes, the snapshot carries a copy."""

    counts: list[int] = field(default_factory=lambda: [0] * len(ITERATION_TOKEN_BUCKETS))
    total: int = 0
    steps: int = 0

    def observe(self, tokens: int) -> None:
        for i, bound in enumerate(ITERATION_TOKEN_BUCKETS):
            if tokens <= bound:
                self.counts[i] += 1
        self.total += tokens
        self.steps += 1

    def frozen(self) -> tuple[tuple[int, ...], int, int]:
        return tuple(self.counts), self.total, self.steps


@dataclass(frozen=True, slots=True)
class EngineStats:
    step: int  # steps run so far
    cache: CacheStats
    num_running: int  # requests
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_kv_verified_blocks: int
    num_kv_mismatches: int
    iteration_tokens: tuple[tuple[int, ...], int, int] = ((), 0, 0)  # StepTokens.frozen()
    # decodes within a read budget: blocks read (per bounded layer and kv head) and blocks in their contexts
    budget_blocks_read: int = 0
    budget_blocks_in_context: int = 0
