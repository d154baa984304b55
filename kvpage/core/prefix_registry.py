"""Registration of computed blocks in the prefix cache, with commit / discard, and prefix lookups.

In-batch prefix sharing: `register` offers a full block as soon as the step that writes its KV is
scheduled, so a sequence admitted later in the same step hits it. That is safe because every layer
writes all of a step's new K/V before any sequence attends. Registrations wait in an "uncommitted"
list until `commit()`; if the step fails, `discard()` forgets them so no one can hit a block whose
KV was never written (and no copy of it goes to the CPU tier).

`find` looks a prompt's leading full blocks up in the GPU pool's map, then in the CPU tier
(cpu_tier.py); what both miss it asks of the shared tier (remote_tier.py) through `RemoteFetches`
(remote_fetch.py), read between steps (`fetch_remote`) and landed in the CPU tier: the request waits
a step (`CachedPrefix.awaiting_fetch`), the scheduler never waits on the network. `take` gives a new
block table its hits: references to the GPU ones, restored copies of the tier ones. With prefix
caching off every lookup misses and nothing is registered. What the step being scheduled registered,
writes through and pins is its `CommitLedger` (commit_ledger.py) until `commit` or `discard`.

Past the last full block hit, the prompt's next tokens may match only the leading slots of a
registered block (a shared system prompt ends inside a block; each question differs): `find` then
notes a partial hit, and `take` copies that block into the new table's last block, so only the
tokens after the match are computed (what a token-level cache such as SGLang's radix tree or
llama.cpp's slot reuse serves; block-level caches recompute up to block_size - 1 tokens). The source
is pinned (referenced) from `take` until the step ends, so nothing reuses it before the worker's copy,
and it must hold written KV: a block registered by the step being scheduled is never a source.
A sequence that ends (or is preempted by recompute) registers its partly filled last block too
(`register_tail`), under the digest of the tokens it holds: no full-block lookup can find it, a
partial lookup can (the same prompt again: everything but its last token is copied; the next turn
of a chat: the end of the answer). Such tail blocks are local: never announced as KV events, never
offloaded to the CPU tier.

Blocks a step registers go to the shared tier after that step's forward (`take_transfers`'
write-through list), announced at commit.

The layers' window (kv_spec.py, layer_window.py): for a sliding-window or chunked spec a hit needs
only the blocks later queries read, so `find` looks every servable block up and takes the longest
prefix it can resume after (`longest_hit`, searched from the right): the entries before the blocks
it needs are holes of the new table (`CachedPrefix.released`), hit or not. Such a lookup asks
nothing of the shared tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvpage.core.block import Block
from kvpage.core.block_pool import BlockPool
from kvpage.core.block_table import BlockTable
from kvpage.core.cache_key import CacheKey, block_digests, extra_keys_for, hash_block
from kvpage.core.commit_ledger import CommitLedger
from kvpage.core.cpu_tier import CpuTier
from kvpage.core.invariants import check
from kvpage.core.kv_events import GPU, KVEventLog
from kvpage.core.kv_spec import FULL, FullAttention, LayerSpec, longest_hit, needed_from
from kvpage.core.prefix_cache import PrefixCache
from kvpage.core.remote_fetch import RemoteFetches
from kvpage.core.remote_tier import RemoteTier


@dataclass(slots=True, frozen=True)
class PartialHit:
    """The next block's leading tokens, found in a registered GPU block: copied, not recomputed."""

    block_id: int  # the registered source block
    digest: bytes  # its digest at the lookup (to see that it was not reused since)
    num_tokens: int  # its leading tokens that equal the prompt's (1 .. block_size - 1)


@dataclass(slots=True)
class CachedPrefix:
    """The longest run of leading full blocks of a prompt found in the prefix cache, and maybe the
    leading tokens of the block after them."""

    block_ids: list[int | None]  # GPU blocks hit; None where the hit is on the CPU tier
    block_hashes: list[bytes]  # the chain digests of those blocks
    num_tokens: int  # tokens covered: len(block_ids) * block_size, plus the partial hit's
    num_query_tokens: int  # length of the prompt that was looked up
    cache_salt: str | None = None
    tier_block_ids: dict[int, int] = field(default_factory=dict)  # index -> tier block
    partial: PartialHit | None = None
    awaiting_fetch: bool = False  # the rest was asked of the shared tier: worth waiting a step for
    released: int = 0  # leading entries the layers' window does not need (holes of the new table)
    group: int = 0  # the KV-cache group it was looked up in (its digests name it)


@dataclass(slots=True)
class TierTransfers:
    """What the worker moves for the prefix cache's tiers before (and, write-through, after) a step."""

    offload: list[tuple[int, int]] = field(default_factory=list)  # (GPU, CPU tier) copies of evicted blocks
    fetched: list[tuple[int, bytes]] = field(default_factory=list)  # (CPU tier, payload) from the shared tier
    restore: list[tuple[int, int]] = field(default_factory=list)  # (CPU tier, GPU) copies of tier hits
    write_through: list[tuple[int, bytes, tuple[int, ...]]] = field(default_factory=list)  # (GPU, digest, tokens)


class PrefixRegistry:
    def __init__(self, pool: BlockPool, block_size: int, num_tier_blocks: int = 0, remote: RemoteTier | None = None,
                 specs: Sequence[LayerSpec] = (FULL,)) -> None:  # fmt: skip
        self.pool = pool
        self.specs = tuple(specs)  # what each KV-cache group's layers read (kv_spec.py)
        self.cache: PrefixCache | None = pool.prefix_cache  # None: prefix caching is off
        self.block_size = block_size
        self.events = KVEventLog(block_size)  # what this cache holds, announced as it changes (kv_events.py)
        # the tiers below the GPU pool: the CPU tier (one of no blocks when absent: every lookup misses,
        # nothing is kept), then the shared tier, whose blocks land in the CPU tier (none without one)
        self.tier = CpuTier(num_tier_blocks if self.cache is not None else 0, block_size, self.events)
        has_tier = self.tier.pool.num_total > 0
        self.fetches = RemoteFetches(remote, self.tier) if remote is not None and has_tier else None
        self.remote = self.fetches.remote if self.fetches is not None else None
        self.ledger = CommitLedger()  # what the step being scheduled registered, writes through, pins
        pool.on_evict = self._on_evict

    @property
    def enabled(self) -> bool:
        return self.cache is not None

    @property
    def tier_pool(self) -> BlockPool | None:
        return self.tier.pool if self.tier.pool.num_total else None

    def take_transfers(self) -> TierTransfers:
        """The step's tier transfers (call once the step is scheduled)."""
        offload, fetched, restore = self.tier.take_transfers()
        write_through = []
        if self.remote is not None and self.remote.available:
            for block in self.ledger.uncommitted:
                key = block.cache_key
                if key is not None and not self.remote.knows(key.digest):
                    self.ledger.written.append(key)
                    write_through.append((block.block_id, key.digest, key.token_ids))
        return TierTransfers(offload, fetched, restore, write_through)

    # ------------------------------------------------------------------ lookups
    def find(self, token_ids: Sequence[int], cache_salt: str | None = None, *, remote: bool = True) -> CachedPrefix:
        """Leading full blocks of `token_ids` already in the cache. The last token is never served
        from cache (its logits must be computed), so at most (len - 1) // block_size blocks hit.
        `remote`: ask the shared tier for what the local tiers miss, fetched before the next step
        (`awaiting_fetch` says whether to wait for it; no network call here)."""
        prefix = CachedPrefix([], [], 0, len(token_ids), cache_salt)
        if self.cache is None:
            return prefix
        bs = self.block_size
        servable = token_ids[: max(0, len(token_ids) - 1) // bs * bs]  # the same digests a fleet router computes
        if len(self.specs) > 1:
            raise ValueError("a model of several KV-cache groups looks its prompts up in all of them: find_groups")
        if not isinstance(self.specs[0], FullAttention):
            self._find_window(prefix, servable, cache_salt)
            self._find_partial(prefix, token_ids)
            prefix.num_tokens = len(prefix.block_ids) * bs + (prefix.partial.num_tokens if prefix.partial else 0)
            return prefix  # (a partial hit may let the new table release more: `take`)
        digests = block_digests(servable, bs, cache_salt)
        for i, digest in enumerate(digests):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            block = self.cache.lookup(digest, chunk)
            if block is None:
                tier_block = self.tier.lookup(digest, chunk)
                if tier_block is None:
                    if remote and self.fetches is not None and self.fetches.remote.available:
                        rest = [(digest, chunk)] + [(d, tuple(servable[j * bs : (j + 1) * bs]))
                                                    for j, d in enumerate(digests, i + 1)]  # fmt: skip
                        parent = prefix.block_hashes[-1] if prefix.block_hashes else None
                        prefix.awaiting_fetch = self.fetches.ask(i, parent, rest, cache_salt)
                    break
                prefix.tier_block_ids[i] = tier_block
            prefix.block_ids.append(block.block_id if block is not None else None)
            prefix.block_hashes.append(digest)
        self._find_partial(prefix, token_ids)
        prefix.num_tokens = len(prefix.block_ids) * bs + (prefix.partial.num_tokens if prefix.partial else 0)
        return prefix

    def _find_window(self, prefix: CachedPrefix, servable: Sequence[int], cache_salt: str | None) -> None:
        """`find` for a window's spec: every block looked up, the longest resumable prefix taken."""
        digests, found = self._look_up_all(servable, cache_salt, prefix.group)
        k = longest_hit(self.specs[prefix.group], [f is not None for f in found], self.block_size)
        self._take_hit(prefix, digests, found, k)

    def find_groups(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[CachedPrefix]:
        """A prompt's hits in every KV-cache group at once, all of one length: the longest prefix every
        group can resume after (a full-attention group holds all its blocks, a window's group the
        blocks its first query reads). Each group's longest hit at most k lowers k until none does
        (vLLM's hybrid coordinator's fixed point; each group's hits are monotone in k). No partial
        hit, no shared tier: one group's lookups (`find`) have those."""
        prefixes = [CachedPrefix([], [], 0, len(token_ids), cache_salt, group=g) for g in range(len(self.specs))]
        if self.cache is None:
            return prefixes
        bs = self.block_size
        servable = token_ids[: max(0, len(token_ids) - 1) // bs * bs]
        looked = [self._look_up_all(servable, cache_salt, g) for g in range(len(self.specs))]
        present = [[f is not None for f in found] for _, found in looked]
        k = len(servable) // bs
        while (low := min(longest_hit(spec, p, bs, k) for spec, p in zip(self.specs, present, strict=True))) < k:
            k = low
        for prefix, (digests, found) in zip(prefixes, looked, strict=True):
            self._take_hit(prefix, digests, found, k)
            prefix.num_tokens = k * bs
        return prefixes

    def _look_up_all(self, servable: Sequence[int], cache_salt: str | None,
                     group: int) -> tuple[list[bytes], list[tuple[str, int] | None]]:  # fmt: skip
        """Every full block of `servable` looked up in a group: its digests, and where each block is
        held (("gpu", block id), ("tier", tier block)) or None."""
        bs, found = self.block_size, []
        digests = list(block_digests(servable, bs, cache_salt, group))
        for i, digest in enumerate(digests):
            chunk = tuple(servable[i * bs : (i + 1) * bs])
            block = self.cache.lookup(digest, chunk)  # type: ignore[union-attr]
            found.append(("gpu", block.block_id) if block is not None else None)
            if block is None and (tier_block := self.tier.lookup(digest, chunk)) is not None:
                found[-1] = ("tier", tier_block)
        return digests, found

    def _take_hit(self, prefix: CachedPrefix, digests: list[bytes], found: list[tuple[str, int] | None],
                  k: int) -> None:  # fmt: skip
        """`prefix` = the first k blocks looked up, those before what its group's layers then read
        left as holes."""
        bs = self.block_size
        prefix.released = needed_from(self.specs[prefix.group], k * bs, bs)
        prefix.block_hashes = digests[:k]
        for i in range(k):
            where, b = found[i] if i >= prefix.released else (None, None)  # type: ignore[misc]
            prefix.block_ids.append(b if where == "gpu" else None)
            if where == "tier":
                prefix.tier_block_ids[i] = b

    def resident_chain(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The GPU blocks that hold the leading full blocks of `token_ids` as a prompt of its own
        (the last block too: nothing is computed from them), written by a step that ran: the cached
        KV of a segment (segments.py). Stops at the first block not resident."""
        if self.cache is None:
            return []
        bs, out = self.block_size, []
        unwritten = self.ledger.unwritten_ids()
        for i, digest in enumerate(block_digests(token_ids, bs, cache_salt)):
            block = self.cache.lookup(digest, tuple(token_ids[i * bs : (i + 1) * bs]))
            if block is None or block.block_id in unwritten:
                break
            out.append(block.block_id)
        return out

    def pin(self, block_ids: Iterable[int]) -> None:
        """Reference these registered blocks until the step ends: the sources of its copies."""
        for b in block_ids:
            block = self.pool.blocks[b]
            self.pool.incref(block)
            self.ledger.pinned.append(block)

    def fetch_remote(self) -> int:
        """Between steps: read what lookups asked of the shared tier, landed in the CPU tier (the
        blocks landed)."""
        return self.fetches.fetch() if self.fetches is not None else 0

    def _find_partial(self, prefix: CachedPrefix, token_ids: Sequence[int]) -> None:
        """The leading tokens of the block after the full hits, if a registered GPU block holds them
        (never the prompt's last token, whose logits must be computed). In a prompt's first block at
        least half a block must match: every chat prompt starts with the same few template tokens,
        and a copy for those would save nothing worth a block (and call every new prompt cached). A state
        group's block (kv_spec.RecurrentState) holds the state after its last token only: a partial hit
        there must take every token it holds."""
        bs, i = self.block_size, len(prefix.block_ids)
        end = min((i + 1) * bs, len(token_ids) - 1)
        if end <= i * bs:
            return
        parent = prefix.block_hashes[-1] if prefix.block_hashes else None
        unwritten = self.ledger.unwritten_ids()  # their KV is written by the step being scheduled
        found = self.cache.partial(parent, tuple(token_ids[i * bs : end]), extra_keys_for(i, prefix.cache_salt),  # type: ignore[union-attr]
                                   unwritten)  # fmt: skip
        if (
            found is not None
            and any(spec.kind == "state" for spec in self.specs)
            and found[1] != len(found[0].cache_key.token_ids)
        ):  # type: ignore[union-attr]
            found = None  # (a state block holds the state after its last token: a hit takes it all or nothing)
        if found is not None and (i or 2 * found[1] >= bs):
            block, n = found
            prefix.partial = PartialHit(block.block_id, block.cache_key.digest, n)  # type: ignore[union-attr]

    def hit_blocks(self, prefix: CachedPrefix | None) -> list[Block]:
        """The GPU blocks a prefix hits (its tier hits are checked, not returned)."""
        if prefix is None or not prefix.block_ids:
            return []
        blocks = []
        for i, (b, digest) in enumerate(zip(prefix.block_ids, prefix.block_hashes, strict=True)):
            if i < prefix.released:  # a hole of the new table: not needed
                continue
            if i in prefix.tier_block_ids:
                fresh = self.tier.holds(prefix.tier_block_ids[i], digest)
            else:
                block = self.pool.blocks[b]  # type: ignore[index]
                fresh = block.cache_key is not None and block.cache_key.digest == digest
                blocks.append(block)
            if not fresh:
                raise RuntimeError("stale CachedPrefix: a hit block was reused since the lookup")
        return blocks

    def partial_source(self, prefix: CachedPrefix | None) -> Block | None:
        """The GPU block a prefix's partial hit copies from (checked to hold the same content still)."""
        if prefix is None or prefix.partial is None:
            return None
        block = self.pool.blocks[prefix.partial.block_id]
        if block.cache_key is None or block.cache_key.digest != prefix.partial.digest:
            raise RuntimeError("stale CachedPrefix: the partial hit's block was reused since the lookup")
        return block

    def drop_partial(self, prefix: CachedPrefix) -> None:
        """Forget `prefix`'s partial hit: those tokens are computed instead."""
        if prefix.partial is not None:
            prefix.num_tokens -= prefix.partial.num_tokens
            prefix.partial = None

    def num_unqueued(self, prefix: CachedPrefix | None, hits: list[Block] | None = None) -> int:
        """Free (cached) blocks that taking `prefix` takes off the free queue: its GPU hits
        (`hits`, when the caller has them: `hit_blocks(prefix)`) and the partial hit's source."""
        held = self.hit_blocks(prefix) if hits is None else hits
        source = self.partial_source(prefix)
        return sum(b.ref_count == 0 for b in held) + (source is not None and source.ref_count == 0)

    def take(self, prefix: CachedPrefix | None) -> tuple[BlockTable, list[tuple[int, int]]]:
        """A new table holding `prefix`'s hits (references taken, tier hits restored, the partial
        hit copied into a new last block), and the (src, dst) copies the worker makes first."""
        if prefix is None:
            return BlockTable([], 0), []
        self._skip_unread(prefix)
        source = self.partial_source(prefix)
        for block in self.hit_blocks(prefix):
            self.pool.incref(block)
        if source is not None:  # pinned before anything allocates: neither a tier hit's restore nor
            self.pool.incref(source)  # the copy's own block may be handed it
            self.ledger.pinned.append(source)
        block_ids = list(prefix.block_ids)
        if prefix.tier_block_ids:
            restored = self.tier.restore(prefix.tier_block_ids, self.pool, self._register)
            for i, b in restored.items():
                block_ids[i] = b
        n, copies = len(block_ids), []
        if source is not None:
            (copy,) = self.pool.allocate(1)  # type: ignore[misc]
            self.pool.add_tokens(copy, prefix.partial.num_tokens)  # type: ignore[union-attr]
            block_ids.append(copy.block_id)
            copies.append((source.block_id, copy.block_id))
        if self.cache is not None and prefix.num_query_tokens and not prefix.group:  # (counted once a prompt)
            self.cache.num_query_tokens += prefix.num_query_tokens
            self.cache.num_hit_tokens += prefix.num_tokens
        table = BlockTable(block_ids, prefix.num_tokens, prefix.cache_salt, list(prefix.block_hashes), n,
                           released=prefix.released, group=prefix.group)  # fmt: skip
        return table, copies

    def _skip_unread(self, prefix: CachedPrefix) -> None:
        """Under a window, the hit blocks the new table's first query will not read become holes before
        anything is taken (a partial hit resumes past more of them than the full blocks did; a drop
        of it, fewer): neither referenced nor restored from the tier."""
        spec = self.specs[prefix.group]
        if isinstance(spec, FullAttention):
            return
        upto = min(needed_from(spec, prefix.num_tokens, self.block_size), len(prefix.block_ids))
        for i in range(prefix.released, upto):
            prefix.block_ids[i] = None
            prefix.tier_block_ids.pop(i, None)
        prefix.released = max(prefix.released, upto)

    def unpin(self, block_ids: Iterable[int]) -> None:
        """Release pins of `pin` before the step ends (one pin per id given)."""
        for b in block_ids:
            block = self.pool.blocks[b]
            self.ledger.pinned.remove(block)
            self.pool.decref(block)

    def pinned_blocks(self) -> list[int]:
        """Blocks referenced by the step being scheduled as the sources of its copies."""
        return [b.block_id for b in self.ledger.pinned]

    def _end_step(self) -> None:
        """Release the step's pins (its copies' sources, the tier blocks it read)."""
        for block in self.ledger.end():
            self.pool.decref(block)
        self.tier.unpin()
        if self.fetches is not None:
            self.fetches.end_step()

    # ------------------------------------------------------------------ registration
    def register(self, table: BlockTable, token_ids: Sequence[int], num_tokens: int) -> None:
        """The KV of the table's first `num_tokens` tokens is written (or is being written by the step
        now scheduled): register its full blocks as hits. Not for a table with holes (its later KV
        attended to a partial context) or on the CPU pool. The layers' window's holes are skipped
        (their digests still chain)."""
        if self.cache is None or table.on_cpu or table.num_evicted_blocks:
            return
        bs, num_full = self.block_size, num_tokens // self.block_size
        for i in range(table.num_registered, num_full):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = table.block_hashes[i - 1] if i else None
            if i == len(table.block_hashes):
                table.block_hashes.append(hash_block(parent, chunk, extra_keys_for(i, table.cache_salt, table.group)))
            if table.block_ids[i] is None:  # released by the window before it was offered
                continue
            extra = extra_keys_for(i, table.cache_salt, table.group)
            key = CacheKey(table.block_hashes[i], parent, chunk, extra, table.group)
            self._register(self.pool.blocks[table.block_ids[i]], key)
        table.num_registered = max(table.num_registered, num_full)

    def register_tail(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """The sequence ends with the KV of its first `num_computed` tokens written (its full blocks
        were registered by the steps that computed them): its partly filled last block, when it
        holds it alone, is registered under its leading tokens, as a source of partial hits."""
        bs, i = self.block_size, num_computed // self.block_size
        n = num_computed - i * bs
        if self.cache is None or table.on_cpu or table.num_evicted_blocks or not n or i >= len(table.block_ids):
            return
        if not i == len(table.block_hashes) == table.num_registered:  # (e.g. just swapped in: not offered yet)
            return
        block = self.pool.blocks[table.block_ids[i]]  # type: ignore[index]
        if block.ref_count != 1 or block.cache_key is not None:
            return
        parent = table.block_hashes[-1] if i else None
        chunk, extra = tuple(token_ids[i * bs : num_computed]), extra_keys_for(i, table.cache_salt)
        self.cache.register(block, CacheKey(hash_block(parent, chunk, extra), parent, chunk, extra))

    def is_tail(self, block: Block) -> bool:
        """A registered tail block (partly filled), not a full one."""
        return block.cache_key is not None and len(block.cache_key.token_ids) < self.block_size

    def _register(self, block: Block, key: CacheKey) -> None:
        if self.cache.register(block, key):  # type: ignore[union-attr]
            self.ledger.uncommitted.append(block)

    def commit(self) -> None:
        """The scheduled step ran: every block registered for it now holds its KV (announced stored)."""
        for block in self.ledger.uncommitted:
            if block.cache_key is not None:
                self.events.stored(block.cache_key, GPU)
        for key in self.ledger.written:
            self.events.stored_remote(key)
        self._end_step()
        self.events.publish()

    def discard(self, tables: Iterable[BlockTable]) -> None:
        """The scheduled step failed: forget the blocks registered for it (their KV was never
        written); registration of each table starts again where its valid blocks end."""
        for block in self.ledger.uncommitted:
            if block.cache_key is not None:
                self.pool.uncache(block)
        self._end_step()
        for table in tables:
            while table.num_registered and not table.on_cpu:
                b = table.block_ids[table.num_registered - 1]
                if b is None or self.pool.blocks[b].cache_key is not None:
                    break
                table.num_registered -= 1
        self.events.publish()  # (evictions the failed step made are real)

    def _on_evict(self, block: Block) -> None:
        """`block` (registered) is about to be reused: announce it gone, and keep a copy in the tier
        if a committed step wrote its KV (a tail block: neither, it was never announced)."""
        if self.is_tail(block):
            return
        self.events.removed(block.cache_key, GPU)  # type: ignore[arg-type]
        if not self.ledger.is_unwritten(block):
            self.tier.offload(block)

    def reset(self) -> bool:
        """Forget every registration (GPU pool and tier); only when no block is in use."""
        if not self.pool.reset_prefix_cache() or not self.tier.reset():
            return False
        self.events.cleared()
        self.events.publish()
        return True

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        if self.cache is not None:
            bs = self.block_size
            for digest, block in self.cache.items():
                key = block.cache_key
                check(key is not None and key.digest == digest, lambda: f"block {block.block_id}: hash map entry")
                check(key.is_consistent() and 0 < len(key.token_ids) <= bs,  # type: ignore[union-attr]
                      f"block {block.block_id}: stored tokens do not hash to its key")  # fmt: skip
                pins = sum(p is block for p in self.ledger.pinned)  # (a partial hit's source, until the step ends)
                check(len(key.token_ids) == bs or block.ref_count == pins,  # type: ignore[union-attr]
                      f"block {block.block_id}: a tail block is in a table")  # fmt: skip
            registered = sum(b.cache_key is not None for b in self.pool.blocks)
            check(registered == len(self.cache), "a block carries a key the map does not hold")
        self.tier.check_invariants()
        uncommitted = {id(b) for b in self.ledger.uncommitted}
        gpu = ({d for d, b in self.cache.items() if id(b) not in uncommitted and not self.is_tail(b)}
               if self.cache is not None else set())  # fmt: skip
        cpu = {d for d, _ in self.tier.pool.prefix_cache.items()}  # type: ignore[union-attr]
        self.events.check_invariants(gpu, cpu)
        check(all(b.cache_key is not None and b.ref_count > 0 for b in self.ledger.uncommitted),
              "an uncommitted registration was evicted or freed before its step ended")  # fmt: skip
