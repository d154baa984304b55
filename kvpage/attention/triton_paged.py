"""The `triton` attention backend: paged attention in Triton kernels (triton_kernels.py), for CUDA.

The K/V write by slot mapping, decode attention (flash-decoding splits along the context when few
sequences would leave the GPU idle) and prefill chunks with or without cached context all read the
cache in place through the block tables, in the reference layout, so every other part of kvpage
(copy-on-write, swap, the CPU tier, eviction) is unchanged. Softmax in float32.

Chosen by `attention_backend="triton"`, and by "auto" on a CUDA device where triton imports. On a
machine without a GPU it runs only under Triton's interpreter (TRITON_INTERPRET=1, on CPU tensors):
slow, and exactly how the tests check it. What the kernels do not cover goes to the reference path
it inherits: fp8 caches and H2O's attention mass. Prefill matmuls run in bfloat16 on the tensor
cores for a bfloat16 model (float32 sums), in IEEE float32 for a float32 one and in the interpreter
(whose bfloat16 matmul is not arithmetic on the values).
"""

from __future__ import annotations

import contextlib
import os

import torch

from kvpage.attention.backend import DENSE, decodes_path, read_path
from kvpage.attention.layer_kv import LayerKV
from kvpage.attention.metadata import AttentionMetadata
from kvpage.attention.torch_ref import TorchReferenceBackend
from kvpage.core.block import cdiv

BLOCK_N = 32  # keys per loop step
BLOCK_M = 16  # prefill queries per program
SPLIT_TARGET = 512  # about this many keys per split of a long decode
MIN_PROGRAMS = 256  # fewer (sequence x kv head) programs than this: split long contexts


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(device: str | torch.device) -> str | None:
    """Why the backend cannot run on `device` here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install triton)"
    device = torch.device(device)
    if device.type != "cuda" and not interpreted():
        return "off CUDA the Triton kernels run only under TRITON_INTERPRET=1 (Triton's interpreter, for tests)"
    if device.type == "cuda" and not interpreted() and torch.cuda.get_device_capability(device) < (8, 0):
        return "the kernels' bfloat16 matmuls need a GPU of compute capability 8.0 or newer"
    return None


def _on(device: torch.device):
    """Triton launches on the thread's current CUDA device: make it the tensors' (cuda:N, any thread)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonPagedBackend(TorchReferenceBackend):
    name = "triton"

    def __init__(self, device: str | torch.device = "cuda") -> None:
        super().__init__()
        why = unavailable_reason(device)
        if why:
            raise RuntimeError(f"the 'triton' attention backend cannot run here: {why}")
        from kvpage.attention import triton_kernels

        self._k = triton_kernels
        self.splits: int | None = None  # fixed number of decode splits (tests); None: chosen per step

    def forward(self, q, k, v, kv: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        with _on(q.device):  # every launch of the step on the tensors' GPU
            return super().forward(q, k, v, kv, meta, scale)

    def write(self, k, v, kv: LayerKV, slots) -> None:
        if not _covered(kv) or k.shape[0] == 0:
            return super().write(k, v, kv, slots)
        num_kv_heads, block_size, d = kv.k.shape[1:]
        self._k.write_kv[(k.shape[0], num_kv_heads)](
            k, v, kv.k, kv.v, *_scales(kv), slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            KVH=num_kv_heads, BS=block_size, D=d, DP=_pow2(d), INT8=kv.quantized,
        )  # fmt: skip

    def decodes(self, out, q, kv: LayerKV, meta: AttentionMetadata, scale: float) -> None:
        if not _covered(kv) or decodes_path(meta, kv.bounded, kv.shaped) != DENSE:  # (a budget, a window: reference)
            return super().decodes(out, q, kv, meta, scale)
        n = meta.num_decodes
        num_kv_heads, block_size, d = kv.k.shape[1:]
        heads = q.shape[1]
        group = heads // num_kv_heads
        longest = max(meta.seq_lens_list[:n])
        splits = self.splits or self._choose_splits(n * num_kv_heads, longest)
        split_len = cdiv(longest, splits)
        dp = _pow2(d)
        if splits > 1:
            acc = torch.empty(n, heads, splits, dp, dtype=torch.float32, device=q.device)
            ml = torch.empty(n, heads, splits, 2, dtype=torch.float32, device=q.device)
        else:
            acc = ml = out  # unused
        self._k.decode[(n, num_kv_heads, splits)](
            q, kv.k, kv.v, *_scales(kv), meta.block_tables, meta.seq_lens, out, acc, ml,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0), scale, split_len,
            G=group, GP=_pow2(group), KVH=num_kv_heads, BS=block_size, D=d, DP=dp,
            BLOCK_N=BLOCK_N, SPLITS=splits, INT8=kv.quantized,
        )  # fmt: skip
        if splits > 1:
            self._k.combine[(n, heads)](
                acc, ml, out, out.stride(0), out.stride(1), H=heads, D=d, DP=dp, SPLITS=splits, SP=_pow2(splits)
            )

    def prefills(self, out, q, k, v, kv: LayerKV, meta: AttentionMetadata, scale: float) -> None:
        first, count = meta.num_decodes, meta.num_seqs - meta.num_decodes
        if count == 0:
            return
        dense = all(read_path(meta, i, kv.bounded, kv.shaped) == DENSE for i in range(first, meta.num_seqs))
        if not _covered(kv) or not dense:
            return super().prefills(out, q, k, v, kv, meta, scale)
        num_kv_heads, block_size, d = kv.k.shape[1:]
        heads = q.shape[1]
        starts = meta.query_start_loc
        longest = max(starts[i + 1] - starts[i] for i in range(first, meta.num_seqs))
        self._k.prefill[(count, heads, cdiv(longest, BLOCK_M))](
            q, k, v, kv.k, kv.v, *_scales(kv), meta.block_tables, meta.seq_lens, meta.query_start_tensor, out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), meta.block_tables.stride(0), scale, first,
            G=heads // num_kv_heads, KVH=num_kv_heads, BS=block_size, D=d, DP=max(16, _pow2(d)),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, INT8=kv.quantized, IEEE=q.dtype == torch.float32 or interpreted(),
        )  # fmt: skip

    @staticmethod
    def _choose_splits(programs: int, longest: int) -> int:
        """Enough splits along the context that few long sequences still fill the device."""
        if programs >= MIN_PROGRAMS or longest <= SPLIT_TARGET:
            return 1
        return min(cdiv(longest, SPLIT_TARGET), cdiv(MIN_PROGRAMS, programs), 64)


def _scales(kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' scale pointers: the int8 scales, or (unread) the values themselves."""
    return (kv.k_scale, kv.v_scale) if kv.quantized else (kv.k, kv.v)


def _covered(kv: LayerKV) -> bool:
    """The kernels read caches in the model's dtype and int8 ones; fp8 takes the reference path."""
    return kv.kv_dtype != "fp8"
