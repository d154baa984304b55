"""The KV-cache manager: block tables of sequences over a GPU block pool and a CPU swap pool.

What the scheduler calls (plain data in, plain data out):

    prefix = find_cached_prefix(token_ids, cache_salt)   -> CachedPrefix (hit blocks, tokens covered)
    alloc  = allocate_slots(seq_id, new_token_ids, prefix) -> SlotAllocation, or None when no room
    mark_computed(seq_id, num_tokens)                    the KV of the first num_tokens is written
    free(seq_id)

and, for parallel sampling, beam search and preemption: `fork`, `swap_out`, `swap_in`,
`check_admission`. A block table grows one block at a time as tokens arrive; nothing is reserved
up to a maximum length. Each sequence's table obeys

    len(block_table) == ceil(num_tokens / block_size)

and token t sits in slot `block_table[t // B] * B + t % B` (see `slot_mapping`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvpage.core.admission import Admission, AdmissionStatus
from kvpage.core.block_pool import Block, BlockPool
from kvpage.core.cache_stats import CacheStats
from kvpage.core.prefix_cache import CacheKey, PrefixCache, extra_keys_for, hash_block


class InvariantError(AssertionError):
    """The manager's bookkeeping is inconsistent (a bug in kvpage, never a user error)."""


@dataclass(slots=True)
class CachedPrefix:
    """The longest run of leading full blocks of a prompt found in the prefix cache."""

    block_ids: list[int]
    block_hashes: list[bytes]  # the chain digests of those blocks
    num_tokens: int  # tokens covered: len(block_ids) * block_size
    num_query_tokens: int  # length of the prompt that was looked up
    cache_salt: str | None = None


@dataclass(slots=True)
class SlotAllocation:
    new_block_ids: list[int]  # blocks appended to the block table, in order
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy KV before writing


@dataclass(slots=True)
class _Sequence:
    block_ids: list[int]
    token_ids: list[int]
    cache_salt: str | None
    block_hashes: list[bytes]  # chain digests of leading full, computed blocks
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    on_cpu: bool = False


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, block_size, self.prefix_cache)
        self.cpu_pool = BlockPool(num_cpu_blocks, block_size)
        self.watermark_blocks = int(watermark * num_blocks)
        self._seqs: dict[str, _Sequence] = {}
        self._num_logical = 0  # sum of GPU block-table lengths
        self._num_swapped = 0

    # ------------------------------------------------------------------ queries
    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix_cache is not None

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: str) -> bool:
        return self._seq(seq_id).on_cpu

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._seq(seq_id).block_ids)

    def num_tokens(self, seq_id: str) -> int:
        return len(self._seq(seq_id).token_ids)

    def token_ids(self, seq_id: str) -> list[int]:
        return list(self._seq(seq_id).token_ids)

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Physical slots of tokens [start, end) of a GPU-resident sequence."""
        seq = self._seq(seq_id)
        if not 0 <= start <= end <= len(seq.token_ids):
            raise IndexError(f"tokens [{start}, {end}) outside a sequence of {len(seq.token_ids)}")
        bs, table = self.block_size, seq.block_ids
        return [table[t // bs] * bs + t % bs for t in range(start, end)]

    def seq_ids(self) -> list[str]:
        return list(self._seqs)

    # ------------------------------------------------------------------ prefix cache
    def find_cached_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> CachedPrefix:
        """Leading full blocks of `token_ids` already in the cache. The last token is never served
        from cache (its logits must be computed), so at most (len - 1) // block_size blocks hit."""
        prefix = CachedPrefix([], [], 0, len(token_ids), cache_salt)
        if self.prefix_cache is None:
            return prefix
        bs, parent = self.block_size, None
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            digest = hash_block(parent, chunk, extra_keys_for(i, cache_salt))
            block = self.prefix_cache.lookup(digest, chunk)
            if block is None:
                break
            prefix.block_ids.append(block.block_id)
            prefix.block_hashes.append(digest)
            parent = digest
        prefix.num_tokens = len(prefix.block_ids) * bs
        return prefix

    def mark_computed(self, seq_id: str, num_tokens: int) -> None:
        """The KV of the sequence's first `num_tokens` tokens is written: register its full blocks."""
        seq = self._seq(seq_id)
        if num_tokens > len(seq.token_ids):
            raise IndexError(f"{num_tokens} computed tokens but the sequence has {len(seq.token_ids)}")
        if self.prefix_cache is None or seq.on_cpu:
            return
        bs, num_full = self.block_size, num_tokens // self.block_size
        for i in range(seq.num_registered, num_full):
            chunk = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = seq.block_hashes[i - 1] if i else None
            if i == len(seq.block_hashes):
                seq.block_hashes.append(hash_block(parent, chunk, extra_keys_for(i, seq.cache_salt)))
            key = CacheKey(seq.block_hashes[i], parent, chunk, extra_keys_for(i, seq.cache_salt))
            self.prefix_cache.register(self.pool.blocks[seq.block_ids[i]], key)
        seq.num_registered = max(seq.num_registered, num_full)

    # ------------------------------------------------------------------ admission
    def check_admission(self, num_tokens: int, prefix: CachedPrefix | None = None) -> Admission:
        """Could a new sequence of `num_tokens` tokens get its blocks now, later, or never?
        NOW keeps `watermark_blocks` free for running sequences to grow into; NEVER means it would
        not fit even in an empty pool."""
        hits = self._prefix_blocks(prefix)
        total_needed = _cdiv(num_tokens, self.block_size)
        needed = total_needed - len(hits)
        available = self.pool.num_free - sum(b.ref_count == 0 for b in hits) - self.watermark_blocks
        if total_needed > self.pool.num_total:
            reason = (
                f"needs {total_needed} blocks of {self.block_size} tokens for {num_tokens} tokens, "
                f"but the whole cache holds {self.pool.num_total} blocks"
            )
            return Admission(AdmissionStatus.NEVER, needed, available, reason)
        status = AdmissionStatus.NOW if needed <= available else AdmissionStatus.LATER
        return Admission(status, needed, available)

    def num_blocks_needed(self, seq_id: str, num_new_tokens: int) -> int:
        """Blocks `allocate_slots(seq_id, <num_new_tokens tokens>)` would take, copy-on-write included."""
        seq = self._seq(seq_id)
        n = len(seq.token_ids)
        if num_new_tokens <= 0:
            return 0
        copy_last = n % self.block_size != 0 and self.pool.blocks[seq.block_ids[-1]].ref_count > 1
        return _cdiv(n + num_new_tokens, self.block_size) - len(seq.block_ids) + copy_last

    def num_blocks_to_swap_in(self, seq_ids: list[str]) -> int:
        return len({b for s in seq_ids for b in self._seq(s).block_ids})

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self, seq_id: str, new_token_ids: list[int], prefix: CachedPrefix | None = None
    ) -> SlotAllocation | None:
        """Give `new_token_ids` slots at the end of the sequence, creating it on first use (from
        `prefix`, whose blocks it then shares). Returns None, changing nothing, when the pool lacks
        room. Appending into a shared, partly filled last block first copies it (copy-on-write)."""
        pool, bs = self.pool, self.block_size
        seq = self._seqs.get(seq_id)
        if seq is None:
            hits = self._prefix_blocks(prefix)
            num_old, table_len = len(hits) * bs, len(hits)
            num_reserved = sum(b.ref_count == 0 for b in hits)  # hits we take off the free queue
            copy_last = False
        else:
            if prefix is not None:
                raise ValueError(f"sequence {seq_id!r} exists already; a prefix only starts one")
            if seq.on_cpu:
                raise RuntimeError(f"sequence {seq_id!r} is swapped out; swap it in first")
            num_old, table_len, num_reserved = len(seq.token_ids), len(seq.block_ids), 0
            copy_last = bool(new_token_ids) and num_old % bs != 0 and pool.blocks[seq.block_ids[-1]].ref_count > 1
        num_new_blocks = _cdiv(num_old + len(new_token_ids), bs) - table_len
        if num_new_blocks + copy_last > pool.num_free - num_reserved:
            return None

        # Committed from here on: nothing below can fail.
        if seq is None:
            for block in hits:
                pool.incref(block)
            seq = _Sequence(
                block_ids=[b.block_id for b in hits],
                token_ids=[t for b in hits for t in b.cache_key.token_ids],  # type: ignore[union-attr]
                cache_salt=prefix.cache_salt if prefix else None,
                block_hashes=list(prefix.block_hashes) if prefix else [],
                num_registered=len(hits),
            )
            self._seqs[seq_id] = seq
            self._num_logical += len(hits)
            if prefix is not None and self.prefix_cache is not None:
                self.prefix_cache.num_query_tokens += prefix.num_query_tokens
                self.prefix_cache.num_hit_tokens += prefix.num_tokens
        alloc = SlotAllocation(new_block_ids=[])
        if copy_last:
            old = pool.blocks[seq.block_ids[-1]]
            (new,) = pool.allocate(1)  # type: ignore[misc]
            pool.add_tokens(new, old.num_tokens)
            pool.decref(old)
            seq.block_ids[-1] = new.block_id
            alloc.copies.append((old.block_id, new.block_id))
        fresh = pool.allocate(num_new_blocks) or []
        seq.block_ids.extend(b.block_id for b in fresh)
        alloc.new_block_ids = [b.block_id for b in fresh]
        self._num_logical += num_new_blocks
        self._fill(pool, seq, num_old, len(new_token_ids))
        seq.token_ids.extend(new_token_ids)
        return alloc

    def free(self, seq_id: str) -> None:
        """Release a finished or aborted sequence; its blocks go back tail first."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        if seq.on_cpu:
            self.cpu_pool.free(self.cpu_pool.blocks[b] for b in seq.block_ids)
            self._num_swapped -= 1
        else:
            self.pool.free(self.pool.blocks[b] for b in seq.block_ids)
            self._num_logical -= len(seq.block_ids)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Make `child_id` share every block of `parent_id` (parallel samples, beams)."""
        parent = self._seq(parent_id)
        if parent.on_cpu:
            raise RuntimeError(f"sequence {parent_id!r} is swapped out; swap it in before forking")
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} exists already")
        for b in parent.block_ids:
            self.pool.incref(self.pool.blocks[b])
        self._seqs[child_id] = _Sequence(
            block_ids=list(parent.block_ids),
            token_ids=list(parent.token_ids),
            cache_salt=parent.cache_salt,
            block_hashes=list(parent.block_hashes),
            num_registered=parent.num_registered,
        )
        self._num_logical += len(parent.block_ids)

    # ------------------------------------------------------------------ swap
    def swap_out(self, seq_ids: list[str]) -> list[tuple[int, int]] | None:
        """Move these sequences' blocks to the CPU pool. Blocks shared among them move once.
        Returns the (gpu_block, cpu_block) copies to perform, or None (nothing changed) when the
        CPU pool is too small. The GPU blocks are released; cached ones stay hittable."""
        return self._move(seq_ids, to_cpu=True)

    def swap_in(self, seq_ids: list[str]) -> list[tuple[int, int]] | None:
        """Move swapped sequences back into fresh GPU blocks: (cpu_block, gpu_block) copies, or None."""
        return self._move(seq_ids, to_cpu=False)

    def _move(self, seq_ids: list[str], *, to_cpu: bool) -> list[tuple[int, int]] | None:
        src, dst = (self.pool, self.cpu_pool) if to_cpu else (self.cpu_pool, self.pool)
        seqs = [self._seq(s) for s in dict.fromkeys(seq_ids)]
        for s, seq in zip(dict.fromkeys(seq_ids), seqs):
            if seq.on_cpu == to_cpu:
                raise RuntimeError(f"sequence {s!r} is already {'swapped out' if to_cpu else 'resident'}")
        holders = Counter(b for seq in seqs for b in seq.block_ids)  # src block -> tables holding it
        fresh = dst.allocate(len(holders))
        if fresh is None:
            return None
        mapping = {}
        for src_id, dst_block in zip(holders, fresh):
            mapping[src_id] = dst_block.block_id
            dst.add_tokens(dst_block, src.blocks[src_id].num_tokens)
            for _ in range(holders[src_id] - 1):
                dst.incref(dst_block)
        for seq in seqs:
            src.free(src.blocks[b] for b in seq.block_ids)
            seq.block_ids = [mapping[b] for b in seq.block_ids]
            seq.on_cpu = to_cpu
            seq.num_registered = 0  # fresh GPU blocks get registered again by mark_computed
        delta = sum(len(seq.block_ids) for seq in seqs)
        self._num_logical += -delta if to_cpu else delta
        self._num_swapped += len(seqs) if to_cpu else -len(seqs)
        return list(mapping.items())

    # ------------------------------------------------------------------ statistics
    def stats(self) -> CacheStats:
        pool, pc = self.pool, self.prefix_cache
        used = pool.num_used
        allocated = used * self.block_size
        return CacheStats(
            block_size=self.block_size,
            total_blocks=pool.num_total,
            used_blocks=used,
            free_blocks=pool.num_free,
            cached_blocks=pool.num_cached_free,
            shared_blocks=pool.num_shared,
            logical_blocks=self._num_logical,
            stored_tokens=pool.num_used_tokens,
            allocated_slots=allocated,
            waste=(allocated - pool.num_used_tokens) / allocated if allocated else 0.0,
            prefix_query_tokens=pc.num_query_tokens if pc else 0,
            prefix_hit_tokens=pc.num_hit_tokens if pc else 0,
            sharing_ratio=pool.num_shared / used if used else 0.0,
            num_seqs=len(self._seqs) - self._num_swapped,
            num_swapped_seqs=self._num_swapped,
            cpu_total_blocks=self.cpu_pool.num_total,
            cpu_used_blocks=self.cpu_pool.num_used,
        )

    def check_invariants(self) -> None:
        """Recompute every piece of bookkeeping from scratch and compare; raise InvariantError."""
        bs = self.block_size
        for pool, on_cpu in ((self.pool, False), (self.cpu_pool, True)):
            refs = Counter(b for s in self._seqs.values() if s.on_cpu == on_cpu for b in s.block_ids)
            queued = pool.free_queue.block_ids()
            _check(len(queued) == len(set(queued)) == pool.num_free, "free queue length or duplicates")
            for block in pool.blocks:
                _check(
                    block.ref_count == refs[block.block_id],
                    f"block {block.block_id}: ref_count {block.ref_count} but {refs[block.block_id]} tables hold it",
                )
                _check(
                    (block.ref_count == 0) == (block in pool.free_queue),
                    f"block {block.block_id}: free iff unreferenced",
                )
                _check(0 <= block.num_tokens <= bs, f"block {block.block_id}: {block.num_tokens} tokens")
            used = [b for b in pool.blocks if b.ref_count > 0]
            _check(pool.num_free + len(used) == pool.num_total, "free + used != total")
            _check(pool.num_shared == sum(b.ref_count > 1 for b in used), "shared counter")
            _check(pool.num_used_tokens == sum(b.num_tokens for b in used), "used-token counter")
            _check(
                pool.num_cached_free == sum(b.cache_key is not None for b in pool.blocks if b.ref_count == 0),
                "cached counter",
            )
        _check(all(b.cache_key is None for b in self.cpu_pool.blocks), "a CPU block is registered")
        if self.prefix_cache is not None:
            for digest, block in self.prefix_cache.items():
                key = block.cache_key
                _check(key is not None and key.digest == digest, f"block {block.block_id}: hash map entry")
                _check(
                    key.is_consistent() and len(key.token_ids) == bs,  # type: ignore[union-attr]
                    f"block {block.block_id}: stored tokens do not hash to its key",
                )
            registered = sum(b.cache_key is not None for b in self.pool.blocks)
            _check(registered == len(self.prefix_cache), "a block carries a key the map does not hold")
        _check(
            self._num_logical == sum(len(s.block_ids) for s in self._seqs.values() if not s.on_cpu),
            "logical-block counter",
        )
        _check(self._num_swapped == sum(s.on_cpu for s in self._seqs.values()), "swapped counter")
        for seq_id, seq in self._seqs.items():
            n = len(seq.token_ids)
            pool = self.cpu_pool if seq.on_cpu else self.pool
            _check(len(seq.block_ids) == _cdiv(n, bs), f"{seq_id}: table length for {n} tokens")
            chain: list[bytes] = []  # the digests this sequence's full blocks must carry
            for i in range(n // bs):
                chunk = seq.token_ids[i * bs : (i + 1) * bs]
                chain.append(hash_block(chain[-1] if chain else None, chunk, extra_keys_for(i, seq.cache_salt)))
            _check(seq.block_hashes == chain[: len(seq.block_hashes)], f"{seq_id}: stale chain digests")
            for i, b in enumerate(seq.block_ids):
                block = pool.blocks[b]
                _check(block.num_tokens == min(bs, n - i * bs), f"{seq_id}: fill of block {b}")
                if block.cache_key is not None:
                    _check(
                        i < len(chain) and block.cache_key.digest == chain[i],
                        f"{seq_id}: block {b} is registered under content other than its tokens",
                    )

    # ------------------------------------------------------------------ helpers
    def _seq(self, seq_id: str) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _prefix_blocks(self, prefix: CachedPrefix | None) -> list[Block]:
        if prefix is None or not prefix.block_ids:
            return []
        blocks = [self.pool.blocks[b] for b in prefix.block_ids]
        for block, digest in zip(blocks, prefix.block_hashes):
            if block.cache_key is None or block.cache_key.digest != digest:
                raise RuntimeError("stale CachedPrefix: a hit block was reused since the lookup")
        return blocks

    @staticmethod
    def _fill(pool: BlockPool, seq: _Sequence, num_old: int, num_added: int) -> None:
        """Count `num_added` tokens into the blocks after position `num_old`."""
        bs, pos, end = pool.block_size, num_old, num_old + num_added
        while pos < end:
            take = min(end, (pos // bs + 1) * bs) - pos
            pool.add_tokens(pool.blocks[seq.block_ids[pos // bs]], take)
            pos += take


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvariantError(message)
