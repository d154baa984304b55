"""The KV-cache manager: block tables of sequences over a GPU block pool and a CPU swap pool.

What the scheduler calls (plain data in, plain data out):

    adm    = check_admission(token_lists, cache_salt)     -> Admission (now / later / never, and the plan)
    admit(seq_ids, token_lists, adm)                      a request's sequences enter, sharing blocks
    alloc  = allocate_slots(seq_id, num_new_tokens)       -> SlotAllocation, or None when no room
    cache_blocks(seq_id, token_ids, num_tokens)           full blocks among the first num_tokens become hits
    commit() / discard_uncommitted()                      the step ran / the step failed
    free(seq_id)

and, for parallel sampling, beam search and preemption: `fork`, `swap_out`, `swap_in`. With a CPU
tier (`num_tier_blocks`), `take_tier_transfers()` hands the scheduler each step's copies. For a
sequence with an eviction policy (core/eviction.py): `evict(seq_id, mass)` after each step releases
the blocks the policy drops, `prepare_sinks(seq_id)` keeps StreamingLLM's sink blocks rotated, and
`attention_table(seq_id)` is what attention reads. The manager
owns blocks, not tokens: token ids belong to the request and are passed in where content matters
(hashing a full block). A block table grows one block at a time; nothing is reserved up to a
maximum length. Each sequence's table obeys

    len(block_table) == ceil(num_tokens / block_size)        num_tokens: tokens with a slot

and token t sits in slot `block_table[t // B] * B + t % B` (see `slot_mapping`).

Holes: a block an eviction policy released stays in the table as HOLE (-1), so logical indices (and
the chain of digests) keep their meaning; only full blocks before the last can be holes, and
attention reads the table without them (`attention_table`: the compacted table and how many tokens
are missing from it, always whole blocks before the window). A sequence that has evicted anything
registers no more blocks in the prefix cache: what it computes afterwards attended to a partial
context, so it is not the KV those tokens have in anyone else's sequence. StreamingLLM sequences
also hold rotated copies of their sink blocks once they evict (`prepare_sinks`): the originals may
be shared, so the rotation is written into private blocks, always from the original (no drift).

In-batch prefix sharing: `cache_blocks` registers a full block as soon as the step that writes its
KV is scheduled, so a sequence admitted later in the same step hits it. That is safe because every
layer writes all of a step's new K/V before any sequence attends. Registrations wait in an
"uncommitted" list until `commit()`; if the step fails, `discard_uncommitted()` forgets them so no
one can hit a block whose KV was never written.

The CPU tier of the prefix cache: when the pool hands out a registered block whose KV a committed
step wrote (`BlockPool.on_evict`), the manager copies it into a tier block under the same key (the
tier is a pool of its own whose blocks all sit free and registered, so its LRU queue evicts the
oldest copy). A lookup that misses in the pool asks the tier; a tier hit takes a fresh pool block,
registered at once (uncommitted, like a block the step computes), and a (tier, pool) copy that the
worker runs before the step, after the step's offloads. A tier block read this step is pinned
(referenced) until the step ends, so no offload of the same step can overwrite it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from kvpage.core.admission import Admission, AdmissionStatus
from kvpage.core.block_pool import Block, BlockPool
from kvpage.core.cache_stats import CacheStats
from kvpage.core.eviction import EvictionPolicy
from kvpage.core.prefix_cache import CacheKey, PrefixCache, extra_keys_for, hash_block

SeqId = Hashable  # opaque to the manager: the scheduler uses (request_id, index)
HOLE = -1  # a block-table entry whose block an eviction policy released


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
    tier_block_ids: dict[int, int] = field(default_factory=dict)  # index -> tier block (block_ids holds -1)


@dataclass(slots=True)
class SlotAllocation:
    new_block_ids: list[int]  # blocks appended to the block table, in order
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy KV before writing


@dataclass(slots=True)
class _Sequence:
    block_ids: list[int]
    num_tokens: int  # tokens with a slot
    cache_salt: str | None
    block_hashes: list[bytes]  # chain digests of leading full blocks (as far as they were hashed)
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    on_cpu: bool = False
    policy: EvictionPolicy | None = None
    num_evicted: int = 0  # tokens whose blocks were released (HOLE entries * block_size)
    scores: list[float] = field(default_factory=list)  # H2O: attention mass per logical block, accumulated
    sink_copies: list[int] = field(default_factory=list)  # StreamingLLM: rotated copies of the sink blocks
    sink_shift: int = 0  # the positions those copies are rotated by

    @property
    def resident(self) -> list[int]:
        return [b for b in self.block_ids if b != HOLE]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        bytes_per_block: int = 0,  # what one block costs (kv_bytes.py), for CacheStats; 0: not known
        num_tier_blocks: int = 0,  # the CPU tier of the prefix cache (prefix caching only)
    ) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, block_size, self.prefix_cache)
        self.cpu_pool = BlockPool(num_cpu_blocks, block_size)
        self.watermark_blocks = int(watermark * num_blocks)
        self._seqs: dict[SeqId, _Sequence] = {}
        self._num_logical = 0  # sum of GPU block-table lengths
        self._num_swapped = 0
        self._uncommitted: list[Block] = []  # registered by the step being run
        self.tier = None  # the CPU tier: a pool whose blocks all sit free and registered
        if self.prefix_cache is not None and num_tier_blocks:
            self.tier = BlockPool(num_tier_blocks, block_size, PrefixCache())
            self.pool.on_evict = self._offload
        self._offloads: list[tuple[int, int]] = []  # (pool block, tier block) copies for the step
        self._restores: list[tuple[int, int]] = []  # (tier block, pool block)
        self._pinned: list[Block] = []  # tier blocks read by the step
        self.num_tier_hit_tokens = 0
        self.num_evicted_tokens = 0  # released by eviction policies, since the start

    # ------------------------------------------------------------------ queries
    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix_cache is not None

    def has_sequence(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: SeqId) -> bool:
        return self._seq(seq_id).on_cpu

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The logical table (HOLE where a policy released a block)."""
        return list(self._seq(seq_id).block_ids)

    def attention_table(self, seq_id: SeqId) -> tuple[list[int], int]:
        """What attention reads: the resident blocks in order (a StreamingLLM sequence's sink blocks
        replaced by their rotated copies) and the number of tokens missing before them."""
        seq = self._seq(seq_id)
        if not seq.num_evicted:
            return list(seq.block_ids), 0
        table = seq.resident
        if self._num_sinks(seq):
            if not seq.sink_copies or seq.sink_shift != seq.num_evicted:
                raise RuntimeError(f"sequence {seq_id!r}: sink copies are stale; call prepare_sinks first")
            table[: len(seq.sink_copies)] = seq.sink_copies
        return table, seq.num_evicted

    def num_evicted(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_evicted

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_tokens

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Physical slots of tokens [start, end) of a GPU-resident sequence."""
        seq = self._seq(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise IndexError(f"tokens [{start}, {end}) outside a sequence of {seq.num_tokens}")
        bs, table = self.block_size, seq.block_ids
        return [table[t // bs] * bs + t % bs for t in range(start, end)]

    def seq_ids(self) -> list[SeqId]:
        return list(self._seqs)

    # ------------------------------------------------------------------ prefix cache
    def find_cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> CachedPrefix:
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
                tier_block = self.tier.prefix_cache.lookup(digest, chunk) if self.tier is not None else None
                if tier_block is None:
                    break
                prefix.tier_block_ids[i] = tier_block.block_id
            prefix.block_ids.append(block.block_id if block is not None else -1)
            prefix.block_hashes.append(digest)
            parent = digest
        prefix.num_tokens = len(prefix.block_ids) * bs
        return prefix

    def cache_blocks(self, seq_id: SeqId, token_ids: Sequence[int], num_tokens: int) -> None:
        """The KV of the sequence's first `num_tokens` tokens (`token_ids[:num_tokens]`) is written,
        or is being written by the step now scheduled: register its full blocks as prefix-cache hits."""
        seq = self._seq(seq_id)
        if num_tokens > seq.num_tokens:
            raise IndexError(f"{num_tokens} cached tokens but the sequence has slots for {seq.num_tokens}")
        if num_tokens > len(token_ids):
            raise IndexError(f"{num_tokens} cached tokens but only {len(token_ids)} token ids were given")
        if self.prefix_cache is None or seq.on_cpu or seq.num_evicted:
            return
        bs, num_full = self.block_size, num_tokens // self.block_size
        for i in range(seq.num_registered, num_full):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = seq.block_hashes[i - 1] if i else None
            if i == len(seq.block_hashes):
                seq.block_hashes.append(hash_block(parent, chunk, extra_keys_for(i, seq.cache_salt)))
            block = self.pool.blocks[seq.block_ids[i]]
            key = CacheKey(seq.block_hashes[i], parent, chunk, extra_keys_for(i, seq.cache_salt))
            if self.prefix_cache.register(block, key):
                self._uncommitted.append(block)
        seq.num_registered = max(seq.num_registered, num_full)

    def commit(self) -> None:
        """The scheduled step ran: every block registered for it now holds its KV."""
        self._uncommitted.clear()
        self._unpin()

    def take_tier_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (pool, tier) offload copies and (tier, pool) restore copies, in that order."""
        out = (self._offloads, self._restores)
        self._offloads, self._restores = [], []
        return out

    def _offload(self, block: Block) -> None:
        """`block` is about to be reused: keep a copy of its KV in the tier (if it was ever written)."""
        key = block.cache_key
        tier = self.tier
        if key is None or tier is None or block in self._uncommitted or not tier.num_free:
            return  # an uncommitted block's KV is not written yet; a tier whose blocks are all being read is full
        if tier.prefix_cache.lookup(key.digest, key.token_ids) is not None:
            return
        (tb,) = tier.allocate(1)  # the oldest copy makes room
        tier.prefix_cache.register(tb, key)
        tier.decref(tb)  # free and registered: hittable until the tier hands it out again
        self._offloads.append((block.block_id, tb.block_id))

    def _unpin(self) -> None:
        for tb in self._pinned:
            self.tier.decref(tb)  # type: ignore[union-attr]
        self._pinned.clear()

    def discard_uncommitted(self) -> None:
        """The scheduled step failed: forget the blocks registered for it (their KV was never written).
        Call before freeing the step's sequences."""
        for block in self._uncommitted:
            if block.cache_key is not None:
                self.pool.uncache(block)
        self._unpin()
        for seq in self._seqs.values():  # re-registration must start where the valid blocks end
            while seq.num_registered and not seq.on_cpu:
                b = seq.block_ids[seq.num_registered - 1]
                if b == HOLE or self.pool.blocks[b].cache_key is not None:
                    break
                seq.num_registered -= 1
        self._uncommitted.clear()

    # ------------------------------------------------------------------ admission
    def check_admission(
        self,
        token_lists: Sequence[Sequence[int]],
        cache_salt: str | None = None,
        *,
        use_prefix_cache: bool = True,
        keep_watermark: bool = True,
    ) -> Admission:
        """Could a request whose live sequences hold `token_lists` (lead first) get all their slots
        now, later, or never? NOW keeps `watermark_blocks` free for running sequences to grow into
        when `keep_watermark`; NEVER means it would not fit even in an empty pool, cache hits or not.
        The plan (lead's hits, blocks each sequence shares with the lead) is valid until the pool
        changes: pass it straight to `admit`."""
        if not token_lists or not all(token_lists):
            raise ValueError("a request needs at least one sequence of at least one token")
        bs, lead = self.block_size, token_lists[0]
        prefix = (
            self.find_cached_prefix(lead, cache_salt) if use_prefix_cache else CachedPrefix([], [], 0, 0, cache_salt)
        )
        shared = [0] + [min(_common_prefix(lead, t), len(t) - 1) // bs for t in token_lists[1:]]
        total = _cdiv(len(lead), bs) + sum(_cdiv(len(t), bs) - m for t, m in zip(token_lists[1:], shared[1:]))
        hits = self._prefix_blocks(prefix)
        needed = total - len(hits)  # a hit on the CPU tier takes a new block too
        available = self.pool.num_free - sum(b.ref_count == 0 for b in hits)
        available -= self.watermark_blocks if keep_watermark else 0
        if total > self.pool.num_total:
            seqs = f"its {len(token_lists)} sequences need" if len(token_lists) > 1 else "it needs"
            reason = (
                f"{seqs} {total} blocks of {bs} tokens for {sum(map(len, token_lists))} tokens, "
                f"but the whole cache holds {self.pool.num_total} blocks"
            )
            return Admission(AdmissionStatus.NEVER, needed, available, reason, prefix, shared)
        status = AdmissionStatus.NOW if needed <= available else AdmissionStatus.LATER
        return Admission(status, needed, available, None, prefix, shared)

    def admit(
        self,
        seq_ids: Sequence[SeqId],
        token_lists: Sequence[Sequence[int]],
        adm: Admission,
        policy: EvictionPolicy | None = None,
    ) -> None:
        """Create a request's sequences with slots for all their tokens, as `check_admission` planned
        (it must have answered NOW, with nothing allocated since). Nothing is registered: the caller
        registers what each step computes with `cache_blocks`. `policy`: the sequences' eviction policy."""
        if adm.status is not AdmissionStatus.NOW or not len(adm.shared_blocks) == len(seq_ids) == len(token_lists):
            raise RuntimeError("admit() needs a NOW admission for exactly these sequences")
        if adm.blocks_needed > self.pool.num_free - sum(b.ref_count == 0 for b in self._prefix_blocks(adm.prefix)):
            raise RuntimeError("stale Admission: the pool changed since check_admission")
        taken = [s for s in seq_ids if s in self._seqs]
        if taken or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"admit() needs new, distinct sequence ids; got {list(seq_ids)!r}")
        lead, lead_tokens = seq_ids[0], token_lists[0]
        prefix = adm.prefix
        self._create(lead, prefix, policy)
        self._grow(self._seqs[lead], len(lead_tokens) - prefix.num_tokens)  # type: ignore[union-attr]
        for seq_id, tokens, m in zip(seq_ids[1:], token_lists[1:], adm.shared_blocks[1:], strict=True):
            self.fork(lead, seq_id, num_blocks=m)
            self._grow(self._seqs[seq_id], len(tokens) - m * self.block_size)

    def num_blocks_needed(self, seq_id: SeqId, num_new_tokens: int) -> int:
        """Blocks `allocate_slots(seq_id, num_new_tokens)` would take, copy-on-write included."""
        return self._growth_blocks([(seq_id, num_new_tokens)])

    def num_blocks_to_grow(self, growth: Sequence[tuple[SeqId, int]]) -> int:
        """Blocks that `allocate_slots(seq_id, n)` for each (seq_id, n), in this order, would take.
        Exact for sequences sharing a partly filled last block: of r appenders to a block that R
        tables hold, r - 1 copy it, and the last one copies too only if someone else still holds it.
        StreamingLLM sink copies that `prepare_sinks` will take for them are included."""
        return self._growth_blocks(growth) + self.num_blocks_for_sinks([s for s, _ in growth])

    def _growth_blocks(self, growth: Sequence[tuple[SeqId, int]]) -> int:
        bs, total = self.block_size, 0
        appenders: Counter[int] = Counter()
        for seq_id, n in growth:
            seq = self._seq(seq_id)
            if n <= 0:
                continue
            total += _cdiv(seq.num_tokens + n, bs) - len(seq.block_ids)
            if seq.num_tokens % bs:
                appenders[seq.block_ids[-1]] += 1
        for block_id, r in appenders.items():
            total += r - 1 + (self.pool.blocks[block_id].ref_count > r)
        return total

    def num_blocks_for_sinks(self, seq_ids: Sequence[SeqId]) -> int:
        """Blocks `prepare_sinks` would take for these sequences: new copies for a sequence that has
        none, and for those sharing stale copies all but the last one of r (and that one too if
        someone else still holds them)."""
        total, stale = 0, Counter()
        size: dict[int, int] = {}  # a shared copy group's blocks (its holders share one policy)
        for seq_id in dict.fromkeys(seq_ids):
            seq = self._seq(seq_id)
            n = self._num_sinks(seq)
            if not n or (seq.sink_copies and seq.sink_shift == seq.num_evicted):
                continue
            if not seq.sink_copies:
                total += n
            else:
                stale[seq.sink_copies[0]] += 1
                size[seq.sink_copies[0]] = n
        for first, r in stale.items():
            holders = self.pool.blocks[first].ref_count
            total += (r - 1 + (holders > r)) * size[first]
        return total

    def _num_sinks(self, seq: _Sequence) -> int:
        """Sink blocks this sequence keeps rotated: StreamingLLM's, once it evicted anything."""
        if seq.policy is None or not seq.policy.reposition or not seq.num_evicted:
            return 0
        return seq.policy.sink_blocks(self.block_size)

    def num_blocks_to_swap_in(self, seq_ids: Sequence[SeqId]) -> int:
        return len({b for s in seq_ids for b in self._seq(s).resident})

    def can_swap_in(self, seq_ids: Sequence[SeqId], *, keep_watermark: bool = True) -> bool:
        """Would `swap_in(seq_ids)` find its blocks now, keeping the watermark when asked (the same
        rule as `check_admission`: the watermark is for running sequences to grow into)?"""
        need = self.num_blocks_to_swap_in(seq_ids)
        return need <= self.pool.num_free - (self.watermark_blocks if keep_watermark else 0)

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        seq_id: SeqId,
        num_new_tokens: int,
        prefix: CachedPrefix | None = None,
        policy: EvictionPolicy | None = None,
    ) -> SlotAllocation | None:
        """Give `num_new_tokens` more tokens slots at the end of the sequence, creating it on first
        use (from `prefix`, whose blocks it then shares, with eviction `policy`). Returns None,
        changing nothing, when the pool lacks room. Appending into a shared, partly filled last block
        first copies it (copy-on-write)."""
        seq = self._seqs.get(seq_id)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if seq is None:
            hits = self._prefix_blocks(prefix)
            covered = prefix.num_tokens if prefix is not None else 0  # CPU-tier hits take a new block each
            need = _cdiv(covered + num_new_tokens, self.block_size) - len(hits)
            need += sum(b.ref_count == 0 for b in hits)  # hits we take off the free queue
        else:
            if prefix is not None:
                raise ValueError(f"sequence {seq_id!r} exists already; a prefix only starts one")
            if seq.on_cpu:
                raise RuntimeError(f"sequence {seq_id!r} is swapped out; swap it in first")
            need = self._growth_blocks([(seq_id, num_new_tokens)])
        if need > self.pool.num_free:
            return None
        # Committed from here on: nothing below can fail.
        if seq is None:
            seq = self._create(seq_id, prefix, policy)
        return self._grow(seq, num_new_tokens)

    def free(self, seq_id: SeqId) -> None:
        """Release a finished or aborted sequence; its blocks go back tail first."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        if seq.on_cpu:
            self.cpu_pool.free(self.cpu_pool.blocks[b] for b in seq.resident)
            self._num_swapped -= 1
        else:
            self.pool.free(self.pool.blocks[b] for b in seq.block_ids + seq.sink_copies if b != HOLE)
            self._num_logical -= len(seq.resident)

    def fork(self, parent_id: SeqId, child_id: SeqId, num_blocks: int | None = None) -> None:
        """Make `child_id` share the first `num_blocks` blocks of `parent_id` (all of them by default:
        parallel samples, beams); a partial share covers full blocks only."""
        parent = self._seq(parent_id)
        if parent.on_cpu:
            raise RuntimeError(f"sequence {parent_id!r} is swapped out; swap it in before forking")
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} exists already")
        bs = self.block_size
        if num_blocks is None:
            num_blocks, num_tokens = len(parent.block_ids), parent.num_tokens
        else:
            if not 0 <= num_blocks <= parent.num_tokens // bs:
                raise ValueError(f"cannot share {num_blocks} full blocks of a sequence of {parent.num_tokens} tokens")
            num_tokens = num_blocks * bs
        shared = parent.block_ids[:num_blocks]
        holes = shared.count(HOLE)
        if shared and shared[-1] == HOLE:
            raise ValueError(f"cannot share {num_blocks} blocks: the last of them was evicted")
        copies = parent.sink_copies if holes * bs == parent.num_evicted else []
        for b in shared + copies:
            if b != HOLE:
                self.pool.incref(self.pool.blocks[b])
        self._seqs[child_id] = _Sequence(
            block_ids=list(shared),
            num_tokens=num_tokens,
            cache_salt=parent.cache_salt,
            block_hashes=parent.block_hashes[:num_blocks],
            num_registered=min(parent.num_registered, num_blocks),
            policy=parent.policy,
            num_evicted=holes * bs,
            scores=parent.scores[:num_blocks],
            sink_copies=list(copies),
            sink_shift=parent.sink_shift if copies else 0,
        )
        self._num_logical += len(shared) - holes

    def _create(self, seq_id: SeqId, prefix: CachedPrefix | None, policy: EvictionPolicy | None = None) -> _Sequence:
        hits = self._prefix_blocks(prefix)
        for block in hits:
            self.pool.incref(block)
        block_ids = list(prefix.block_ids) if prefix else []
        if prefix is not None and prefix.tier_block_ids:
            tiered = {i: self.tier.blocks[t] for i, t in prefix.tier_block_ids.items()}  # type: ignore[union-attr]
            for tb in tiered.values():  # pinned before the pool evicts (and so offloads) anything
                self.tier.incref(tb)  # type: ignore[union-attr]
                self._pinned.append(tb)
            for i, tb in tiered.items():
                (new,) = self.pool.allocate(1)  # type: ignore[misc]  # admission counted it
                self.pool.add_tokens(new, self.block_size)
                if self.prefix_cache.register(new, tb.cache_key):  # type: ignore[union-attr, arg-type]
                    self._uncommitted.append(new)
                self._restores.append((tb.block_id, new.block_id))
                block_ids[i] = new.block_id
            self.num_tier_hit_tokens += len(tiered) * self.block_size
        seq = _Sequence(
            block_ids=block_ids,
            num_tokens=len(block_ids) * self.block_size,
            cache_salt=prefix.cache_salt if prefix else None,
            block_hashes=list(prefix.block_hashes) if prefix else [],
            num_registered=len(block_ids),
            policy=policy,
        )
        self._seqs[seq_id] = seq
        self._num_logical += len(block_ids)
        if prefix is not None and self.prefix_cache is not None and prefix.num_query_tokens:
            self.prefix_cache.num_query_tokens += prefix.num_query_tokens
            self.prefix_cache.num_hit_tokens += prefix.num_tokens
        return seq

    def _grow(self, seq: _Sequence, num_new_tokens: int) -> SlotAllocation:
        """Slots for `num_new_tokens` more tokens (the caller checked there is room)."""
        pool, bs = self.pool, self.block_size
        alloc = SlotAllocation(new_block_ids=[])
        if num_new_tokens > 0 and seq.num_tokens % bs and pool.blocks[seq.block_ids[-1]].ref_count > 1:
            old = pool.blocks[seq.block_ids[-1]]
            (new,) = pool.allocate(1)  # type: ignore[misc]
            pool.add_tokens(new, old.num_tokens)
            pool.decref(old)
            seq.block_ids[-1] = new.block_id
            alloc.copies.append((old.block_id, new.block_id))
        num_new_blocks = _cdiv(seq.num_tokens + num_new_tokens, bs) - len(seq.block_ids)
        fresh = pool.allocate(num_new_blocks) or []
        seq.block_ids.extend(b.block_id for b in fresh)
        alloc.new_block_ids = [b.block_id for b in fresh]
        self._num_logical += num_new_blocks
        pos, end = seq.num_tokens, seq.num_tokens + num_new_tokens  # count the tokens into their blocks
        while pos < end:
            take = min(end, (pos // bs + 1) * bs) - pos
            pool.add_tokens(pool.blocks[seq.block_ids[pos // bs]], take)
            pos += take
        seq.num_tokens = end
        return alloc

    # ------------------------------------------------------------------ eviction policies
    def evict(self, seq_id: SeqId, num_computed: int, mass: Sequence[float] | None = None) -> int:
        """After a step that left `num_computed` of the sequence's tokens in the cache: add `mass`
        (attention received by each entry of `attention_table`, H2O) to its block scores, then
        release the blocks its policy drops. Returns how many."""
        seq = self._seq(seq_id)
        if not 0 <= num_computed <= seq.num_tokens:
            raise IndexError(f"{num_computed} computed tokens in a sequence with {seq.num_tokens} slots")
        policy, bs = seq.policy, self.block_size
        if policy is None or seq.on_cpu:
            return 0
        resident = [i for i, b in enumerate(seq.block_ids) if b != HOLE]
        if mass is not None:
            if len(seq.scores) < len(seq.block_ids):
                seq.scores.extend([0.0] * (len(seq.block_ids) - len(seq.scores)))
            for i, m in zip(resident, mass):  # mass may be shorter: blocks the step did not see
                seq.scores[i] += m
        full = num_computed // bs
        kept = [i for i in resident if i < full and i < len(seq.block_ids) - 1]
        drop = policy.evict(kept, num_computed, bs, seq.scores)
        for i in drop:
            self.pool.decref(self.pool.blocks[seq.block_ids[i]])  # sharers keep the block
            seq.block_ids[i] = HOLE
        seq.num_evicted += len(drop) * bs
        self._num_logical -= len(drop)
        self.num_evicted_tokens += len(drop) * bs
        return len(drop)

    def prepare_sinks(self, seq_id: SeqId) -> list[tuple[int, int, int]]:
        """Before a StreamingLLM sequence attends: its sink copies must be rotated by the evicted
        length. Returns the (original, copy, positions) rotations for the worker, taking new copies
        when there are none or they are shared (the caller made room: `num_blocks_to_grow` counts them)."""
        seq = self._seq(seq_id)
        n = self._num_sinks(seq)
        if not n or (seq.sink_copies and seq.sink_shift == seq.num_evicted):
            return []
        if not seq.sink_copies or any(self.pool.blocks[b].ref_count > 1 for b in seq.sink_copies):
            fresh = self.pool.allocate(n)
            if fresh is None:
                raise InvariantError(f"no blocks for the sink copies of {seq_id!r} after the scheduler made room")
            self.pool.free(self.pool.blocks[b] for b in seq.sink_copies)
            for block in fresh:
                self.pool.add_tokens(block, self.block_size)
            seq.sink_copies = [b.block_id for b in fresh]
        seq.sink_shift = seq.num_evicted
        return [(seq.block_ids[i], c, seq.num_evicted) for i, c in enumerate(seq.sink_copies)]

    # ------------------------------------------------------------------ swap
    def swap_out(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int]] | None:
        """Move these sequences' blocks to the CPU pool. Blocks shared among them move once.
        Returns the (gpu_block, cpu_block) copies to perform, or None (nothing changed) when the
        CPU pool is too small. The GPU blocks are released; cached ones stay hittable."""
        return self._move(seq_ids, to_cpu=True)

    def swap_in(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int]] | None:
        """Move swapped sequences back into fresh GPU blocks: (cpu_block, gpu_block) copies, or None."""
        return self._move(seq_ids, to_cpu=False)

    def _move(self, seq_ids: Sequence[SeqId], *, to_cpu: bool) -> list[tuple[int, int]] | None:
        src, dst = (self.pool, self.cpu_pool) if to_cpu else (self.cpu_pool, self.pool)
        seqs = [self._seq(s) for s in dict.fromkeys(seq_ids)]
        for s, seq in zip(dict.fromkeys(seq_ids), seqs):
            if seq.on_cpu == to_cpu:
                raise RuntimeError(f"sequence {s!r} is already {'swapped out' if to_cpu else 'resident'}")
        holders = Counter(b for seq in seqs for b in seq.resident)  # src block -> tables holding it
        fresh = dst.allocate(len(holders))
        if fresh is None:
            return None
        if to_cpu:  # rotated sink copies are derived: dropped here, made again after the swap-in
            for seq in seqs:
                self.pool.free(self.pool.blocks[b] for b in seq.sink_copies)
                seq.sink_copies, seq.sink_shift = [], 0
        mapping = {}
        for src_id, dst_block in zip(holders, fresh):
            mapping[src_id] = dst_block.block_id
            dst.add_tokens(dst_block, src.blocks[src_id].num_tokens)
            for _ in range(holders[src_id] - 1):
                dst.incref(dst_block)
        mapping_with_holes = {**mapping, HOLE: HOLE}
        for seq in seqs:
            src.free(src.blocks[b] for b in seq.resident)
            seq.block_ids = [mapping_with_holes[b] for b in seq.block_ids]
            seq.on_cpu = to_cpu
            seq.num_registered = 0  # fresh GPU blocks get registered again by cache_blocks
        delta = sum(len(seq.resident) for seq in seqs)
        self._num_logical += -delta if to_cpu else delta
        self._num_swapped += len(seqs) if to_cpu else -len(seqs)
        return list(mapping.items())

    # ------------------------------------------------------------------ statistics
    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (and the CPU tier): later prompts start cold. Only when no sequence
        holds blocks; False, changing nothing, otherwise."""
        if self._seqs or not self.pool.reset_prefix_cache():
            return False
        return self.tier is None or self.tier.reset_prefix_cache()

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
            shared_of_used=pool.num_shared / used if used else 0.0,
            num_seqs=len(self._seqs) - self._num_swapped,
            num_swapped_seqs=self._num_swapped,
            cpu_total_blocks=self.cpu_pool.num_total,
            cpu_used_blocks=self.cpu_pool.num_used,
            bytes_per_block=self.bytes_per_block,
            tier_total_blocks=self.tier.num_total if self.tier else 0,
            tier_cached_blocks=len(self.tier.prefix_cache) if self.tier else 0,  # type: ignore[arg-type]
            tier_hit_tokens=self.num_tier_hit_tokens,
            evicted_tokens=self.num_evicted_tokens,
        )

    def check_invariants(self, token_ids: dict[SeqId, Sequence[int]] | None = None) -> None:
        """Recompute every piece of bookkeeping from scratch and compare; raise InvariantError.
        With `token_ids` (sequence -> its tokens, as the request holds them) the chain digests are
        recomputed from the tokens too."""
        bs = self.block_size
        for pool, on_cpu in ((self.pool, False), (self.cpu_pool, True)):
            refs = Counter(b for s in self._seqs.values() if s.on_cpu == on_cpu for b in s.resident + s.sink_copies)
            queued = pool.free_queue.block_ids()
            _check(len(queued) == len(set(queued)) == pool.num_free, "free queue length or duplicates")
            for block in pool.blocks:
                _check(
                    block.ref_count == refs[block.block_id],
                    lambda: (
                        f"block {block.block_id}: ref_count {block.ref_count} but {refs[block.block_id]} tables hold it"
                    ),
                )
                _check(
                    (block.ref_count == 0) == (block in pool.free_queue),
                    lambda: f"block {block.block_id}: free iff unreferenced",
                )
                _check(0 <= block.num_tokens <= bs, lambda: f"block {block.block_id}: {block.num_tokens} tokens")
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
                _check(key is not None and key.digest == digest, lambda: f"block {block.block_id}: hash map entry")
                _check(
                    key.is_consistent() and len(key.token_ids) == bs,  # type: ignore[union-attr]
                    f"block {block.block_id}: stored tokens do not hash to its key",
                )
            registered = sum(b.cache_key is not None for b in self.pool.blocks)
            _check(registered == len(self.prefix_cache), "a block carries a key the map does not hold")
        if self.tier is not None:  # the CPU tier: free registered copies, but those the step is reading
            pins = Counter(b.block_id for b in self._pinned)
            tier_cache = self.tier.prefix_cache
            for block in self.tier.blocks:
                _check(block.ref_count == pins[block.block_id], lambda: f"tier block {block.block_id}: ref_count")
                _check((block.ref_count == 0) == (block in self.tier.free_queue), "tier block: free iff unpinned")
                key = block.cache_key
                _check(key is None or (key.is_consistent() and tier_cache.lookup(key.digest, key.token_ids) is block),
                       lambda: f"tier block {block.block_id}: its key is not the map's")  # fmt: skip
            registered = sum(b.cache_key is not None for b in self.tier.blocks)
            _check(registered == len(tier_cache), "a tier block carries a key the tier's map does not hold")  # type: ignore[arg-type]
            _check(self.tier.num_used_tokens == 0, "tier token counter")
            _check(all(b.cache_key is not None for b in self._pinned), "a pinned tier block lost its key")
        _check(
            self._num_logical == sum(len(s.resident) for s in self._seqs.values() if not s.on_cpu),
            "logical-block counter",
        )
        _check(self._num_swapped == sum(s.on_cpu for s in self._seqs.values()), "swapped counter")
        for seq_id, seq in self._seqs.items():
            n = seq.num_tokens
            pool = self.cpu_pool if seq.on_cpu else self.pool
            _check(len(seq.block_ids) == _cdiv(n, bs), lambda: f"{seq_id}: table length for {n} tokens")
            _check(len(seq.block_hashes) <= n // bs, lambda: f"{seq_id}: a digest for a block that is not full")
            _check(seq.num_registered <= len(seq.block_hashes), lambda: f"{seq_id}: registered beyond its digests")
            chain = list(seq.block_hashes)  # what each full block's digest must be, as far as known
            tokens = token_ids.get(seq_id) if token_ids is not None else None
            if tokens is not None:  # the chain digests must be those of the request's tokens
                _check(len(tokens) >= n, lambda: f"{seq_id}: {n} slots but {len(tokens)} tokens")
                chain = []
                for i in range(n // bs):
                    chunk = tokens[i * bs : (i + 1) * bs]
                    chain.append(hash_block(chain[-1] if chain else None, chunk, extra_keys_for(i, seq.cache_salt)))
                _check(
                    seq.block_hashes == chain[: len(seq.block_hashes)],
                    lambda: f"{seq_id}: chain digests of other tokens",
                )
            holes = [i for i, b in enumerate(seq.block_ids) if b == HOLE]
            _check(len(holes) * bs == seq.num_evicted, lambda: f"{seq_id}: holes and evicted count disagree")
            _check(not holes or seq.policy is not None, lambda: f"{seq_id}: a hole without an eviction policy")
            _check(all(i < min(n // bs, len(seq.block_ids) - 1) for i in holes), lambda: f"{seq_id}: a hole at the end")
            sinks = seq.policy.sink_blocks(bs) if seq.policy is not None and seq.policy.reposition else 0
            _check(all(i >= sinks for i in holes), lambda: f"{seq_id}: an attention sink was evicted")
            _check(not seq.sink_copies or (len(seq.sink_copies) == sinks and seq.num_evicted and not seq.on_cpu),
                   lambda: f"{seq_id}: sink copies without a reason")  # fmt: skip
            for c in seq.sink_copies:
                _check(self.pool.blocks[c].cache_key is None and self.pool.blocks[c].num_tokens == bs,
                       lambda: f"{seq_id}: sink copy {c} is registered or not full")  # fmt: skip
            for i, b in enumerate(seq.block_ids):
                if b == HOLE:
                    continue
                block = pool.blocks[b]
                _check(block.num_tokens == min(bs, n - i * bs), lambda: f"{seq_id}: fill of block {b}")
                key = block.cache_key
                if key is not None and i < len(chain):  # (a sibling may not have hashed a shared block yet)
                    _check(
                        key.digest == chain[i],
                        lambda: f"{seq_id}: block {b} is registered under content other than its tokens",
                    )
                    _check(
                        key.parent == (chain[i - 1] if i else None),
                        lambda: f"{seq_id}: block {b} registered under another chain",
                    )
                _check(key is None or i < n // bs, lambda: f"{seq_id}: block {b} is registered but not full")
        _check(
            all(b.cache_key is not None and b.ref_count > 0 for b in self._uncommitted),
            "an uncommitted registration was evicted or freed before its step ended",
        )

    # ------------------------------------------------------------------ helpers
    def _seq(self, seq_id: SeqId) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _prefix_blocks(self, prefix: CachedPrefix | None) -> list[Block]:
        """The pool blocks a prefix hits (its CPU-tier hits are checked, not returned)."""
        if prefix is None or not prefix.block_ids:
            return []
        blocks = []
        for i, (b, digest) in enumerate(zip(prefix.block_ids, prefix.block_hashes, strict=True)):
            tiered = i in prefix.tier_block_ids
            block = self.tier.blocks[prefix.tier_block_ids[i]] if tiered else self.pool.blocks[b]  # type: ignore[union-attr]
            if block.cache_key is None or block.cache_key.digest != digest:
                raise RuntimeError("stale CachedPrefix: a hit block was reused since the lookup")
            if not tiered:
                blocks.append(block)
        return blocks


def _check(ok: bool, message: str | Callable[[], str]) -> None:
    if not ok:
        raise InvariantError(message if isinstance(message, str) else message())
