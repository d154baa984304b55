"""A read budget for decode attention: per-block key bounds, and the blocks a query reads (Quest).

Quest (arXiv 2406.10774) keeps, per block and kv head, the elementwise min and max of the block's
keys. For a query q, b = sum_d max(q_d * min_d, q_d * max_d) bounds q . k from above for every key k
of the block, so a decode can read only the blocks whose bound is highest. kvpage does it per
(sequence, kv head), the task its decode kernel already runs. With grouped-query attention several
query heads share the kv head, so a block's score is sum over those heads g of exp(b_g - max b_g):
the most head g's softmax could give the block against its best one, added over the heads (on
SmolLM2 at 8k and a 512-token budget, perplexity 12.65 against 13.03 for the max of the raw bounds
and 12.94 for their sum; the full read 11.78). It reads, in table order:

    table:  [ b0 | b1 b2 b3 b4 b5 b6 b7 b8 b9 | b10 b11 ]      12 blocks, read_blocks = 6
             sink   top 3 of b1..b9 by bound     recent
    read:   [ b0 |    b3       b6 b8          | b10 b11 ]

Nothing is freed or moved: the block table, prefix caching, sharing, beams and swapping are those of
a full read, and a budget at or above the sequence's blocks reads everything. The first
`DENSE_LAYERS` layers always read everything (as Quest does) and keep no bounds.

The bounds live in the layer's cache (`LayerKV.k_min` / `k_max`, [num_blocks, kv_heads, head_dim]
float32) so every move of a block carries them. Each write of a block recomputes its bounds over all
of its slots (`refresh_bounds`): once a block is full they are exact, whatever order its slots were
written, copied or rotated in; the last, partial block is always among the recent ones.
"""

from __future__ import annotations

import torch

from kvpage.attention.kv_quant import dequantize
from kvpage.errors import ParameterError

SINK_BLOCKS = 1  # the first block of every sequence is always read (StreamingLLM's attention sink)
RECENT_BLOCKS = 2  # and its last two (the block being written and the one before it)
DENSE_LAYERS = 2  # layers read in full, which keep no bounds
MIN_READ_BLOCKS = SINK_BLOCKS + RECENT_BLOCKS + 1  # a budget reads at least one block by its bound


def min_budget(block_size: int) -> int:
    """The smallest read budget (tokens) that chooses any block by its bound."""
    return MIN_READ_BLOCKS * block_size


def check_budget(budget: int, block_size: int) -> None:
    """ParameterError naming kv_read_budget unless a (non-zero) budget reaches `min_budget`."""
    if budget < (lowest := min_budget(block_size)):
        why = f"the first block, the last {RECENT_BLOCKS} and one chosen, of {block_size} tokens"
        raise ParameterError("kv_read_budget", f"kv_read_budget must be at least {lowest} tokens ({why}), got {budget}")


def read_blocks(budget: int | None, block_size: int) -> int:
    """Blocks a decode with this budget (tokens; None or 0: no budget) reads: 0 for all of them."""
    return 0 if not budget else budget // block_size


def refresh_bounds(kv, slots: torch.Tensor) -> None:
    """Recompute k_min / k_max of every block these slots fall in, over all of the block's slots."""
    bs = kv.k.shape[2]
    blocks = torch.unique(slots // bs)
    keys = kv.k[blocks]  # [n, kv_heads, bs, d]
    keys = dequantize(keys, kv.k_scale[blocks], torch.float32) if kv.quantized else keys.float()
    kv.k_min[blocks] = keys.amin(dim=2)
    kv.k_max[blocks] = keys.amax(dim=2)


def quest_bound(terms: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in the compiled kernel's order (16 running sums, lane i taking
    d = i mod 16, then added in lane order), so the reference chooses the kernel's blocks bit for bit."""
    lanes = torch.nn.functional.pad(terms, (0, -terms.shape[-1] % 16)).unflatten(-1, (-1, 16))
    acc = lanes[..., 0, :]
    for c in range(1, lanes.shape[-2]):
        acc = acc + lanes[..., c, :]
    total = acc[..., 0]
    for i in range(1, 16):
        total = total + acc[..., i]
    return total


def choose_blocks(q: torch.Tensor, kv, table: torch.Tensor, length: int, budget_blocks: int) -> list[torch.Tensor]:
    """The table indices one decode reads, per kv head (ascending int64 tensors): all of them when the
    budget covers the sequence, else the sink, the top blocks by Quest's bound, and the recent ones.
    q: [num_heads, head_dim], already times the softmax scale; table: the sequence's block ids."""
    bs, kv_heads = kv.k.shape[2], kv.k.shape[1]
    nb = -(-length // bs)
    every = torch.arange(nb, device=table.device)
    if budget_blocks <= 0 or budget_blocks >= nb:
        return [every] * kv_heads
    sink = min(SINK_BLOCKS, nb)
    first_recent = max(sink, nb - RECENT_BLOCKS)
    top = max(0, budget_blocks - sink - (nb - first_recent))
    middle = table[sink:first_recent]
    qg = q.float().view(kv_heads, -1, q.shape[-1])  # [kv_heads, group, d]
    out = []
    for h in range(kv_heads):
        lo, hi = kv.k_min[middle, h], kv.k_max[middle, h]  # [m, d]
        bound = quest_bound(torch.maximum(qg[h][:, None] * lo[None], qg[h][:, None] * hi[None]))  # [group, m]
        weight = (bound - bound.amax(1, keepdim=True)).exp()
        score = weight[0]
        for g in range(1, weight.shape[0]):  # (added head by head, as the kernel adds them)
            score = score + weight[g]
        order = torch.sort(-score, stable=True).indices[:top]  # ties: the earlier block
        chosen = torch.sort(order + sink).values
        out.append(torch.cat([every[:sink], chosen, every[first_recent:]]))
    return out
