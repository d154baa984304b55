"""The CPU tier of the prefix cache: copies of evicted prefix blocks, hittable after the GPU pool
reused the originals.

When the GPU pool hands out a registered block whose KV a committed step wrote (`BlockPool.on_evict`),
the tier copies it into one of its own blocks under the same key. The tier is a pool of its own whose
blocks all sit free and registered, so its LRU queue evicts the oldest copy. A lookup that misses in
the GPU pool asks the tier (prefix_registry.py); a tier hit takes a fresh GPU block and a (tier, GPU)
copy that the worker runs before the step, after the step's offloads. A tier block read this step is
pinned (referenced) until the step ends, so no offload of the same step can overwrite it. Blocks
fetched from the shared tier (remote_tier.py) `land` here the same way: registered, pinned for the
step, their bytes written by the worker after the step's offloads and before its restores.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvpage.core.block import Block
from kvpage.core.block_pool import BlockPool
from kvpage.core.cache_key import CacheKey
from kvpage.core.invariants import check
from kvpage.core.kv_events import CPU, KVEventLog
from kvpage.core.prefix_cache import PrefixCache


class CpuTier:
    def __init__(self, num_blocks: int, block_size: int, events: KVEventLog | None = None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size, PrefixCache())
        self.events = events
        if events is not None:  # the oldest copy makes room: announced gone from the "cpu" medium
            self.pool.on_evict = lambda block: events.removed(block.cache_key, CPU)  # type: ignore[arg-type]
        self._offloads: list[tuple[int, int]] = []  # (GPU block, tier block) copies for the step
        self._restores: list[tuple[int, int]] = []  # (tier block, GPU block)
        self._imports: list[tuple[int, bytes]] = []  # (tier block, payload) fetched from the shared tier
        self._pinned: list[Block] = []  # tier blocks read by the step
        self.num_hit_tokens = 0

    @property
    def num_cached(self) -> int:
        return len(self.pool.prefix_cache)  # type: ignore[arg-type]

    def lookup(self, digest: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The tier block holding this content, if any."""
        block = self.pool.prefix_cache.lookup(digest, token_ids)  # type: ignore[union-attr]
        return block.block_id if block is not None else None

    def holds(self, tier_block_id: int, digest: bytes) -> bool:
        """Whether a tier block found by `lookup` still holds that content."""
        key = self.pool.blocks[tier_block_id].cache_key
        return key is not None and key.digest == digest

    def offload(self, block: Block) -> None:
        """`block` (committed KV) is about to be reused: keep a copy of its KV here."""
        key = block.cache_key
        if key is None or not self.pool.num_free:
            return  # a tier whose blocks are all being read is full
        if self.pool.prefix_cache.lookup(key.digest, key.token_ids) is not None:  # type: ignore[union-attr]
            return
        tb = self._take(key)
        self.pool.decref(tb)  # free and registered: hittable until the tier hands it out again
        self._offloads.append((block.block_id, tb.block_id))

    def land(self, key: CacheKey, payload: bytes) -> int | None:
        """A block fetched from the shared tier (remote_tier.py): a tier block registered under `key`,
        pinned until the step ends (no offload of the step may reuse it before the worker writes
        `payload` into it). None when every tier block is pinned."""
        if not self.pool.num_free:
            return None
        tb = self._take(key)
        self._pinned.append(tb)
        self._imports.append((tb.block_id, payload))
        return tb.block_id

    def _take(self, key: CacheKey) -> Block:
        """A tier block (the oldest copy makes room) registered under `key`, referenced, announced."""
        (tb,) = self.pool.allocate(1)  # type: ignore[misc]
        self.pool.prefix_cache.register(tb, key)  # type: ignore[union-attr]
        if self.events is not None:
            self.events.stored(key, CPU)
        return tb

    def restore(
        self, hits: dict[int, int], gpu: BlockPool, register: Callable[[Block, CacheKey], None]
    ) -> dict[int, int]:
        """Fresh GPU blocks for tier hits {table index: tier block}, each registered under the
        tier block's key by `register` and filled by a (tier, GPU) copy. Returns {index: GPU block}."""
        tiered = {i: self.pool.blocks[t] for i, t in hits.items()}
        for tb in tiered.values():  # pinned before the GPU pool evicts (and so offloads) anything
            self.pool.incref(tb)
            self._pinned.append(tb)
        out = {}
        for i, tb in tiered.items():
            (new,) = gpu.allocate(1)  # type: ignore[misc]  # admission counted it
            gpu.add_tokens(new, self.block_size)
            register(new, tb.cache_key)  # type: ignore[arg-type]
            self._restores.append((tb.block_id, new.block_id))
            out[i] = new.block_id
        self.num_hit_tokens += len(tiered) * self.block_size
        return out

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, bytes]], list[tuple[int, int]]]:
        """The step's (GPU, tier) offload copies, (tier, payload) landings and (tier, GPU) restore
        copies, in that order."""
        out = (self._offloads, self._imports, self._restores)
        self._offloads, self._imports, self._restores = [], [], []
        return out

    def unpin(self) -> None:
        """The step ended (or failed): the tier blocks it read may be reused."""
        for tb in self._pinned:
            self.pool.decref(tb)
        self._pinned.clear()

    def reset(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Free registered copies, but those the step is reading."""
        pins = Counter(b.block_id for b in self._pinned)
        cache = self.pool.prefix_cache
        for block in self.pool.blocks:
            check(block.ref_count == pins[block.block_id], lambda: f"tier block {block.block_id}: ref_count")
            check((block.ref_count == 0) == (block in self.pool.free_queue), "tier block: free iff unpinned")
            key = block.cache_key
            check(key is None or (key.is_consistent() and cache.lookup(key.digest, key.token_ids) is block),  # type: ignore[union-attr]
                  lambda: f"tier block {block.block_id}: its key is not the map's")  # fmt: skip
        registered = sum(b.cache_key is not None for b in self.pool.blocks)
        check(registered == self.num_cached, "a tier block carries a key the tier's map does not hold")
        check(self.pool.num_used_tokens == 0, "tier token counter")
        check(all(b.cache_key is not None for b in self._pinned), "a pinned tier block lost its key")
