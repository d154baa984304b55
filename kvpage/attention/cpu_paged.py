"""The CPU paged backend: compiled kernels (kvpage/ops/csrc/cpu_ops.cpp) for the K/V write and decodes.

Decodes read K and V in place through the block tables: one task per (sequence, kv head) loads each
key once for all query heads of its group and keeps an online softmax in float32, so nothing is
gathered or padded (the reference backend copies every decode's context into a workspace and then
reads it again). Prefill chunks of 16 queries or more, and fresh prompts, run the prefill kernel
where the build has it (float32 on AVX-512, bfloat16 with AVX512_BF16: paged_prefill_attention, 16
queries a task, one a register lane, each K/V block read once for them; bfloat16 about 2x faster than
torch's SDPA on fresh prompts of up to 512 tokens, and than gathering the context of a chunk after a
cached prefix, 2-core Zen 4). A shorter chunk after cached context (the tail of a prompt whose prefix
hit the cache, a small chunked-prefill step) runs each query as a decode whose length stops at its
own position, in place through the block table; the rest stays on SDPA (the reference path).
An int8 cache is read the same way, each block widened times its tokens' scales as it is loaded
(and written quantized by the kernel, byte for byte as kv_quant.py does).
Chosen by `attention_backend="auto"` on the CPU wherever the kernels build; the reference backend
remains the fallback, and says so once.
"""

from __future__ import annotations

import torch

from kvpage.attention.backend import BOUNDED, DENSE, decodes_path, read_path
from kvpage.attention.key_bounds import RECENT_BLOCKS, SINK_BLOCKS
from kvpage.attention.layer_kv import LayerKV
from kvpage.attention.metadata import AttentionMetadata
from kvpage.attention.torch_ref import TorchReferenceBackend
from kvpage.ops import KERNEL_DTYPES, load, unavailable_reason

# A chunk of up to this many queries after cached context runs as that many decodes: each reads
# the context once, where the reference gathers it into a copy first (SDPA wins on long chunks).
SHORT_CHUNK = 16
# A chunk of at least this many queries (or a whole fresh prompt) runs the prefill kernel where it applies:
# below, most of its 16 lanes would be idle, and a chunk after context runs faster as decodes.
PREFILL_KERNEL_ROWS = 16


class CpuPagedBackend(TorchReferenceBackend):
    name = "cpu"
    fuses_decode = True  # the runner may run a pure decode step in one compiled call (worker/fused_decode.py)

    def __init__(self) -> None:
        super().__init__()
        # Prefill chunks after cached context of up to this many queries run as decodes; None: every
        # chunk, with context or without (the batch-invariant mode: each query then attends its keys
        # in one order, from the cache, whatever the chunking, the batch or the prefix hits).
        self.decode_chunks_up_to: int | None = SHORT_CHUNK
        if not load():
            raise RuntimeError(f"the 'cpu' attention backend needs kvpage's CPU kernels: {unavailable_reason()}")
        ops = torch.ops.kvpage
        self._decode, self._decode_int8 = ops.paged_decode_attention, ops.paged_decode_attention_int8
        self._prefill, self._prefill_available = ops.paged_prefill_attention, ops.paged_prefill_available
        self._prefill_ok: dict[tuple, bool] = {}  # (q dtype, cache dtype, head_dim, block_size) -> the kernel takes it
        self._write, self._write_int8 = ops.write_kv, ops.write_kv_int8
        self._bounds = ops.refresh_key_bounds

    def write(self, k, v, kv: LayerKV, slots) -> None:
        if not _kernel_reads(kv, k.dtype):
            return super().write(k, v, kv, slots)
        if kv.quantized:
            self._write_int8(k, v, kv.k, kv.v, kv.k_scale, kv.v_scale, slots)
        else:
            self._write(k, v, kv.k, kv.v, slots)

    def refresh_bounds(self, kv: LayerKV, slots) -> None:
        if kv.kv_dtype == "fp8" or (not kv.quantized and kv.k.dtype not in KERNEL_DTYPES):
            return super().refresh_bounds(kv, slots)
        self._bounds(kv.k, kv.k_scale, kv.k_min, kv.k_max, slots)

    def decodes(self, out, q, kv: LayerKV, meta: AttentionMetadata, scale: float) -> None:
        path = decodes_path(meta, kv.bounded, kv.shaped)
        if not _kernel_reads(kv, q.dtype) or path not in (DENSE, BOUNDED):  # H2O's mass, demoted blocks, a window
            return super().decodes(out, q, kv, meta, scale)
        n = meta.num_decodes
        budget = (kv.k_min, kv.k_max, meta.reads.budgets) if path == BOUNDED else ()
        self._decode_in_place(out[:n], q[:n], kv, meta.block_tables, meta.seq_lens, scale, *budget)

    def prefill_chunk(self, out, q, k, v, kv: LayerKV, meta: AttentionMetadata, i: int, scale: float) -> None:
        m, n = q.shape[0], meta.seq_lens_list[i]
        limit = self.decode_chunks_up_to
        if not _kernel_reads(kv, q.dtype) or read_path(meta, i, kv.bounded, kv.shaped) != DENSE:
            return super().prefill_chunk(out, q, k, v, kv, meta, i, scale)
        if limit is not None and (m >= PREFILL_KERNEL_ROWS or m == n) and self._prefill_applies(q, kv):
            return self._prefill(out, q, kv.k, kv.v, meta.block_tables[i], n, scale)  # (its keys are written)
        if not (limit is None or (m < n and m <= limit)):
            return super().prefill_chunk(out, q, k, v, kv, meta, i, scale)
        # query r sits at position n - m + r and sees the keys 0 .. n - m + r: a decode of that length
        tables = meta.block_tables[i : i + 1].expand(m, -1)
        lens = torch.arange(n - m + 1, n + 1, dtype=torch.int64, device=q.device)
        self._decode_in_place(out, q, kv, tables, lens, scale)

    def _prefill_applies(self, q, kv: LayerKV) -> bool:
        """Whether this build's prefill kernel takes q over this cache (asked of the kernels once per shape)."""
        key = (q.dtype, kv.k.dtype, q.shape[-1], kv.k.shape[2])
        if key not in self._prefill_ok:
            self._prefill_ok[key] = bool(self._prefill_available(q, kv.k))
        return self._prefill_ok[key]

    def _decode_in_place(self, out, q, kv: LayerKV, tables, lens, scale: float, *budget) -> None:
        """`budget`: (k_min, k_max, blocks each reads) for decodes within a read budget (key_bounds.py)."""
        select = (*budget, SINK_BLOCKS, RECENT_BLOCKS) if budget else ()
        if kv.quantized:
            self._decode_int8(out, q, kv.k, kv.v, kv.k_scale, kv.v_scale, tables, lens, scale, *select)
        else:
            self._decode(out, q, kv.k, kv.v, tables, lens, scale, *select)


def _kernel_reads(kv: LayerKV, dtype: torch.dtype) -> bool:
    """The kernels take float32 / bfloat16 queries over a cache of the same dtype or of int8 (with its
    scales); fp8 caches take the reference path."""
    if dtype not in KERNEL_DTYPES:
        return False
    return kv.kv_dtype == "int8" if kv.quantized else kv.k.dtype == dtype
