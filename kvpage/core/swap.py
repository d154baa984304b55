"""Swap space: the CPU pool that preempted sequences' blocks move to, and back from.

A move copies the distinct resident blocks of a group of sequences into fresh blocks of the other
pool (a block several of them share moves once and stays shared), releases the originals and
repoints the tables; holes stay holes. The returned (src, dst) pairs are the worker's copies, done
before the step. GPU blocks released by a swap-out that are registered stay prefix-cache hits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvpage.core.block import Block
from kvpage.core.block_pool import BlockPool
from kvpage.core.block_table import BlockTable
from kvpage.core.invariants import check


class SwapSpace:
    def __init__(self, num_blocks: int, gpu: BlockPool) -> None:
        self.gpu = gpu
        self.pool = BlockPool(num_blocks, gpu.block_size)  # never registered: swapped blocks are no hits

    @property
    def enabled(self) -> bool:
        return self.pool.num_total > 0

    @staticmethod
    def blocks_to_move(tables: Sequence[BlockTable]) -> int:
        return len({b for t in tables for b in t.resident})

    def swap_out(
        self, tables: Sequence[BlockTable], before_release: Callable[[], object]
    ) -> list[tuple[int, int]] | None:
        """GPU -> CPU, or None (nothing changes) when the CPU pool lacks room. `before_release` runs
        once the move is certain, before any GPU block is released (it drops derived blocks)."""
        fresh = self.pool.allocate(self.blocks_to_move(tables))
        if fresh is None:
            return None
        before_release()
        return self._move(tables, self.gpu, self.pool, fresh, to_cpu=True)

    def swap_in(self, tables: Sequence[BlockTable]) -> list[tuple[int, int]] | None:
        """CPU -> fresh GPU blocks, or None (nothing changes) when the GPU pool lacks room."""
        fresh = self.gpu.allocate(self.blocks_to_move(tables))
        if fresh is None:
            return None
        return self._move(tables, self.pool, self.gpu, fresh, to_cpu=False)

    @staticmethod
    def _move(tables: Sequence[BlockTable], src: BlockPool, dst: BlockPool, fresh: list[Block],
              *, to_cpu: bool) -> list[tuple[int, int]]:  # fmt: skip
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
