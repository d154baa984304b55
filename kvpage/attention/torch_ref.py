"""The reference attention backend: pure torch, runs everywhere, tested in CI.

Decodes are attended as one batch: their keys are gathered through the block tables into a
[num_decodes, max_len] view and masked past each sequence's length. Each prefill chunk is attended
on its own (no padding to the longest chunk); a chunk with no earlier context uses its fresh K/V
directly with a causal mask, one with cached context gathers its keys and masks by position.
Grouped-query attention never repeats K/V: scaled_dot_product_attention broadcasts the kv heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpage.attention.metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """Store each token's K/V at its slot (slot = block_id * block_size + offset)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` keys (or values) of one sequence: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


class TorchReferenceBackend:
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        starts, lens = meta.query_start_loc, meta.seq_lens_list
        for i in range(nd, meta.num_seqs):
            s, e, n = starts[i], starts[i + 1], lens[i]
            qi = q[s:e].transpose(0, 1)  # [heads, q, d]
            if e - s == n:  # no earlier context: the chunk's own K/V are all the keys
                ki, vi = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:
                ki = gather_kv(k_cache, meta.block_tables[i], n).transpose(0, 1)
                vi = gather_kv(v_cache, meta.block_tables[i], n).transpose(0, 1)
                pos_q = torch.arange(n - (e - s), n, device=q.device)
                mask = torch.arange(n, device=q.device)[None, :] <= pos_q[:, None]  # [q, n]
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
            out[s:e] = o.transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd, bs = meta.num_decodes, meta.block_size
        max_len = max(meta.seq_lens_list[:nd])
        tables = meta.block_tables[:nd, : -(-max_len // bs)]
        keys = k_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [nd, kv_heads, max_len, d]
        values = v_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
        mask = torch.arange(max_len, device=q.device)[None, :] < meta.seq_lens[:nd, None]  # [nd, max_len]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )  # [nd, heads, 1, d]
        return o.squeeze(2)
