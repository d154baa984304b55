"""All block arithmetic: can these sequences get their blocks — now, later, or never — and how many.

A request enters the cache as a group: its lead sequence (the first live one) takes the longest
cached prefix of its tokens, and every other sequence (parallel samples or beams brought back after
a recompute) shares the lead's leading full blocks as far as their tokens agree:

    lead   [h0][h1][l2][l3.]       h = prefix-cache hit, l = new block of the lead
    sib 1  [h0][h1][l2][s3][s4.]   shares 3 blocks with the lead, owns 2
    sib 2  [h0][h1][t2.]           shares 2, owns 1

`plan` counts the new blocks of all of them together (one sequence alone too: the manager's
`allocate_slots` starts a sequence by the same rule); `growth_blocks` counts what
running sequences take to grow (copy-on-write included); `fits` is the one watermark rule: a
newcomer (admitted, or swapped back in) leaves `watermark_blocks` free for running sequences to grow
into whenever anything runs. The scheduler asks; it never recounts.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpage.core.block import Block, cdiv
from kvpage.core.block_pool import BlockPool
from kvpage.core.block_table import BlockTable, common_prefix
from kvpage.core.prefix_registry import CachedPrefix


class AdmissionStatus(enum.Enum):
    NOW = "now"  # enough free blocks, watermark kept
    LATER = "later"  # would fit once other sequences release blocks
    NEVER = "never"  # would not fit even in an empty pool; the request must be failed


@dataclass(slots=True)
class Admission:
    status: AdmissionStatus
    blocks_needed: int  # new blocks for the whole group (hits and blocks shared with the lead excluded)
    blocks_available: int  # free blocks that may be used now, watermark already held back
    reason: str | None = None  # set for NEVER: a sentence for the user
    prefix: CachedPrefix | None = None  # the lead's hits, valid until the pool changes
    shared_blocks: list[int] = field(default_factory=list)  # per sequence: leading blocks shared with the lead
    # a model of several KV-cache groups: each group's hits (`prefix` is group 0's), all of one length
    groups: list[CachedPrefix] = field(default_factory=list)


class BlockBudget:
    """The GPU pool's free blocks as admission and growth see them."""

    def __init__(self, pool: BlockPool, block_size: int, watermark: float) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.pool = pool
        self.block_size = block_size
        self.watermark_blocks = int(watermark * pool.num_total)

    def fits(self, need: int, *, keep_watermark: bool, freed: int = 0) -> bool:
        """`need` new blocks fit now (`freed`: cached free blocks the newcomer takes off the queue)."""
        return need <= self.available(keep_watermark=keep_watermark, freed=freed)

    def available(self, *, keep_watermark: bool, freed: int = 0) -> int:
        return self.pool.num_free - freed - (self.watermark_blocks if keep_watermark else 0)

    def plan(self, lengths: Sequence[int], shared: Sequence[int], prefix: CachedPrefix, hits: list[Block],
             *, keep_watermark: bool, unqueued: int = 0) -> Admission:  # fmt: skip
        """Could sequences of these token counts (lead first; `shared[i]`: leading blocks sequence i
        shares with the lead, 0 for the lead), the lead hitting `prefix` (GPU `hits`; `unqueued`:
        free blocks taking it takes off the queue), get all their slots now, later, or never?
        NEVER: not even in an empty pool."""
        total = self.total_blocks(lengths, shared, prefix)
        return self.decide(lengths, total, total - len(hits), keep_watermark=keep_watermark, unqueued=unqueued,
                           prefix=prefix, shared=shared)  # fmt: skip

    def total_blocks(self, lengths: Sequence[int], shared: Sequence[int], prefix: CachedPrefix | None) -> int:
        """Blocks the sequences hold once admitted (hits included; holes of the layers' window not)."""
        bs = self.block_size
        total = cdiv(lengths[0], bs) + sum(cdiv(n, bs) - m for n, m in zip(lengths[1:], shared[1:]))
        return total - (prefix.released if prefix is not None else 0)

    def decide(self, lengths: Sequence[int], total: int, needed: int, *, keep_watermark: bool, unqueued: int,
               prefix: CachedPrefix | None, shared: Sequence[int], groups: list | None = None,
               ) -> Admission:  # fmt: skip
        """NOW, LATER or NEVER for sequences that hold `total` blocks, `needed` of them new (a hit on
        the CPU tier, or a partial one, takes a new block too); every KV-cache group's counted in."""
        bs = self.block_size
        available = self.available(keep_watermark=keep_watermark, freed=unqueued)
        if total > self.pool.num_total:
            seqs = f"its {len(lengths)} sequences need" if len(lengths) > 1 else "it needs"
            reason = (
                f"{seqs} {total} blocks of {bs} tokens for {sum(lengths)} tokens, "
                f"but the whole cache holds {self.pool.num_total} blocks"
            )
            return Admission(AdmissionStatus.NEVER, needed, available, reason, prefix, list(shared), groups or [])
        status = AdmissionStatus.NOW if needed <= available else AdmissionStatus.LATER
        return Admission(status, needed, available, None, prefix, list(shared), groups or [])

    def shared_with_lead(self, token_lists: Sequence[Sequence[int]]) -> list[int]:
        """Per sequence: the lead's leading full blocks it shares (never its own last token's)."""
        lead = token_lists[0]
        return [0] + [min(common_prefix(lead, t), len(t) - 1) // self.block_size for t in token_lists[1:]]

    def growth_blocks(self, growth: Sequence[tuple[BlockTable, int]]) -> int:
        """Blocks that appending n tokens to each table, in this order, takes. Exact for tables
        sharing a partly filled last block: of r appenders to a block that R tables hold, r - 1 copy
        it, and the last one copies too only if someone else still holds it."""
        bs, total = self.block_size, 0
        appenders: Counter[int] = Counter()
        for table, n in growth:
            if n <= 0:
                continue
            total += table.new_blocks_for(bs, n)
            last = table.appends_into_last(bs, n)
            if last is not None:
                appenders[last] += 1
        for block_id, r in appenders.items():
            total += r - 1 + (self.pool.blocks[block_id].ref_count > r)
        return total
