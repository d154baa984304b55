"""`MemoryMap`: where every KV block is, block by block, as plain data (the dashboard draws it).

`CacheStats` counts; this lists. For each block of the GPU pool, its state as one integer: its
reference count when in use (2 and more: shared by that many holders), `FREE` (0), or `CACHED`
(-1: free but still registered, a later request can hit it). The same for the CPU swap pool and the
CPU tier of the prefix cache (whose blocks are all free: `CACHED` or `FREE`). Then every block
table: its sequence's request and index, whether it is swapped out, its tokens, and its block ids,
`None` where an eviction policy or a window released a block (a hole); a model of several KV-cache
groups lists each sequence's table of every group (`group`). Samples and beams of one request show
where copy-on-write split them: their tables hold the same ids up to the block where they differ.

Built from the manager's own structures in one pass (O(blocks + table entries)); the engine builds it
between steps, only while somebody watches.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.core.block_pool import BlockPool

FREE, CACHED = 0, -1


@dataclass(slots=True, frozen=True)
class TableMap:
    request_id: str
    index: int  # the sample's or beam's index within its request
    on_cpu: bool  # swapped out: its ids are blocks of the CPU swap pool
    num_tokens: int
    block_ids: tuple[int | None, ...]  # None: a hole an eviction policy left
    group: int = 0  # the KV-cache group whose table it is (kv_spec.py)


@dataclass(slots=True, frozen=True)
class MemoryMap:
    block_size: int
    gpu: tuple[int, ...]  # per GPU block: reference count, FREE or CACHED
    cpu: tuple[int, ...]  # per block of the CPU swap pool
    tier: tuple[int, ...]  # per block of the prefix cache's CPU tier: CACHED or FREE
    tables: tuple[TableMap, ...]

    def as_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "gpu": list(self.gpu),
            "cpu": list(self.cpu),
            "tier": list(self.tier),
            "tables": [{"request_id": t.request_id, "index": t.index, "on_cpu": t.on_cpu,
                        "num_tokens": t.num_tokens, "block_ids": list(t.block_ids), "group": t.group}
                       for t in self.tables],
        }  # fmt: skip


def block_states(pool: BlockPool | None) -> tuple[int, ...]:
    if pool is None:
        return ()
    return tuple(b.ref_count or (CACHED if b.cache_key is not None else FREE) for b in pool.blocks)


def table_map(seq_id, table) -> TableMap:
    """One block table; `seq_id` is the scheduler's (request id, index) or any other name."""
    request_id, index = (seq_id[0], seq_id[1]) if isinstance(seq_id, tuple) else (str(seq_id), 0)
    return TableMap(str(request_id), int(index), table.on_cpu, table.num_tokens, tuple(table.block_ids), table.group)
