"""KV events: what a replica's prefix cache holds, announced as it changes, in vLLM's shape.

    BlockStored{block_hashes, parent_block_hash, token_ids, block_size, medium, group}   a block's KV is written
    BlockRemoved{block_hashes, medium}                                                  it is about to be reused
    AllBlocksCleared{}                                                                  reset_prefix_cache

`medium` is "gpu" (the block pool), "cpu" (the CPU tier) or "remote" (written to the fleet's
shared tier, remote_tier.py: announced stored once, never removed by a replica, not in a snapshot).
`group` is the KV-cache group whose layers' KV the block holds (kv_spec.py): 0 for a model of one
group, whose digests are group 0's, as a router hashes prompts; a later group's digests name it.
Digests are the core's SHA-256 chain hashes (cache_key.py) in hex: no per-process seed, so a router
that hashes a prompt with the same code and the request's cache_salt finds exactly the blocks a replica holds.

A block is announced stored only once the step that writes its KV has run (`PrefixRegistry.commit`):
a registration that `discard` drops is never announced, and neither is its eviction. Removals come
from the pools' one eviction point (`BlockPool.on_evict`). Events of a step are published together as
one numbered batch (`publish`); the last `capacity` batches are kept for readers that poll with
`since(seq)`, and one that fell behind (a gap) resynchronises from `snapshot()`: every block held now,
as of the latest batch. Publishing happens on the engine thread; readers (an HTTP endpoint, a
router) may be on others, so the published state is behind a lock.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from kvpage.core.cache_key import CacheKey
from kvpage.core.invariants import check

GPU, CPU, REMOTE = "gpu", "cpu", "remote"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[str]
    parent_block_hash: str | None
    token_ids: list[int]
    block_size: int
    medium: str
    group: int = 0
    type: str = "BlockStored"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[str]
    medium: str
    type: str = "BlockRemoved"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    type: str = "AllBlocksCleared"


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int  # 1, 2, ... per replica; a reader that saw seq n next expects n + 1
    events: list[KVEvent] = field(default_factory=list)


class KVEventLog:
    def __init__(self, block_size: int, capacity: int = 4096) -> None:
        self.block_size = block_size
        self._pending: list[KVEvent] = []
        self._now: dict[str, dict[str, CacheKey]] = {GPU: {}, CPU: {}}  # announced, this step's events included
        self._held: dict[str, dict[str, CacheKey]] = {GPU: {}, CPU: {}}  # as of the last batch published
        self._batches: deque[EventBatch] = deque(maxlen=capacity)
        self._seq = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the engine thread
    def stored(self, key: CacheKey, medium: str) -> None:
        digest = key.digest.hex()
        if digest not in self._now[medium]:
            self._now[medium][digest] = key
            self._pending.append(self._stored(key, medium))

    def stored_remote(self, key: CacheKey) -> None:
        """This replica wrote `key`'s block to the shared tier."""
        self._pending.append(self._stored(key, REMOTE))

    def removed(self, key: CacheKey, medium: str) -> None:
        """`key`'s block leaves `medium` (only announced blocks are announced gone)."""
        digest = key.digest.hex()
        if self._now[medium].pop(digest, None) is not None:
            self._pending.append(BlockRemoved([digest], medium))

    def cleared(self) -> None:
        self._now = {GPU: {}, CPU: {}}
        self._pending.append(AllBlocksCleared())

    def publish(self) -> EventBatch | None:
        """The step's events as one batch (None when nothing changed)."""
        if not self._pending:
            return None
        with self._lock:
            self._seq += 1
            batch = EventBatch(self._seq, self._pending)
            self._batches.append(batch)
            self._held = {m: dict(held) for m, held in self._now.items()}
        self._pending = []
        return batch

    def check_invariants(self, gpu: set[bytes], cpu: set[bytes]) -> None:
        """What the events announced is exactly what the pool's map holds committed (`gpu`) and what
        the CPU tier holds (`cpu`); between steps, that is also what readers see."""
        check(set(self._now[GPU]) == {d.hex() for d in gpu}, "the KV events announce other GPU blocks than are held")
        check(set(self._now[CPU]) == {d.hex() for d in cpu}, "the KV events announce other CPU-tier blocks")
        check(bool(self._pending) or self._held == self._now, "published KV events lag what was announced")

    # ------------------------------------------------------------------ readers (any thread)
    @property
    def seq(self) -> int:
        return self._seq

    def since(self, seq: int) -> tuple[list[EventBatch], bool]:
        """The batches after `seq`, and whether some are missing (older than the kept ones: resync
        from `snapshot`)."""
        with self._lock:
            batches = [b for b in self._batches if b.seq > seq]
            oldest = self._batches[0].seq if self._batches else self._seq + 1
        return batches, seq + 1 < oldest and seq < self._seq

    def snapshot(self) -> tuple[int, list[BlockStored]]:
        """Every block held as of batch `seq`, as BlockStored events."""
        with self._lock:
            out = [self._stored(k, m) for m, held in self._held.items() for k in held.values()]
            return self._seq, out

    def _stored(self, key: CacheKey, medium: str) -> BlockStored:
        parent = key.parent.hex() if key.parent is not None else None
        return BlockStored([key.digest.hex()], parent, list(key.token_ids), self.block_size, medium, key.group)
