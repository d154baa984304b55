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
cached context gathers its keys and masks by position. A quantized cache (int8 / fp8) is quantized
as it is written and dequantized as it is gathered, in float32 then the compute dtype.

Which path reads a sequence is backend.read_path's to say. A sequence with demoted blocks (DEMOTED;
demoted.py) is attended explicitly, decode or chunk alike (`_explicit`): its demoted blocks join its
table's keys ahead of them, unmasked (all precede its queries). H2O's attention mass (MASS;
meta.reads.mass) comes from here: decodes sum the probabilities they compute anyway per block; a
prefill chunk that wants it is attended with explicit scores instead of the fused SDPA, which does
not return them. A decode within a read budget (BOUNDED) reads the blocks key_bounds.py chooses.

A layer that soft-caps its scores (Gemma 2: `kv.softcap` = c, scores = c tanh(scores / c) before the
mask) is read on the explicit paths, its prefill chunks too. A sliding-window layer (`kv.window` = W;
WINDOWED) masks every key W or more positions behind its query, and a chunked one (`kv.chunk` = C,
Llama 4) every key before its query's chunk, as transformers does, on the dense code
(`LayerKV.first_key`); positions in the table serve, since what the window or chunk released is whole
leading blocks (core/layer_window.py). A decode group's mask is made once per step and shared by the
layers of one window or chunk. A layer with sinks (gpt-oss: `kv.sinks`, a logit per query head) adds
each head's sink to its softmax as one more score that no value answers (`_with_sinks`), on the explicit
paths too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpage.attention import key_bounds
from kvpage.attention.backend import BOUNDED, DEMOTED, MASS, decodes_path, read_path
from kvpage.attention.demoted import demoted_kv
from kvpage.attention.kv_quant import dequantize, quantize
from kvpage.attention.layer_kv import LayerKV
from kvpage.attention.metadata import AttentionMetadata
from kvpage.core.block import cdiv


def write_kv(k: torch.Tensor, v: torch.Tensor, kv: LayerKV, slots: torch.Tensor) -> None:
    """Store each token's K/V ([tokens, kv_heads, head_dim]) at its slot (quantized, if the cache is)."""
    block_size = kv.k.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    if kv.quantized:
        for x, values, scales in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
            q, s = quantize(x, kv.kv_dtype)
            values[blocks, :, offsets] = q
            scales[blocks, :, offsets] = s
        return
    kv.k[blocks, :, offsets] = k
    kv.v[blocks, :, offsets] = v


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, scales: torch.Tensor | None = None, dtype=None
) -> torch.Tensor:
    """The first `length` keys (or values) of one sequence, head-major: [kv_heads, length, head_dim];
    with `scales`, dequantized to `dtype`."""
    num_blocks = cdiv(length, cache.shape[2])
    table = block_table[:num_blocks]
    out = cache[table].transpose(0, 1).flatten(1, 2)[:, :length]  # [kv_heads, length, d]
    if scales is None:
        return out
    return dequantize(out, scales[table].transpose(0, 1).flatten(1, 2)[:, :length], dtype)


def _with_sinks(logits: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension of `logits` with one more logit per row, its head's sink (`sinks`
    broadcast to logits' shape but the last dimension, which is 1), whose probability is dropped."""
    sink = sinks.float().expand(*logits.shape[:-1], 1)
    return torch.cat((logits, sink), dim=-1).softmax(-1)[..., :-1]


class TorchReferenceBackend:
    name = "torch"
    fuses_decode = False  # the runner may run a pure decode step in one compiled call (worker/fused_decode.py)

    def __init__(self) -> None:
        # Gathered decode keys/values land in buffers reused by every layer, head and step:
        # allocating ~100 MB afresh each time costs more in page faults than the attention itself.
        self._workspace: dict[str, torch.Tensor] = {}
        # the step's decode-group biases with the keys before a window or chunk masked, made by the first layer
        # that reads them: (meta, (window, chunk), biases)
        self._local_biases: tuple[AttentionMetadata | None, tuple, dict[int, torch.Tensor]] = (None, (), {})

    @staticmethod
    def allocate_kv(num_blocks, num_kv_heads, block_size, head_dim, dtype, kv_dtype, device, pin=False) -> LayerKV:
        """The reference layout: [num_blocks, num_kv_heads, block_size, head_dim] (the CPU kernels read it too)."""
        return LayerKV.allocate((num_blocks, num_kv_heads, block_size, head_dim), dtype, kv_dtype, device, pin)

    def forward(self, q, k, v, kv: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write(k, v, kv, meta.slot_mapping)
        if kv.bounded:
            self.refresh_bounds(kv, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.num_decodes:
            self.decodes(out, q, kv, meta, scale)
        self.prefills(out, q, k, v, kv, meta, scale)
        return out

    def write(self, k, v, kv: LayerKV, slots) -> None:
        write_kv(k, v, kv, slots)

    def refresh_bounds(self, kv: LayerKV, slots) -> None:
        """The key bounds of the blocks the step wrote (a layer that keeps them: key_bounds.py)."""
        key_bounds.refresh_bounds(kv, slots)

    def decodes(self, out, q, kv: LayerKV, meta: AttentionMetadata, scale: float) -> None:
        """out[:num_decodes] = attention of the first num_decodes queries (one token each)."""
        path = decodes_path(meta, kv.bounded)
        if path == BOUNDED:
            return self._decodes_within_budget(out, q, kv, meta, scale)
        if path == DEMOTED:  # some decode reads demoted blocks: one at a time
            for i in range(meta.num_decodes):
                self._explicit(out[i : i + 1], q[i : i + 1], None, None, kv, meta, i, scale)
            return
        for g, (rows, max_len, bias) in enumerate(meta.decode_groups):
            bias = self._local(g, bias, rows, kv, meta) if kv.local else bias
            out[rows] = self._decode_group(q[rows], rows, max_len, bias, kv, meta, scale)

    def _decodes_within_budget(self, out, q, kv: LayerKV, meta: AttentionMetadata, scale: float) -> None:
        """Each decode over the blocks its read budget chooses, per kv head (key_bounds.py): the
        reference the compiled kernel is tested against, one sequence at a time.

        A decode whose budget covers its sequence reads everything by the dense path's own code: its
        decode group is attended exactly as without a budget (same rows, same shapes, so the same
        GEMM kernels and summation order on any CPU), and only the rows a budget restricts are then
        attended over their chosen blocks. A second formula for the full read would agree only to
        the rounding, and which rounding depends on the BLAS kernel the CPU picks (Zen 4 and
        Sapphire Rapids pick differently)."""
        bs, kv_heads = meta.block_size, kv.k.shape[1]
        group = q.shape[1] // kv_heads
        restricted = [read_path(meta, i, True) == BOUNDED for i in range(meta.num_decodes)]
        for rows, max_len, bias in meta.decode_groups:
            if not all(restricted[r] for r in rows.tolist()):
                out[rows] = self._decode_group(q[rows], rows, max_len, bias, kv, meta, scale)
        for i in range(meta.num_decodes):
            if not restricted[i]:
                continue
            n, table = meta.seq_lens_list[i], meta.block_tables[i]
            qi = q[i].float() * scale  # [heads, d]
            chosen = key_bounds.choose_blocks(qi, kv, table, n, int(meta.reads.budgets[i]))  # type: ignore[index]
            for h in range(kv_heads):
                j = chosen[h]
                blocks = table[j]
                pos = (j[:, None] * bs + torch.arange(bs, device=q.device)[None]).reshape(-1)
                keys = kv.k[blocks, h].reshape(-1, kv.k.shape[3])
                values = kv.v[blocks, h].reshape(-1, kv.v.shape[3])
                if kv.quantized:
                    keys = dequantize(keys, kv.k_scale[blocks, h].reshape(-1), torch.float32)
                    values = dequantize(values, kv.v_scale[blocks, h].reshape(-1), torch.float32)
                keys, values = keys.float()[pos < n], values.float()[pos < n]
                probs = (qi[h * group : (h + 1) * group] @ keys.T).softmax(-1)  # [group, len]
                out[i, h * group : (h + 1) * group] = (probs @ values).to(out.dtype)

    def prefills(self, out, q, k, v, kv: LayerKV, meta: AttentionMetadata, scale: float) -> None:
        """Each prefill chunk on its own, after the decodes (its K/V already written)."""
        starts = meta.query_start_loc
        for i in range(meta.num_decodes, meta.num_seqs):
            s, e = starts[i], starts[i + 1]
            self.prefill_chunk(out[s:e], q[s:e], k[s:e], v[s:e], kv, meta, i, scale)

    def prefill_chunk(self, out, q, k, v, kv: LayerKV, meta: AttentionMetadata, i: int, scale: float) -> None:
        """out = attention of the chunk's queries (sequence i, its last len(q) positions)."""
        n = meta.seq_lens_list[i]
        # (a soft cap, sinks: scores made explicit)
        if kv.softcap or kv.sinks is not None or read_path(meta, i, kv.bounded) in (MASS, DEMOTED):
            return self._explicit(out, q, k, v, kv, meta, i, scale)
        # 4-D inputs ([1, heads, tokens, d]): torch's fused CPU kernel takes those, and is 3-4x
        # faster than the generic path that 3-D inputs fall back to.
        qi = q.transpose(0, 1)[None]
        # no earlier context, and no key outside a window or chunk: its own K/V are all the keys
        if q.shape[0] == n and not (kv.local and n > kv.reach):
            ki, vi = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            table = meta.block_tables[i]
            ki = gather_kv(kv.k, table, n, kv.k_scale, q.dtype)[None]
            vi = gather_kv(kv.v, table, n, kv.v_scale, q.dtype)[None]
            pos_q = torch.arange(n - q.shape[0], n, device=q.device)
            mask = torch.arange(n, device=q.device)[None, :] <= pos_q[:, None]  # [q, n]
            if kv.local:
                mask &= torch.arange(n, device=q.device)[None, :] >= kv.first_key(pos_q)[:, None]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        out.copy_(o[0].transpose(0, 1))

    def _explicit(self, out, q, k, v, kv: LayerKV, meta: AttentionMetadata, i: int, scale: float) -> None:
        """Explicit attention of sequence i's queries (a prefill chunk, or one decode with k = v = None)
        over its demoted blocks, if any, then its table's keys; each block's softmax mass is added to
        its read plan's when it wants it."""
        m, n, bs = q.shape[0], meta.seq_lens_list[i], meta.block_size
        if m == n and k is not None:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, n, d]
        else:  # (a decode, even a sequence's first token: the step wrote its K/V already)
            table = meta.block_tables[i]
            keys = gather_kv(kv.k, table, n, kv.k_scale, q.dtype)
            values = gather_kv(kv.v, table, n, kv.v_scale, q.dtype)
        cold = meta.reads.demoted_of(i)
        if cold:
            ck, cv = demoted_kv(kv, cold, q.dtype)
            keys, values = torch.cat((ck, keys), 1), torch.cat((cv, values), 1)
        c = len(cold) * bs  # the demoted keys come first, visible to every query
        kv_heads, d = keys.shape[0], keys.shape[2]
        group = q.shape[1] // kv_heads
        qh = q.view(m, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * m, d)
        scores = torch.bmm(qh, keys.transpose(1, 2)).float().mul_(scale).view(kv_heads, group, m, c + n)
        if kv.softcap:
            scores = torch.tanh(scores / kv.softcap).mul_(kv.softcap)
        visible = torch.arange(-c, n, device=q.device)[None, :] <= torch.arange(n - m, n, device=q.device)[:, None]
        if kv.local:
            first = kv.first_key(torch.arange(n - m, n, device=q.device))
            visible &= torch.arange(-c, n, device=q.device)[None, :] >= first[:, None]
        scores = scores.masked_fill_(~visible, float("-inf"))
        probs = scores.softmax(-1) if kv.sinks is None else _with_sinks(scores, kv.sinks.view(kv_heads, group, 1, 1))
        if meta.reads.wants_mass(i):
            nb = cdiv(n, bs)
            per_token = probs.sum((0, 1, 2))
            table_mass = F.pad(per_token[c:], (0, nb * bs - n)).view(nb, bs).sum(-1)
            meta.reads.add_mass(i, table_mass, per_token[:c].view(len(cold), bs).sum(-1) if cold else None)
        o = torch.bmm(probs.view(kv_heads, group * m, c + n).to(q.dtype), values)
        out.copy_(o.view(kv_heads, group, m, d).permute(2, 0, 1, 3).reshape(m, -1, d))

    def _local(self, g: int, bias: torch.Tensor, rows: torch.Tensor, kv: LayerKV, meta: AttentionMetadata):
        """Decode group g's bias with the keys before the window or chunk masked too, made once per step."""
        step, reach, made = self._local_biases
        if step is not meta or reach != (kv.window, kv.chunk):
            made = {}
            self._local_biases = (meta, (kv.window, kv.chunk), made)
        if g not in made:
            lens = torch.tensor([meta.seq_lens_list[r] for r in rows.tolist()], device=bias.device)
            keys = torch.arange(bias.shape[-1], device=bias.device)[None, None, :]
            made[g] = bias.masked_fill(keys < kv.first_key(lens - 1)[:, None, None], float("-inf"))
        return made[g]

    def _gather(self, name: str, cache_head: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """cache_head[blocks] ([num_blocks, bs, d] view of one kv head) into a reused, contiguous buffer."""
        numel = blocks.numel() * cache_head[0].numel()
        buf = self._workspace.get(name)
        if buf is None or buf.dtype != cache_head.dtype or buf.device != cache_head.device or buf.numel() < numel:
            buf = torch.empty(numel, dtype=cache_head.dtype, device=cache_head.device)
            self._workspace[name] = buf
        out = buf[:numel].view(blocks.numel(), *cache_head.shape[1:])
        return torch.index_select(cache_head, 0, blocks, out=out)

    def _decode_group(self, q, rows, max_len, bias, kv: LayerKV, meta: AttentionMetadata, scale: float):
        n, bs = rows.numel(), meta.block_size
        kv_heads, d = kv.k.shape[1], kv.k.shape[3]
        nb = cdiv(max_len, bs)
        blocks = meta.block_tables[rows, :nb].reshape(-1)
        group = q.shape[1] // kv_heads
        qg = q.view(n, kv_heads, group, d)
        out = torch.empty(n, kv_heads, group, d, dtype=q.dtype, device=q.device)
        for h in range(kv_heads):
            keys = self._gather("k", kv.k[:, h], blocks).view(n, nb * bs, d)
            values = self._gather("v", kv.v[:, h], blocks).view(n, nb * bs, d)
            if kv.quantized:
                keys = dequantize(keys, kv.k_scale[:, h][blocks].view(n, nb * bs), q.dtype)
                values = dequantize(values, kv.v_scale[:, h][blocks].view(n, nb * bs), q.dtype)
            scores = torch.bmm(qg[:, h], keys.transpose(1, 2)).float()  # [n, group, L]
            if kv.softcap:
                logits = bias + torch.tanh(scores * (scale / kv.softcap)) * kv.softcap
            else:
                logits = torch.add(bias, scores, alpha=scale)  # bias masks the padding
            if kv.sinks is None:
                probs = logits.softmax(-1)
            else:
                probs = _with_sinks(logits, kv.sinks[h * group : (h + 1) * group].view(1, group, 1))
            if meta.reads.mass is not None:  # H2O: each block's share of the softmax
                meta.reads.mass[:, :nb].index_add_(0, rows, probs.sum(1).view(n, nb, bs).sum(-1))
            out[:, h] = torch.bmm(probs.to(q.dtype), values)
        return out.view(n, -1, d)
