"""`EngineStats`: one consistent picture of the engine, published by the engine thread.

The engine builds a new snapshot after every step (and after a request enters or leaves) and
replaces its `snapshot` attribute with it in one assignment; readers on other threads (the HTTP
thread serving /metrics) read that attribute once and see one step's state, never a pool halfway
through a step or queues from one step beside blocks from another (vLLM publishes its scheduler
stats per step the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.core.cache_stats import CacheStats


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
