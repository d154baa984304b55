"""The reference attention backend: pure torch, runs everywhere, tested in CI.

Cache layout, per layer and for K and V alike: [num_blocks, num_kv_heads, block_size, head_dim].
Head-major inside a block means that gathering one kv head's blocks for a batch of sequences
(`index_select` over the block dimension) yields [sequences, length, head_dim] matrices that are
contiguous, which batched matmul reads in place; the token-major layout forced a second copy of
every gathered key and value.

    slot s = block_id * block_size + offset   ->   cache[block_id, :, offset, :]

Decodes are attended in groups of similar length (see AttentionMetadata.decode_groups), one kv head
at a time with the query heads of its group stacked, so K/V are never repeated for grouped-query
attention; softmax runs in float32. Each prefill chunk is attended on its own (no padding to the
longest chunk): a chunk with no earlier context uses its fresh K/V with a causal mask, one with
cached context gathers its keys and masks by position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpage.attention.metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """Store each token's K/V ([tokens, kv_heads, head_dim]) at its slot."""
    block_size = k_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = k
    v_cache[blocks, :, offsets] = v


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` keys (or values) of one sequence, head-major: [kv_heads, length, head_dim]."""
    num_blocks = -(-length // cache.shape[2])
    blocks = cache[block_table[:num_blocks]]  # [nb, kv_heads, bs, d]
    return blocks.transpose(0, 1).flatten(1, 2)[:, :length]


class TorchReferenceBackend:
    name = "torch"

    def __init__(self) -> None:
        # Gathered decode keys/values land in buffers reused by every layer, head and step:
        # allocating ~100 MB afresh each time costs more in page faults than the attention itself.
        self._workspace: dict[str, torch.Tensor] = {}

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.num_decodes:
            self.decodes(out, q, k_cache, v_cache, meta, scale)
        self.prefills(out, q, k, v, k_cache, v_cache, meta, scale)
        return out

    def write(self, k, v, k_cache, v_cache, slots) -> None:
        write_kv(k, v, k_cache, v_cache, slots)

    def decodes(self, out, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> None:
        """out[:num_decodes] = attention of the first num_decodes queries (one token each)."""
        for rows, max_len, bias in meta.decode_groups:
            out[rows] = self._decode_group(q[rows], rows, max_len, bias, k_cache, v_cache, meta, scale)

    def prefills(self, out, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> None:
        """Each prefill chunk on its own, after the decodes (its K/V already written)."""
        starts = meta.query_start_loc
        for i in range(meta.num_decodes, meta.num_seqs):
            s, e = starts[i], starts[i + 1]
            self.prefill_chunk(out[s:e], q[s:e], k[s:e], v[s:e], k_cache, v_cache, meta, i, scale)

    def prefill_chunk(self, out, q, k, v, k_cache, v_cache, meta: AttentionMetadata, i: int, scale: float) -> None:
        """out = attention of the chunk's queries (sequence i, its last len(q) positions)."""
        n = meta.seq_lens_list[i]
        # 4-D inputs ([1, heads, tokens, d]): torch's fused CPU kernel takes those, and is 3-4x
        # faster than the generic path that 3-D inputs fall back to.
        qi = q.transpose(0, 1)[None]
        if q.shape[0] == n:  # no earlier context: the chunk's own K/V are all the keys
            ki, vi = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ki = gather_kv(k_cache, meta.block_tables[i], n)[None]
            vi = gather_kv(v_cache, meta.block_tables[i], n)[None]
            pos_q = torch.arange(n - q.shape[0], n, device=q.device)
            mask = torch.arange(n, device=q.device)[None, :] <= pos_q[:, None]  # [q, n]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        out.copy_(o[0].transpose(0, 1))

    def _gather(self, name: str, cache_head: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """cache_head[blocks] ([num_blocks, bs, d] view of one kv head) into a reused, contiguous buffer."""
        numel = blocks.numel() * cache_head[0].numel()
        buf = self._workspace.get(name)
        if buf is None or buf.dtype != cache_head.dtype or buf.device != cache_head.device or buf.numel() < numel:
            buf = torch.empty(numel, dtype=cache_head.dtype, device=cache_head.device)
            self._workspace[name] = buf
        out = buf[:numel].view(blocks.numel(), *cache_head.shape[1:])
        return torch.index_select(cache_head, 0, blocks, out=out)

    def _decode_group(self, q, rows, max_len, bias, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        n, bs = rows.numel(), meta.block_size
        kv_heads, d = k_cache.shape[1], k_cache.shape[3]
        nb = -(-max_len // bs)
        blocks = meta.block_tables[rows, :nb].reshape(-1)
        group = q.shape[1] // kv_heads
        qg = q.view(n, kv_heads, group, d)
        out = torch.empty(n, kv_heads, group, d, dtype=q.dtype, device=q.device)
        for h in range(kv_heads):
            keys = self._gather("k", k_cache[:, h], blocks).view(n, nb * bs, d)
            values = self._gather("v", v_cache[:, h], blocks).view(n, nb * bs, d)
            scores = torch.bmm(qg[:, h], keys.transpose(1, 2)).float()  # [n, group, L]
            probs = torch.add(bias, scores, alpha=scale).softmax(-1).to(q.dtype)  # bias masks the padding
            out[:, h] = torch.bmm(probs, values)
        return out.view(n, -1, d)
