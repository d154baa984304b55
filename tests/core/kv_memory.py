"""A token-level model of the physical KV memory, for checking the core's data-flow plans.

The worker keeps K/V tensors indexed by slot; here each slot holds the token id whose KV it stores.
Applying the core's plans (slot mapping, copy-on-write pairs, swap mappings) to it and reading every
sequence back through its block table shows that no plan ever overwrote another sequence's KV.
"""

from __future__ import annotations

from kvpage.core import KVCacheManager, SlotAllocation


class KVMemory:
    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.gpu: dict[int, int] = {}  # slot -> token id
        self.cpu: dict[int, int] = {}

    def _copy_blocks(self, src: dict[int, int], dst: dict[int, int], pairs: list[tuple[int, int]]) -> None:
        bs = self.mgr.block_size
        for s, d in pairs:
            for off in range(bs):
                if s * bs + off in src:
                    dst[d * bs + off] = src[s * bs + off]
                else:
                    dst.pop(d * bs + off, None)

    def apply(self, seq_id: str, alloc: SlotAllocation, num_new: int) -> None:
        """Copy-on-write first, then write the new tokens' KV into their slots."""
        self._copy_blocks(self.gpu, self.gpu, alloc.copies)
        n = self.mgr.num_tokens(seq_id)
        tokens = self.mgr.token_ids(seq_id)
        for t, slot in zip(range(n - num_new, n), self.mgr.slot_mapping(seq_id, n - num_new, n), strict=True):
            self.gpu[slot] = tokens[t]

    def swap(self, pairs: list[tuple[int, int]], *, to_cpu: bool) -> None:
        if to_cpu:
            self._copy_blocks(self.gpu, self.cpu, pairs)
        else:
            self._copy_blocks(self.cpu, self.gpu, pairs)

    def read(self, seq_id: str) -> list[int | None]:
        bs = self.mgr.block_size
        mem = self.cpu if self.mgr.is_swapped(seq_id) else self.gpu
        table = self.mgr.block_table(seq_id)
        return [mem.get(table[t // bs] * bs + t % bs) for t in range(self.mgr.num_tokens(seq_id))]

    def check(self) -> None:
        for seq_id in self.mgr.seq_ids():
            assert self.read(seq_id) == self.mgr.token_ids(seq_id), f"{seq_id} reads back other KV"
