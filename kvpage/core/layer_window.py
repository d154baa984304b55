"""The layers' own window: what a sliding-window or chunked group releases as its sequences grow.

After a step leaves `n` tokens of a sequence computed, no later query of such a layer reads a key
before `first_visible(n)` (kv_spec.py), so the blocks wholly before it go back to the pool: each
becomes a hole of the sequence's block table, counted in `BlockTable.released` (leading entries,
always full blocks; the last one only where a chunk ends with it, and the next token starts a new
block anyway). Unlike an eviction policy's holes, nothing is lost: every key
a later query reads is still held, so the KV computed afterwards is exact, its full blocks are
registered in the prefix cache as usual, and a released block that was registered stays there as a
free, evictable hit until its block is reused (`BlockPool.free`). A sequence of such a group then
holds at most `max_live_blocks` blocks between steps, whatever its length.
"""

from __future__ import annotations

from kvpage.core.block_pool import BlockPool
from kvpage.core.block_table import HOLE, BlockTable
from kvpage.core.invariants import check
from kvpage.core.kv_spec import FullAttention, LayerSpec, max_live_blocks, num_releasable


def release_behind(table: BlockTable, spec: LayerSpec, num_computed: int, pool: BlockPool) -> list[int]:
    """Release the table's blocks no query after its first `num_computed` tokens reads (oldest
    first into the free queue); returns their ids. Nothing for full attention or a swapped table."""
    if isinstance(spec, FullAttention) or table.on_cpu:
        return []
    upto = min(num_releasable(spec, num_computed, pool.block_size), len(table.block_ids))
    freed = [b for b in table.block_ids[table.released : upto] if b is not HOLE]
    for i in range(table.released, upto):
        table.block_ids[i] = HOLE
    table.released = max(table.released, upto)
    for b in freed:  # oldest first: the free queue hands out the oldest cached blocks first
        pool.decref(pool.blocks[b])
    return freed


def check_window(seq_id, table: BlockTable, spec: LayerSpec, num_computed: int, block_size: int) -> None:
    """Between steps: the table released what its first `num_computed` tokens let it, and holds no
    more blocks than the spec's bound for the tokens it has slots for beyond them."""
    if isinstance(spec, FullAttention):
        check(not table.released, lambda: f"{seq_id}: a full-attention table with released blocks")
        return
    if table.on_cpu:
        return
    upto = min(num_releasable(spec, num_computed, block_size), len(table.block_ids))
    check(table.released >= upto, lambda: f"{seq_id}: holds blocks its window no longer reads")
    bound = max_live_blocks(spec, block_size, max(1, table.num_tokens - num_computed))
    held = len(table.block_ids) - table.num_holes
    check(held <= bound, lambda: f"{seq_id}: {held} blocks held, over the window's bound of {bound}")  # type: ignore[operator]
