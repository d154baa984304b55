"""`CacheStats`: a snapshot of where the KV-cache memory is, read by users, metrics and benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True, frozen=True)
class CacheStats:
    block_size: int
    total_blocks: int
    used_blocks: int  # ref_count > 0
    free_blocks: int  # ref_count == 0, cached ones included
    cached_blocks: int  # free, but still registered: a later request can hit them
    shared_blocks: int  # ref_count > 1
    logical_blocks: int  # sum of the block-table lengths of the sequences on the GPU pool
    stored_tokens: int  # filled slots in used blocks (a shared block counts once)
    allocated_slots: int  # used_blocks * block_size
    waste: float  # (allocated_slots - stored_tokens) / allocated_slots; 0.0 when nothing is allocated
    prefix_query_tokens: int  # prompt tokens looked up in the prefix cache by admitted sequences
    prefix_hit_tokens: int  # of those, tokens served from cache
    shared_of_used: float  # shared_blocks / used_blocks: how much of the memory in use is shared; 0.0 if none
    num_seqs: int  # sequences on the GPU pool
    num_swapped_seqs: int  # sequences on the CPU pool
    cpu_total_blocks: int
    cpu_used_blocks: int
    bytes_per_block: int = 0  # K, V and (quantized) their scales of every layer; core/kv_bytes.py
    tier_total_blocks: int = 0  # the CPU tier of the prefix cache
    tier_cached_blocks: int = 0  # tier blocks holding a copy of an evicted prefix block
    tier_hit_tokens: int = 0  # of prefix_hit_tokens, those brought back from the CPU tier
    evicted_tokens: int = 0  # tokens whose blocks eviction policies released (StreamingLLM, H2O), so far
    # a demoting policy's pools per precision (core/eviction: Demote): blocks in use, of all, and
    # blocks demoted into each so far
    demoted_used_blocks: dict[str, int] = field(default_factory=dict)
    demoted_total_blocks: dict[str, int] = field(default_factory=dict)
    demotions: dict[str, int] = field(default_factory=dict)
    # KV-cache groups (kv_spec.py): what each group's layers read ("full attention", "sliding window of
    # 1024 tokens", ...), and the blocks the GPU-resident sequences' tables of each group hold
    group_kinds: list[str] = field(default_factory=list)
    group_blocks: list[int] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.total_blocks * self.bytes_per_block

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.bytes_per_block

    @property
    def usage(self) -> float:
        """Fraction of GPU blocks in use (what vLLM reports as KV-cache usage)."""
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def shared_of_total(self) -> float:
        """shared_blocks / total_blocks: the seed documents' "sharing rate" (seed 000 §5), which falls as the
        pool grows whatever the workload; `shared_of_used` is the one that describes the workload."""
        return self.shared_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        if not self.prefix_query_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens

    def as_dict(self) -> dict[str, float | int]:
        d = asdict(self)
        d["usage"] = self.usage
        d["prefix_hit_rate"] = self.prefix_hit_rate
        d["shared_of_total"] = self.shared_of_total
        d["total_bytes"], d["used_bytes"] = self.total_bytes, self.used_bytes
        return d


def collect_stats(pool, cpu_pool, prefix_cache, tier, bytes_per_block: int, *, logical_blocks: int, num_seqs: int,
                  num_swapped_seqs: int, evicted_tokens: int, cold=None, demotions=None,
                  groups: tuple[tuple[str, int], ...] = ()) -> CacheStats:  # fmt: skip
    """The snapshot, from the components' O(1) counters (the block pools, the prefix cache's
    query / hit counts, the CPU tier) and the manager's per-table sums."""
    used = pool.num_used
    allocated = used * pool.block_size
    return CacheStats(
        block_size=pool.block_size,
        total_blocks=pool.num_total,
        used_blocks=used,
        free_blocks=pool.num_free,
        cached_blocks=pool.num_cached_free,
        shared_blocks=pool.num_shared,
        logical_blocks=logical_blocks,
        stored_tokens=pool.num_used_tokens,
        allocated_slots=allocated,
        waste=(allocated - pool.num_used_tokens) / allocated if allocated else 0.0,
        prefix_query_tokens=prefix_cache.num_query_tokens if prefix_cache else 0,
        prefix_hit_tokens=prefix_cache.num_hit_tokens if prefix_cache else 0,
        shared_of_used=pool.num_shared / used if used else 0.0,
        num_seqs=num_seqs,
        num_swapped_seqs=num_swapped_seqs,
        cpu_total_blocks=cpu_pool.num_total,
        cpu_used_blocks=cpu_pool.num_used,
        bytes_per_block=bytes_per_block,
        tier_total_blocks=tier.pool.num_total if tier else 0,
        tier_cached_blocks=tier.num_cached if tier else 0,
        tier_hit_tokens=tier.num_hit_tokens if tier else 0,
        evicted_tokens=evicted_tokens,
        demoted_used_blocks={p: c.num_used for p, c in (cold or {}).items()},
        demoted_total_blocks={p: c.num_total for p, c in (cold or {}).items()},
        demotions={p: (demotions or {}).get(p, 0) for p in cold or {}},
        group_kinds=[kind for kind, _ in groups],
        group_blocks=[n for _, n in groups],
    )
