"""One sequence's block table: which block holds each run of `block_size` of its tokens.

    len(block_ids) == ceil(num_tokens / block_size)        num_tokens: tokens with a slot
    token t  ->  slot block_ids[t // B] * B + t % B        (`slot_mapping`)

An entry is HOLE (None) where an eviction policy released the block (core/eviction/): logical
indices, and the chain of digests, keep their meaning; only full blocks before the last can be
holes. The table also remembers the chain digests of its leading full blocks (as far as they were
hashed) and how many of them were offered to the prefix cache; `on_cpu` says which pool its block
ids index (the GPU pool, or the CPU swap pool after a swap-out).

The table is plain data and arithmetic; the pools' reference counts are the manager's components'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpage.core.block import cdiv

HOLE = None  # a block-table entry whose block an eviction policy released


@dataclass(slots=True)
class BlockTable:
    block_ids: list[int | None]
    num_tokens: int  # tokens with a slot
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chain digests of leading full blocks
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    on_cpu: bool = False

    @property
    def resident(self) -> list[int]:
        """The blocks the table holds, in order (holes left out)."""
        return [b for b in self.block_ids if b is not None]

    @property
    def num_holes(self) -> int:
        return self.block_ids.count(HOLE)

    def num_full(self, block_size: int) -> int:
        return self.num_tokens // block_size

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
        )

    def remap(self, mapping: dict[int, int], *, on_cpu: bool) -> None:
        """Point the resident entries at other blocks (a swap), holes staying holes."""
        self.block_ids = [None if b is None else mapping[b] for b in self.block_ids]
        self.on_cpu = on_cpu
        self.num_registered = 0  # fresh GPU blocks get registered again


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token lists share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
