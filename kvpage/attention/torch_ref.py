"""The reference attention backend: pure torch, runs everywhere, tested in CI.

Decodes are attended as one batch: their keys are gathered through the block tables into a
[num_decodes, max_len] view (in a reused workspace) and masked past each sequence's length.
Each prefill chunk is attended on its own (no padding to the longest chunk); a chunk with no
earlier context uses its fresh K/V directly with a causal mask, one with cached context gathers
its keys and masks by position. Grouped-query attention never repeats K/V in memory.
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

    def __init__(self) -> None:
        # Gathered decode keys/values land in buffers reused by every layer and step: allocating
        # ~100 MB afresh per layer costs more in page faults than the attention itself.
        self._workspace: dict[str, torch.Tensor] = {}

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

    def _gather(self, name: str, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """cache[blocks] into a reused buffer: [len(blocks), block_size, kv_heads, head_dim]."""
        shape = (blocks.numel(), *cache.shape[1:])
        buf = self._workspace.get(name)
        if (
            buf is None
            or buf.dtype != cache.dtype
            or buf.device != cache.device
            or buf.numel() < cache[0].numel() * shape[0]
        ):
            buf = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            self._workspace[name] = buf
        out = buf.view(-1)[: cache[0].numel() * shape[0]].view(shape)
        return torch.index_select(cache, 0, blocks, out=out)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd, bs = meta.num_decodes, meta.block_size
        kv_heads, d = k_cache.shape[2], k_cache.shape[3]
        max_len = max(meta.seq_lens_list[:nd])
        blocks = meta.block_tables[:nd, : -(-max_len // bs)].reshape(-1)
        keys = self._gather("k", k_cache, blocks).view(nd, -1, kv_heads, d)[:, :max_len]  # [nd, L, kvh, d]
        values = self._gather("v", v_cache, blocks).view(nd, -1, kv_heads, d)[:, :max_len]
        valid = torch.arange(max_len, device=q.device)[None, :] < meta.seq_lens[:nd, None]  # [nd, L]
        if q.dtype == torch.float32:
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True,
            )  # fmt: skip
            return o.squeeze(2)
        # Half precision: torch's CPU SDPA is slow here, so attend per kv head with the query heads of
        # its group stacked (no K/V repeat), softmax in float32.
        group = q.shape[1] // kv_heads
        qg = q.view(nd, kv_heads, group, d)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float().mul_(scale)  # [nd, kvh, group, L]
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1).to(q.dtype)
        return torch.matmul(probs, values.permute(0, 2, 1, 3)).reshape(nd, -1, d)
