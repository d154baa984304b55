"""The CPU paged backend: compiled kernels (kvpage/ops/csrc/cpu_ops.cpp) for the K/V write and decodes.

Decodes read K and V in place through the block tables: one task per (sequence, kv head) loads each
key once for all query heads of its group and keeps an online softmax in float32, so nothing is
gathered or padded (the reference backend copies every decode's context into a workspace and then
reads it again). Prefill chunks are compute-bound and stay on torch's fused SDPA (the reference
path). Chosen by `attention_backend="auto"` on the CPU wherever the kernels build; the reference
backend remains the fallback, and says so once.
"""

from __future__ import annotations

import torch

from kvpage.attention.metadata import AttentionMetadata
from kvpage.attention.torch_ref import TorchReferenceBackend
from kvpage.ops import KERNEL_DTYPES, load, unavailable_reason


class CpuPagedBackend(TorchReferenceBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        if not load():
            raise RuntimeError(f"the 'cpu' attention backend needs kvpage's CPU kernels: {unavailable_reason()}")
        self._decode = torch.ops.kvpage.paged_decode_attention
        self._write = torch.ops.kvpage.write_kv

    def write(self, k, v, k_cache, v_cache, slots) -> None:
        if k_cache.dtype not in KERNEL_DTYPES:
            return super().write(k, v, k_cache, v_cache, slots)
        self._write(k, v, k_cache, v_cache, slots)

    def decodes(self, out, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> None:
        if k_cache.dtype not in KERNEL_DTYPES:
            return super().decodes(out, q, k_cache, v_cache, meta, scale)
        n = meta.num_decodes
        self._decode(out[:n], q[:n], k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
