"""The KV-cache manager: block tables of sequences over a GPU block pool, as one facade.

It owns the tables (block_table.py) and composes one component per concern, each owning its state
and invariants: BlockPool (GPU blocks), BlockBudget (admission.py: all block arithmetic, the
watermark), PrefixRegistry (lookups, commit / discard; it holds the CpuTier), SwapSpace (the CPU
pool) and EvictionWindows (eviction/windows.py: holes, H2O scores, StreamingLLM sink copies).

What the scheduler calls (plain data in, plain data out):

    adm   = check_admission(token_lists, cache_salt)    -> Admission (now / later / never, and the plan)
    admit(seq_ids, token_lists, adm, policy)            a request's sequences enter, sharing blocks
    need  = num_blocks_to_grow([(seq_id, n), ...])       blocks that growing them takes (sink copies too)
    step  = prepare_step(seq_id, token_ids, upto, slots) -> StepBlocks: slots, sinks, registration, table
    finish_step([(seq_id, num_computed, mass), ...])  /  fail_step()     the step ran / failed
    swap_out / can_swap_in / swap_in (seq_ids),  fork(parent, child),  free(seq_id),  take_tier_transfers()
    take_demotions()                                     blocks a policy demoted, for the next step's worker
    hits = hold_segments(token_ids, segments)           a prompt of segments: their cached blocks held,
    fills = fill_segments(seq_id, segments, hits, k)     then copied

The manager owns blocks, not tokens: token ids belong to the request and are passed in where content
matters (hashing a full block). A table grows one block at a time; nothing is reserved ahead.

`layer_spec` (kv_spec.py) is what the model's layers read: full attention, or a sliding window or
chunks, whose blocks no later query reads are released after each step (layer_window.py) and whose
prefix hits need only the blocks a resumed sequence reads (prefix_registry.py).

A model whose layers read in several ways has one KV-cache group per kind (`group_specs`, from
kv_spec.group_layers): each sequence then holds one block table per group, all over the one pool
(a block id names one page: the same slot of each of a group's layers' tensors, so every group's
block costs the same). Admission, growth, swap, forks and the invariants count every group's
tables; a prefix hit is the longest prefix every group can resume after (`find_groups`), each
group's blocks registered under digests naming the group. Eviction policies, the CPU tier, the
shared tier, demoted pools, segments and partial hits are one group's only (refused here, or by
the engine naming the field).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from kvpage.core.admission import Admission, AdmissionStatus, BlockBudget
from kvpage.core.block_pool import BlockPool
from kvpage.core.block_table import BlockTable, SlotAllocation, check_tables, grow
from kvpage.core.cache_stats import CacheStats, collect_stats
from kvpage.core.eviction import NO_EVICTION, EvictionPolicy, EvictionWindows
from kvpage.core.invariants import InvariantError, check, check_all
from kvpage.core.kv_spec import FULL, FullAttention, LayerSpec, needed_from
from kvpage.core.layer_window import check_window, release_behind
from kvpage.core.memory_map import MemoryMap, block_states, table_map
from kvpage.core.prefix_cache import PrefixCache
from kvpage.core.prefix_registry import CachedPrefix, PrefixRegistry, TierTransfers
from kvpage.core.remote_tier import RemoteTier
from kvpage.core.segments import Fill, plan_fills
from kvpage.core.swap import SwapSpace

SeqId = Hashable  # opaque to the manager: the scheduler uses SeqKey(request_id, index)

__all__ = ["CachedPrefix", "InvariantError", "KVCacheManager", "SlotAllocation", "StepBlocks"]


@dataclass(slots=True)
class StepBlocks:
    """What one scheduled sequence's step needs from the cache, for the worker."""

    block_table: list[int]  # what attention reads: resident blocks, sink blocks as their copies
    num_evicted: int  # tokens missing before that table (whole blocks)
    copies: list[tuple[int, int]]  # copy-on-write of a shared last block
    rotations: list[tuple[int, int, int]]  # StreamingLLM sink copies to rotate (src, dst, positions)
    cold_blocks: list[tuple[str, int]]  # demoted blocks attention reads too: (precision, block id)
    # the KV-cache groups after the first (a model of several): (resident blocks, tokens released before them)
    group_tables: list[tuple[list[int], int]] = field(default_factory=list)


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
        remote: RemoteTier | None = None,  # the shared tier below it (its blocks land in the CPU tier)
        cold_blocks: Mapping[str, int] | None = None,  # pools of lower precisions, for demoting policies
        layer_spec: LayerSpec = FULL,  # what the layers read (kv_spec.py)
        group_specs: Sequence[LayerSpec] | None = None,  # several KV-cache groups: what each one's layers read
    ) -> None:
        self.specs = tuple(group_specs) if group_specs else (layer_spec,)
        if len(self.specs) > 1:
            for name, value in (("num_tier_blocks", num_tier_blocks), ("remote", remote), ("cold_blocks", cold_blocks)):
                if value:
                    raise ValueError(f"{name} is for a model of one KV-cache group; this one has {len(self.specs)}")
        self.block_size = block_size
        self.layer_spec = self.specs[0]
        self.bytes_per_block = bytes_per_block
        self.pool = BlockPool(num_blocks, block_size, PrefixCache() if enable_prefix_caching else None)
        self.budget = BlockBudget(self.pool, block_size, watermark)
        self.prefix = PrefixRegistry(self.pool, block_size, num_tier_blocks, remote, self.specs)
        self.swap = SwapSpace(num_cpu_blocks, self.pool)
        self.eviction = EvictionWindows(self.pool, block_size, cold_blocks)
        self._tables: dict[SeqId, list[BlockTable]] = {}  # one table per KV-cache group
        # read-only views of what the components own
        self.prefix_cache, self.enable_prefix_caching = self.pool.prefix_cache, self.prefix.enabled
        self.cpu_pool, self.has_swap_space = self.swap.pool, self.swap.enabled
        self.tier = self.prefix.tier_pool  # the CPU tier's own pool, or None
        self.watermark_blocks = self.budget.watermark_blocks
        self.events = self.prefix.events  # KV events (kv_events.py): what this cache holds, as it changes
        self.num_segment_tokens_copied = 0  # tokens prompts of segments copied instead of computing

    # ------------------------------------------------------------------ views (tests, tools, stats)
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_total

    # ------------------------------------------------------------------ queries
    def has_sequence(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    def is_swapped(self, seq_id: SeqId) -> bool:
        return self._table(seq_id).on_cpu

    def seq_ids(self) -> list[SeqId]:
        return list(self._tables)

    @property
    def num_groups(self) -> int:
        return len(self.specs)

    def block_table(self, seq_id: SeqId, group: int = 0) -> list[int | None]:
        """The logical table (HOLE, None, where a policy or the layers' window released a block)."""
        return list(self._tables_of(seq_id)[group].block_ids)

    def attention_table(self, seq_id: SeqId) -> tuple[list[int], int]:
        """What attention reads (eviction/windows.py: `attention_view`)."""
        return self.eviction.attention_view(seq_id, self._table(seq_id))

    def num_evicted(self, seq_id: SeqId) -> int:
        return self._table(seq_id).num_holes * self.block_size

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._table(seq_id).num_tokens

    def slot_mapping(self, seq_id: SeqId, start: int, end: int, group: int = 0) -> list[int]:
        """Physical slots of tokens [start, end) of a GPU-resident sequence."""
        return self._tables_of(seq_id)[group].slot_mapping(self.block_size, start, end)

    # ------------------------------------------------------------------ prefix cache
    def find_cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> CachedPrefix:
        """What the local tiers hold of a prompt (no call to the shared tier: a cheap look); with
        several KV-cache groups, group 0's share of what they all hold."""
        return self._look_up(token_ids, cache_salt, remote=False)[0]

    def _look_up(self, token_ids: Sequence[int], cache_salt: str | None, remote: bool = True) -> list[CachedPrefix]:
        """A prompt's hits, one per KV-cache group."""
        if len(self.specs) == 1:
            return [self.prefix.find(token_ids, cache_salt, remote=remote)]
        return self.prefix.find_groups(token_ids, cache_salt)

    def num_resident_blocks(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading full blocks of `token_ids`, as a prompt of its own, held written in the GPU pool
        (what a segment of a later prompt copies: segments.py)."""
        return len(self.prefix.resident_chain(token_ids, cache_salt))

    def cache_blocks(self, seq_id: SeqId, token_ids: Sequence[int], num_tokens: int) -> None:
        """The KV of the sequence's first `num_tokens` tokens (`token_ids[:num_tokens]`) is written,
        or is being written by the step now scheduled: register its full blocks as prefix-cache hits."""
        table = self._table(seq_id)
        if num_tokens > table.num_tokens:
            raise IndexError(f"{num_tokens} cached tokens but the sequence has slots for {table.num_tokens}")
        if num_tokens > len(token_ids):
            raise IndexError(f"{num_tokens} cached tokens but only {len(token_ids)} token ids were given")
        for t in self._tables[seq_id]:
            self.prefix.register(t, token_ids, num_tokens)

    def fetch_remote(self) -> int:
        """Between steps (never inside a schedule): read what admissions asked of the shared tier
        since the last call, landed in the CPU tier for the next lookups (remote_fetch.py). Returns
        the blocks landed."""
        return self.prefix.fetch_remote()

    def commit(self) -> None:
        """The scheduled step ran: every block registered for it now holds its KV."""
        self.prefix.commit()

    def discard_uncommitted(self) -> None:
        """The scheduled step failed: forget the blocks registered for it. Call before freeing the
        step's sequences."""
        self.prefix.discard(self._all_tables())

    def take_demotions(self) -> list[tuple[str, int, str, int]]:
        """Blocks demoted since the last step: (src precision, src block, dst precision, dst block),
        "hot" naming this pool; the worker copies them before anything else in the next step."""
        return self.eviction.take_demotions()

    def take_tier_transfers(self) -> TierTransfers:
        """The step's tier transfers: (pool, tier) offloads, (tier, payload) blocks fetched from the
        shared tier, (tier, pool) restores, in that order, and the write-through after the step."""
        return self.prefix.take_transfers()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (and the CPU tier): later prompts start cold. Only when no sequence
        holds blocks; False, changing nothing, otherwise."""
        return not self._tables and self.prefix.reset()

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
        now, later, or never? NOW keeps the watermark free when `keep_watermark`; NEVER means it
        would not fit even in an empty pool, cache hits or not. The plan (lead's hits, blocks each
        sequence shares with the lead) is valid until the pool changes: pass it straight to `admit`."""
        if not token_lists or not all(token_lists):
            raise ValueError("a request needs at least one sequence of at least one token")
        lead = token_lists[0]
        prefixes = self._look_up(lead, cache_salt) if use_prefix_cache else self._no_hit(cache_salt)
        shared = [min(self._shareable(spec, m, p.released) for spec, p in zip(self.specs, prefixes, strict=True))
                  for m in self.budget.shared_with_lead(token_lists)]  # fmt: skip
        return self._plan([len(t) for t in token_lists], shared, prefixes, keep_watermark)

    def _no_hit(self, cache_salt: str | None = None) -> list[CachedPrefix]:
        return [CachedPrefix([], [], 0, 0, cache_salt, group=g) for g in range(len(self.specs))]

    def _shareable(self, spec: LayerSpec, m: int, released: int) -> int:
        """Leading blocks of the lead a sibling may share: under a window, only where the blocks it
        then reads are not the lead's holes (else it computes its prompt from the start)."""
        if not m or isinstance(spec, FullAttention):
            return m
        bs = self.block_size
        return m if m > released and needed_from(spec, m * bs, bs) >= released else 0

    def _plan_groups(self, lengths: list[int], shared: list[int], prefixes: list[CachedPrefix],
                     keep_watermark: bool) -> Admission:  # fmt: skip
        """The budget's plan summed over the KV-cache groups (each its own hits and holes)."""
        total = needed = unqueued = 0
        for prefix in prefixes:
            hits = self.prefix.hit_blocks(prefix)
            blocks = self.budget.total_blocks(lengths, shared, prefix)
            total, needed = total + blocks, needed + blocks - len(hits)
            unqueued += self.prefix.num_unqueued(prefix, hits)
        return self.budget.decide(lengths, total, needed, keep_watermark=keep_watermark, unqueued=unqueued,
                                  prefix=prefixes[0], shared=shared, groups=prefixes)  # fmt: skip

    def _plan(self, lengths: list[int], shared: list[int], prefixes: list[CachedPrefix], keep_watermark: bool, *,
              may_drop_partial: bool = True) -> Admission:  # fmt: skip
        """The budget's plan for sequences hitting `prefixes` (one per KV-cache group); a partial hit
        whose pinned source would not leave room is dropped (in a tiny pool the source itself may be the
        block the request needs) when `may_drop_partial`. Several groups: their plans summed."""
        if len(prefixes) > 1:
            return self._plan_groups(lengths, shared, prefixes, keep_watermark)
        (prefix,) = prefixes
        hits = self.prefix.hit_blocks(prefix)
        adm = self.budget.plan(lengths, shared, prefix, hits, keep_watermark=keep_watermark,
                               unqueued=self.prefix.num_unqueued(prefix, hits))  # fmt: skip
        if may_drop_partial and adm.status is not AdmissionStatus.NOW and prefix.partial is not None:
            self.prefix.drop_partial(prefix)
            adm = self.budget.plan(lengths, shared, prefix, hits, keep_watermark=keep_watermark,
                                   unqueued=self.prefix.num_unqueued(prefix, hits))  # fmt: skip
        return adm

    def admit(
        self,
        seq_ids: Sequence[SeqId],
        token_lists: Sequence[Sequence[int]],
        adm: Admission,
        policy: EvictionPolicy = NO_EVICTION,
    ) -> list[tuple[int, int]]:
        """Create a request's sequences with slots for all their tokens, as `check_admission` planned
        (it must have answered NOW, with nothing allocated since). Nothing is registered: the caller
        registers what each step computes. `policy`: the sequences' eviction policy. Returns the
        (src, dst) block copies of a partial prefix hit, for the worker to make in this step."""
        if adm.status is not AdmissionStatus.NOW or not len(adm.shared_blocks) == len(seq_ids) == len(token_lists):
            raise RuntimeError("admit() needs a NOW admission for exactly these sequences")
        prefixes = adm.groups or [adm.prefix]
        freed = sum(self.prefix.num_unqueued(p) for p in prefixes)
        if not self.budget.fits(adm.blocks_needed, keep_watermark=False, freed=freed):
            raise RuntimeError("stale Admission: the pool changed since check_admission")
        if any(s in self._tables for s in seq_ids) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"admit() needs new, distinct sequence ids; got {list(seq_ids)!r}")
        lead, lead_tokens = seq_ids[0], token_lists[0]
        tables, copies = self._start(lead, prefixes, policy)
        for table in tables:
            grow(table, self.pool, len(lead_tokens) - table.num_tokens)
        for seq_id, tokens, m in zip(seq_ids[1:], token_lists[1:], adm.shared_blocks[1:], strict=True):
            self.fork(lead, seq_id, num_blocks=m)
            for spec, table in zip(self.specs, self._tables[seq_id], strict=True):
                release_behind(table, spec, m * self.block_size, self.pool)
                grow(table, self.pool, len(tokens) - m * self.block_size)
        return copies

    def hold_segments(self, token_ids: Sequence[int], segments: Sequence[tuple[int, int]],
                      cache_salt: str | None = None) -> list[list[int]]:  # fmt: skip
        """A prompt of `segments` ((start, length) each, in `token_ids`) about to be admitted: the
        cached blocks of each reused segment's own KV (segments.py; none for the first and the last),
        referenced until the step ends. Taken before admission allocates, so the prompt's own blocks
        cannot evict them; and all of each chain, not only the blocks copied, so that a segment's
        leading blocks (recomputed, never copied, but where its chain is looked up) come back as
        recently used as the rest."""
        last = len(segments) - 1
        hits = [self.prefix.resident_chain(token_ids[s : s + n], cache_salt) if 0 < i < last else []
                for i, (s, n) in enumerate(segments)]  # fmt: skip
        self.prefix.pin(b for h in hits for b in h)
        return hits

    def release_segments(self, hits: Sequence[Sequence[int]]) -> None:
        """Let go of what `hold_segments` held (the prompt does not fit beside it: it computes all)."""
        self.prefix.unpin(b for h in hits for b in h)

    def fill_segments(self, seq_id: SeqId, segments: Sequence[tuple[int, int]], hits: Sequence[Sequence[int]],
                      recompute_blocks: int, from_pos: int = 0) -> list[Fill]:  # fmt: skip
        """A just admitted sequence whose prompt is made of `segments`, their cached blocks `hits`
        (`hold_segments`): what of them it copies instead of computing. The caller puts the fills'
        runs in the step, before its forward."""
        table = self._table(seq_id)
        fills = plan_fills(segments, hits, table.block_ids, self.block_size, recompute_blocks, from_pos)
        self.num_segment_tokens_copied += sum(f.end - f.start for f in fills)
        return fills

    def num_blocks_needed(self, seq_id: SeqId, num_new_tokens: int) -> int:
        """Blocks `allocate_slots(seq_id, num_new_tokens)` would take, copy-on-write included."""
        return self.budget.growth_blocks([(t, num_new_tokens) for t in self._tables_of(seq_id)])

    def num_blocks_to_grow(self, growth: Sequence[tuple[SeqId, int]]) -> int:
        """Blocks that `allocate_slots(seq_id, n)` for each (seq_id, n), in this order, would take,
        and the StreamingLLM sink copies `prepare_sinks` will take for them."""
        tables = [(t, n) for s, n in growth for t in self._tables_of(s)]
        return self.budget.growth_blocks(tables) + self.num_blocks_for_sinks([s for s, _ in growth])

    def num_blocks_for_sinks(self, seq_ids: Sequence[SeqId]) -> int:
        return self.eviction.blocks_for_sinks([(s, self._table(s)) for s in seq_ids])

    def num_blocks_to_swap_in(self, seq_ids: Sequence[SeqId]) -> int:
        return self.swap.blocks_to_move([t for s in seq_ids for t in self._tables_of(s)])

    def can_swap_in(self, seq_ids: Sequence[SeqId], *, keep_watermark: bool = True) -> bool:
        """Would `swap_in(seq_ids)` find its blocks now (the watermark rule of admission)?"""
        return self.budget.fits(self.num_blocks_to_swap_in(seq_ids), keep_watermark=keep_watermark)

    # ------------------------------------------------------------------ a step
    def prepare_step(self, seq_id: SeqId, token_ids: Sequence[int], computed_after: int, num_slots: int) -> StepBlocks:
        """Everything a scheduled sequence needs before the worker runs its step: slots up to
        `num_slots` tokens (the caller made room: `num_blocks_to_grow`), its sink copies rotated,
        the full blocks among its first `computed_after` tokens registered, and the table attention
        reads."""
        table = self._table(seq_id)
        copies: list[tuple[int, int]] = []
        missing = num_slots - table.num_tokens
        if missing > 0:
            alloc = self.allocate_slots(seq_id, missing)
            if alloc is None:
                raise InvariantError(f"no blocks for {seq_id} after the scheduler made room")
            copies = alloc.copies
        rotations = self.eviction.prepare_sinks(seq_id, table)
        self.cache_blocks(seq_id, token_ids, computed_after)
        view, num_evicted = self.eviction.attention_view(seq_id, table)
        groups = [(t.resident, t.released * self.block_size) for t in self._tables[seq_id][1:]]
        return StepBlocks(view, num_evicted, copies, rotations, self.eviction.cold_view(table), groups)

    def finish_step(self, computed: Sequence[tuple[SeqId, int, Sequence[float] | None]]) -> None:
        """The step ran: commit its registrations, then let each sequence's eviction policy release
        blocks (`computed`: sequence, tokens now in the cache, attention mass per table entry or None)."""
        self.commit()
        for seq_id, num_computed, mass in computed:
            if seq_id in self._tables:
                for spec, table in zip(self.specs, self._tables[seq_id], strict=True):
                    release_behind(table, spec, num_computed, self.pool)
                self.evict(seq_id, num_computed, mass)

    def fail_step(self) -> None:
        self.discard_uncommitted()

    def allocate_slots(
        self,
        seq_id: SeqId,
        num_new_tokens: int,
        prefix: CachedPrefix | None = None,
        policy: EvictionPolicy = NO_EVICTION,
    ) -> SlotAllocation | None:
        """Give `num_new_tokens` more tokens slots at the end of a GPU-resident sequence; a sequence
        not seen yet starts from `prefix` (whose blocks it then shares) with eviction `policy` (the
        one-sequence entry tests and the demo use; requests enter through `admit`). Returns None,
        changing nothing, when the pool lacks room. Appending into a shared, partly filled last
        block first copies it (copy-on-write)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        tables = self._tables.get(seq_id)
        if tables is None:  # admission's rule for one sequence of the prefix and the new tokens
            if prefix is not None and len(self.specs) > 1:
                raise ValueError("a sequence of several KV-cache groups starts from their hits: admit()")
            prefixes = [prefix] if prefix is not None else self._no_hit()  # (the caller counted on all of it)
            plan = self._plan([prefixes[0].num_tokens + num_new_tokens], [0], prefixes, False, may_drop_partial=False)
            if plan.status is not AdmissionStatus.NOW:
                return None
            tables, copies = self._start(seq_id, prefixes, policy)
            alloc = SlotAllocation([], copies)
        else:
            if prefix is not None:
                raise ValueError(f"sequence {seq_id!r} exists already; a prefix only starts one")
            if tables[0].on_cpu:
                raise RuntimeError(f"sequence {seq_id!r} is swapped out; swap it in first")
            if not self.budget.fits(self.num_blocks_needed(seq_id, num_new_tokens), keep_watermark=False):
                return None
            alloc = SlotAllocation([])
        for table in tables:  # (each group's new blocks, group after group)
            grown = grow(table, self.pool, num_new_tokens)
            alloc.new_block_ids += grown.new_block_ids
            alloc.copies += grown.copies
        return alloc

    def evict(self, seq_id: SeqId, num_computed: int, mass: Sequence[float] | None = None) -> int:
        """After a step that left `num_computed` of the sequence's tokens in the cache: release the
        blocks its eviction policy drops (H2O scores them by `mass`). Returns how many."""
        table = self._table(seq_id)
        if not 0 <= num_computed <= table.num_tokens:
            raise IndexError(f"{num_computed} computed tokens in a sequence with {table.num_tokens} slots")
        return self.eviction.evict(seq_id, table, num_computed, mass)

    def prepare_sinks(self, seq_id: SeqId) -> list[tuple[int, int, int]]:
        return self.eviction.prepare_sinks(seq_id, self._table(seq_id))

    def _start(self, seq_id: SeqId, prefixes: Sequence[CachedPrefix],
               policy: EvictionPolicy) -> tuple[list[BlockTable], list[tuple[int, int]]]:  # fmt: skip
        """A new sequence's tables, one per group, holding its hits; the copies a partial hit makes."""
        policy = policy or NO_EVICTION
        windowed = next((s for s in self.specs if not isinstance(s, FullAttention)), None)
        if policy.evicts and windowed is not None:
            raise ValueError(f"kv_eviction={policy.describe()!r} does not go with layers that read a "
                             f"{windowed.describe()}: they release what they no longer read")  # fmt: skip
        tables, copies = [], []
        for prefix in prefixes:  # (under a window, what its first query reads only)
            table, made = self.prefix.take(prefix)
            tables.append(table)
            copies += made
        self._tables[seq_id] = tables
        self.eviction.open(seq_id, policy)
        return tables, copies

    # ------------------------------------------------------------------ lifetime
    def fork(self, parent_id: SeqId, child_id: SeqId, num_blocks: int | None = None) -> None:
        """Make `child_id` share the first `num_blocks` blocks of `parent_id` (all of them by default:
        parallel samples, beams), in every group; a partial share covers full blocks only."""
        parents = self._tables_of(parent_id)
        if parents[0].on_cpu:
            raise RuntimeError(f"sequence {parent_id!r} is swapped out; swap it in before forking")
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} exists already")
        bs, children = self.block_size, []
        for spec, parent in zip(self.specs, parents, strict=True):
            if num_blocks is None:
                n, num_tokens = len(parent.block_ids), parent.num_tokens
            else:
                n, num_tokens = num_blocks, num_blocks * bs
                if not 0 <= n <= parent.num_tokens // bs:
                    raise ValueError(f"cannot share {n} full blocks of a sequence of {parent.num_tokens} tokens")
                if isinstance(spec, FullAttention):
                    if n and parent.block_ids[n - 1] is None:
                        raise ValueError(f"cannot share {n} blocks: the last of them was evicted")
                elif any(b is None for b in parent.block_ids[needed_from(spec, num_tokens, bs) : n]):
                    raise ValueError(f"cannot share {n} blocks: the window reads one that was released")
            children.append(parent.share(n, num_tokens))
        copies = self.eviction.fork(parent_id, child_id, parents[0], children[0])
        for b in [b for child in children for b in child.resident] + copies:
            self.pool.incref(self.pool.blocks[b])
        self._tables[child_id] = children

    def free(self, seq_id: SeqId, token_ids: Sequence[int] | None = None, num_computed: int = 0) -> None:
        """Release a finished or aborted sequence; its blocks go back tail first. With its
        `token_ids` and the number of them whose KV is written, its partly filled last block stays
        cached as a source of partial prefix hits (prefix_registry.py: `register_tail`)."""
        table = self._table(seq_id)
        if token_ids is not None:
            if not 0 <= num_computed <= min(table.num_tokens, len(token_ids)):
                raise IndexError(f"{num_computed} computed tokens for a sequence of {table.num_tokens} slots")
            if len(self.specs) == 1:  # (partial hits are one group's)
                self.prefix.register_tail(table, token_ids, num_computed)
        tables = self._tables.pop(seq_id)
        copies = self.eviction.close(seq_id, table)
        for i, t in enumerate(tables):
            if t.on_cpu:
                self.swap.free(t)
            else:
                self.pool.free(self.pool.blocks[b] for b in t.resident + (copies if not i else []))

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
        ids = list(dict.fromkeys(seq_ids))
        for s in ids:
            if self._table(s).on_cpu == to_cpu:
                raise RuntimeError(f"sequence {s!r} is already {'swapped out' if to_cpu else 'resident'}")
        tables = [t for s in ids for t in self._tables[s]]
        if not to_cpu:
            return self.swap.swap_in(tables)
        return self.swap.swap_out(tables, lambda: [self.eviction.drop_copies(s) for s in ids])

    # ------------------------------------------------------------------ statistics and checks
    def stats(self) -> CacheStats:
        on_gpu = sum(not t[0].on_cpu for t in self._tables.values())
        held = [0] * len(self.specs)  # per group: the blocks GPU-resident tables hold
        for t in self._all_tables():
            held[t.group] += 0 if t.on_cpu else len(t.block_ids) - t.num_holes
        return collect_stats(self.pool, self.swap.pool, self.prefix.cache, self.prefix.tier, self.bytes_per_block,
                             logical_blocks=sum(held), num_seqs=on_gpu, num_swapped_seqs=len(self._tables) - on_gpu,
                             evicted_tokens=self.eviction.num_evicted_tokens, cold=self.eviction.cold,
                             demotions=self.eviction.num_demoted,
                             groups=tuple(zip((s.describe() for s in self.specs), held, strict=True)))  # fmt: skip

    def memory_map(self) -> MemoryMap:
        """Every block's state and every block table (memory_map.py), for the dashboard."""
        tables = sorted((table_map(k, t) for k, ts in self._tables.items() for t in ts),
                        key=lambda m: (m.request_id, m.index, m.group))  # fmt: skip
        return MemoryMap(self.block_size, block_states(self.pool), block_states(self.swap.pool),
                         block_states(self.prefix.tier_pool), tuple(tables))  # fmt: skip

    def check_invariants(self, token_ids: dict[SeqId, Sequence[int]] | None = None) -> None:
        """Recompute every component's bookkeeping from scratch and compare; raise InvariantError.
        With `token_ids` (sequence -> its tokens, as the request holds them) the chain digests are
        recomputed from the tokens too."""
        gpu_refs = Counter(b for t in self._all_tables() if not t.on_cpu for b in t.resident)
        gpu_refs.update(self.eviction.held_blocks())
        gpu_refs.update(self.prefix.pinned_blocks())
        cpu_refs = Counter(b for t in self._all_tables() if t.on_cpu for b in t.resident)
        firsts = {s: t[0] for s, t in self._tables.items()}
        tables, tokens = firsts, token_ids
        if len(self.specs) > 1:  # every group's table, named (sequence, group)
            tables = {(s, g): t for s, ts in self._tables.items() for g, t in enumerate(ts)}
            tokens = None if token_ids is None else {(s, g): ids for s, ids in token_ids.items()
                                                     for g in range(len(self.specs))}  # fmt: skip
        check_all([
            lambda: self.pool.check_invariants(gpu_refs),
            lambda: self.swap.pool.check_invariants(cpu_refs),
            self.swap.check_invariants,
            self.prefix.check_invariants,
            lambda: self.eviction.check_invariants(firsts),
            lambda: check_tables(tables, self.pool, self.swap.pool, self.block_size, tokens),
            lambda: [check(all(t.group == g and t.on_cpu == ts[0].on_cpu and t.num_tokens == ts[0].num_tokens
                               for g, t in enumerate(ts)) and len(ts) == len(self.specs),
                           lambda: f"{s}: its groups' tables disagree") for s, ts in self._tables.items()],
        ])  # fmt: skip

    def check_window(self, seq_id: SeqId, num_computed: int) -> None:
        """Between steps, a sequence with `num_computed` tokens computed holds no block its layers'
        window no longer reads, and no more than the window's bound (layer_window.py)."""
        for spec, table in zip(self.specs, self._tables_of(seq_id), strict=True):
            check_window(seq_id, table, spec, num_computed, self.block_size)

    # ------------------------------------------------------------------ helpers
    def _table(self, seq_id: SeqId) -> BlockTable:
        """The sequence's table of group 0 (its only one in a model of one group)."""
        return self._tables_of(seq_id)[0]

    def _tables_of(self, seq_id: SeqId) -> list[BlockTable]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _all_tables(self):
        return (t for tables in self._tables.values() for t in tables)
