"""One sequence's block table: which block holds each run of `block_size` of its tokens.

    len(block_ids) == ceil(num_tokens / block_size)        num_tokens: tokens with a slot
    token t  ->  slot block_ids[t // B] * B + t % B        (`slot_mapping`)

An entry is HOLE (None) where an eviction policy released the block (core/eviction/), or where
the layers' own window did (`released` leading entries: a sliding-window or chunked group's blocks
that no later query reads, kv_spec.py; the KV after them is exact, unlike after a policy's holes):
logical indices, and the chain of digests, keep their meaning; only full blocks before the last
can be holes. A hole whose block was demoted rather than dropped is tagged in `demoted` with the lower
precision and the block of that precision's pool that holds it now (eviction/windows.py). The
table also remembers the chain digests of its leading full blocks (as far as they were hashed) and
how many of them were offered to the prefix cache; `on_cpu` says which pool its block
ids index (the GPU pool, or the CPU swap pool after a swap-out).

`grow` appends slots (copy-on-write included); `check_tables` checks tables against their pools.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvpage.core.block import cdiv
from kvpage.core.block_pool import BlockPool
from kvpage.core.cache_key import extra_keys_for, hash_block
from kvpage.core.invariants import check

HOLE = None  # a block-table entry whose block an eviction policy released


@dataclass(slots=True)
class SlotAllocation:
    new_block_ids: list[int]  # blocks appended to the block table, in order
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy KV before writing


@dataclass(slots=True)
class BlockTable:
    block_ids: list[int | None]
    num_tokens: int  # tokens with a slot
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chain digests of leading full blocks
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    on_cpu: bool = False
    # logical index -> (precision, block id in that precision's pool): holes kept at a lower precision
    demoted: dict[int, tuple[str, int]] = field(default_factory=dict)
    released: int = 0  # leading entries the layers' window released (holes no later query reads)
    group: int = 0  # the KV-cache group whose layers' blocks it names (kv_spec.py: its digests name it)

    @property
    def resident(self) -> list[int]:
        """The blocks the table holds, in order (holes left out)."""
        return [b for b in self.block_ids if b is not None]

    @property
    def num_holes(self) -> int:
        return self.block_ids.count(HOLE)

    @property
    def num_evicted_blocks(self) -> int:
        """Holes an eviction policy made (after them, KV attended to a partial context)."""
        return self.num_holes - self.released

    def slot_mapping(self, block_size: int, start: int, end: int) -> list[int]:
        """Physical slots of tokens [start, end)."""
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {end}) outside a sequence of {self.num_tokens}")
        table, bs = self.block_ids, block_size
        return [table[t // bs] * bs + t % bs for t in range(start, end)]  # type: ignore[operator]

    def new_blocks_for(self, block_size: int, num_new_tokens: int) -> int:
        """Blocks appended to give `num_new_tokens` more tokens a slot."""
        return cdiv(self.num_tokens + num_new_tokens, block_size) - len(self.block_ids)

    def appends_into_last(self, block_size: int, num_new_tokens: int) -> int | None:
        """The last block, if new tokens go into it (it is partly filled): the copy-on-write candidate."""
        if num_new_tokens <= 0 or not self.num_tokens % block_size:
            return None
        return self.block_ids[-1]

    def token_runs(self, block_size: int, num_new_tokens: int) -> list[tuple[int, int]]:
        """(table index, tokens) runs that `num_new_tokens` appended tokens fill, in order."""
        runs, pos, end = [], self.num_tokens, self.num_tokens + num_new_tokens
        while pos < end:
            take = min(end, (pos // block_size + 1) * block_size) - pos
            runs.append((pos // block_size, take))
            pos += take
        return runs

    def share(self, num_blocks: int, num_tokens: int) -> BlockTable:
        """A new table holding this one's first `num_blocks` entries, covering `num_tokens` tokens
        (a fork: the caller takes the references)."""
        return BlockTable(
            block_ids=self.block_ids[:num_blocks],
            num_tokens=num_tokens,
            cache_salt=self.cache_salt,
            block_hashes=self.block_hashes[:num_blocks],
            num_registered=min(self.num_registered, num_blocks),
            demoted={i: d for i, d in self.demoted.items() if i < num_blocks},
            released=min(self.released, num_blocks),
            group=self.group,
        )

    def remap(self, mapping: dict[int, int], *, on_cpu: bool) -> None:
        """Point the resident entries at other blocks (a swap), holes staying holes (demoted blocks
        stay in their precision's pool)."""
        self.block_ids = [None if b is None else mapping[b] for b in self.block_ids]
        self.on_cpu = on_cpu
        self.num_registered = 0  # fresh GPU blocks get registered again


def grow(table: BlockTable, pool: BlockPool, num_new_tokens: int) -> SlotAllocation:
    """Slots for `num_new_tokens` more tokens at the table's end, from `pool` (the caller checked
    there is room: admission.py). Appending into a shared, partly filled last block first copies it
    (copy-on-write): the returned copies are the worker's."""
    bs = pool.block_size
    alloc = SlotAllocation(new_block_ids=[])
    last = table.appends_into_last(bs, num_new_tokens)
    if last is not None and pool.blocks[last].ref_count > 1:
        old = pool.blocks[last]
        (new,) = pool.allocate(1)  # type: ignore[misc]
        pool.add_tokens(new, old.num_tokens)
        pool.decref(old)
        table.block_ids[-1] = new.block_id
        alloc.copies.append((old.block_id, new.block_id))
    fresh = pool.allocate(table.new_blocks_for(bs, num_new_tokens)) or []
    alloc.new_block_ids = [b.block_id for b in fresh]
    table.block_ids.extend(alloc.new_block_ids)
    for i, n in table.token_runs(bs, num_new_tokens):
        pool.add_tokens(pool.blocks[table.block_ids[i]], n)  # type: ignore[index]
    table.num_tokens += num_new_tokens
    return alloc


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token lists share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_tables(tables: dict[Hashable, BlockTable], gpu: BlockPool, cpu: BlockPool, block_size: int,
                 token_ids: dict[Hashable, Sequence[int]] | None = None) -> None:  # fmt: skip
    """Each table against its pool's blocks: lengths, fills, digests (recomputed from the request's
    tokens when `token_ids` gives them) and what the registered blocks claim to hold."""
    bs = block_size
    for seq_id, table in tables.items():
        n = table.num_tokens
        pool = cpu if table.on_cpu else gpu
        check(len(table.block_ids) == cdiv(n, bs), lambda: f"{seq_id}: table length for {n} tokens")
        check(len(table.block_hashes) <= n // bs, lambda: f"{seq_id}: a digest for a block that is not full")
        check(table.num_registered <= len(table.block_hashes), lambda: f"{seq_id}: registered beyond its digests")
        check(all(b is None for b in table.block_ids[: table.released]) and table.released <= n // bs,
              lambda: f"{seq_id}: a block the window released is held, or a partial one released")  # fmt: skip
        chain = list(table.block_hashes)  # what each full block's digest must be, as far as known
        tokens = token_ids.get(seq_id) if token_ids is not None else None
        if tokens is not None:  # the chain digests must be those of the request's tokens
            check(len(tokens) >= n, lambda: f"{seq_id}: {n} slots but {len(tokens)} tokens")
            chain = []
            for i in range(n // bs):
                chunk = tokens[i * bs : (i + 1) * bs]
                chain.append(
                    hash_block(chain[-1] if chain else None, chunk, extra_keys_for(i, table.cache_salt, table.group))
                )
            check(
                table.block_hashes == chain[: len(table.block_hashes)],
                lambda: f"{seq_id}: chain digests of other tokens",
            )
        for i, b in enumerate(table.block_ids):
            if b is None:
                continue
            block = pool.blocks[b]
            check(block.num_tokens == min(bs, n - i * bs), lambda: f"{seq_id}: fill of block {b}")
            key = block.cache_key
            if key is not None and i < len(chain):  # (a sibling may not have hashed a shared block yet)
                check(
                    key.digest == chain[i],
                    lambda: f"{seq_id}: block {b} is registered under content other than its tokens",
                )
                check(
                    key.parent == (chain[i - 1] if i else None),
                    lambda: f"{seq_id}: block {b} registered under another chain",
                )
            check(key is None or i < n // bs, lambda: f"{seq_id}: block {b} is registered but not full")
