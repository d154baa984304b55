"""The block pool: fixed physical blocks, reference counts, and the LRU free queue.

A block is `block_size` token slots of KV storage somewhere (GPU or CPU memory); this module only
does the bookkeeping. Token t of a sequence lives in slot `block_table[t // B] * B + t % B`.

Freed blocks join the tail of the free queue and new blocks come from its head, so the block that
has been free the longest is reused first. A freed block that still carries a cache key stays a
prefix-cache hit until it reaches the head and is handed out again (its key is evicted then;
`on_evict` is the one point where eviction is announced, which the CPU tier listens to).
A sequence frees its blocks tail first, so the ends of sequences are evicted before shared heads.

The counters (`num_cached_free`, `num_shared`, `num_used_tokens`) are kept up to date on every
transition so statistics are O(1); `check_invariants` recomputes them from scratch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from kvpage.core.block import Block
from kvpage.core.free_block_queue import FreeBlockQueue
from kvpage.core.invariants import check
from kvpage.core.prefix_cache import PrefixCache


class BlockPool:
    """`num_blocks` blocks of `block_size` slots. `prefix_cache` is None for pools that never
    serve hits (the CPU swap pool, or the GPU pool with prefix caching off)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: PrefixCache | None = None):
        self.on_evict: Callable[[Block], None] | None = None  # told of a registered block about to be reused
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.prefix_cache = prefix_cache
        self.num_cached_free = 0  # free blocks still registered in the prefix cache
        self.num_shared = 0  # blocks with ref_count > 1
        self.num_used_tokens = 0  # filled slots over all blocks in use

    @property
    def num_total(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used(self) -> int:
        return len(self.blocks) - self.free_queue.num_free

    def allocate(self, n: int) -> list[Block] | None:
        """Take `n` blocks from the head of the free queue, each with ref_count 1 and no tokens.
        Returns None and changes nothing when fewer than `n` are free."""
        if n > self.free_queue.num_free:
            return None
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.cache_key is not None:
                self.num_cached_free -= 1
                if self.on_evict is not None:  # its KV is still intact: the CPU tier may keep a copy
                    self.on_evict(block)
                if self.prefix_cache is not None:
                    self.prefix_cache.evict(block)
                block.cache_key = None
            block.ref_count = 1
            block.num_tokens = 0
            out.append(block)
        return out

    def incref(self, block: Block) -> None:
        """Take one more reference: a prefix-cache hit, a fork, or a second holder during a swap."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
            self.num_used_tokens += block.num_tokens
            if block.cache_key is not None:
                self.num_cached_free -= 1
        elif block.ref_count == 1:
            self.num_shared += 1
        block.ref_count += 1

    def decref(self, block: Block) -> None:
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
        block.ref_count -= 1
        if block.ref_count == 1:
            self.num_shared -= 1
        elif block.ref_count == 0:
            self.num_used_tokens -= block.num_tokens
            self.free_queue.append(block)
            if block.cache_key is not None:
                self.num_cached_free += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference to each of a sequence's blocks, last block first (tails evicted first)."""
        for block in reversed(list(blocks)):
            self.decref(block)

    def uncache(self, block: Block) -> None:
        """Forget a registered block's content (its KV turned out never to be written)."""
        if block.cache_key is None:
            return
        if block.ref_count == 0:
            self.num_cached_free -= 1
        if self.prefix_cache is not None:
            self.prefix_cache.evict(block)
        block.cache_key = None

    def reset_prefix_cache(self) -> bool:
        """Forget every registered block (vLLM's reset_prefix_cache). Only when no block is in use:
        False, and nothing changes, otherwise. The hit/query counters keep counting (they are totals)."""
        if self.num_used:
            return False
        for block in self.blocks:
            self.uncache(block)
        return True

    def add_tokens(self, block: Block, n: int) -> None:
        """Record that `n` more slots of an in-use block now hold tokens."""
        block.num_tokens += n
        self.num_used_tokens += n

    def check_invariants(self, refs: Counter[int]) -> None:
        """Every counter and the free queue recomputed from scratch; `refs`: block id -> how many
        holders (tables, sink copies) reference it."""
        queued = self.free_queue.block_ids()
        check(len(queued) == len(set(queued)) == self.num_free, "free queue length or duplicates")
        for block in self.blocks:
            check(
                block.ref_count == refs[block.block_id],
                lambda: f"block {block.block_id}: ref_count {block.ref_count} but {refs[block.block_id]} holders",
            )
            check(
                (block.ref_count == 0) == (block in self.free_queue),
                lambda: f"block {block.block_id}: free iff unreferenced",
            )
            check(
                0 <= block.num_tokens <= self.block_size, lambda: f"block {block.block_id}: {block.num_tokens} tokens"
            )
        used = [b for b in self.blocks if b.ref_count > 0]
        check(self.num_free + len(used) == self.num_total, "free + used != total")
        check(self.num_shared == sum(b.ref_count > 1 for b in used), "shared counter")
        check(self.num_used_tokens == sum(b.num_tokens for b in used), "used-token counter")
        check(self.num_cached_free == sum(b.cache_key is not None for b in self.blocks if b.ref_count == 0),
              "cached counter")  # fmt: skip
