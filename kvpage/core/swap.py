"""Swap space: the CPU pool that preempted sequences' blocks move to, and back from.

A move copies the distinct resident blocks of a group of sequences into fresh blocks of the other
pool (a block several of them share moves once and stays shared), releases the originals and
repoints the tables; holes stay holes. The returned (src, dst) pairs are the worker's copies, done
before the step. GPU blocks released by a swap-out that are registered stay prefix-cache hits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvpage.core.block import Block
from kvpage.core.block_pool import BlockPool
from kvpage.core.block_table import BlockTable
from kvpage.core.invariants import check


class SwapSpace:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)  # never registered: swapped blocks are no hits

    @property
    def enabled(self) -> bool:
        return self.pool.num_total > 0

    @staticmethod
    def blocks_to_move(tables: Sequence[BlockTable]) -> int:
        return len({b for t in tables for b in t.resident})

    def reserve(self, tables: Sequence[BlockTable], dst: BlockPool) -> list[Block] | None:
        """Blocks of `dst` for a move of `tables`, or None (nothing changes) when `dst` lacks room."""
        return dst.allocate(self.blocks_to_move(tables))

    def move(self, tables: Sequence[BlockTable], src: BlockPool, dst: BlockPool, fresh: list[Block],
             *, to_cpu: bool) -> list[tuple[int, int]]:  # fmt: skip
        """Copy `tables`' blocks from `src` into `fresh` (from `reserve`), release the originals."""
        holders = Counter(b for t in tables for b in t.resident)  # src block -> tables holding it
        mapping = {}
        for src_id, dst_block in zip(holders, fresh, strict=True):
            mapping[src_id] = dst_block.block_id
            dst.add_tokens(dst_block, src.blocks[src_id].num_tokens)
            for _ in range(holders[src_id] - 1):
                dst.incref(dst_block)
        for table in tables:
            src.free(src.blocks[b] for b in table.resident)
            table.remap(mapping, on_cpu=to_cpu)
        return list(mapping.items())

    def free(self, table: BlockTable) -> None:
        self.pool.free(self.pool.blocks[b] for b in table.resident)

    def check_invariants(self) -> None:
        check(all(b.cache_key is None for b in self.pool.blocks), "a CPU block is registered")
