"""The per-layer elementwise math of a LLaMA block, two ways: plain torch, and kvpage's CPU kernels.

    rms_norm(x, w, eps)                 -> h
    add_rms_norm(x, delta, w, eps)      -> (x + delta, rms_norm(x + delta))
    qkv_rope(qkv, cos, sin, H, KVH, D)  -> q [T,H,D], k [T,KVH,D], v [T,KVH,D], q and k rotated
    silu_mul(gate_up)                   -> silu(gate) * up
    linear(x, w, bias=None)             -> x @ w.T + bias

`TorchLayerOps` is the reference: the arithmetic of Hugging Face's LlamaForCausalLM, op by op.
`KernelLayerOps` does each line in one compiled call (kvpage/ops/csrc/cpu_ops.cpp), in float32
inside; at batch 1 the ~25 small torch ops of a layer cost more than its matmuls' memory traffic
leaves room for. It updates x and rotates q/k in place, and falls back to the reference for dtypes
the kernels do not cover (float16).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpage.cpu_kind import kind_of
from kvpage.models.dtype_choice import cpu_flags, cpu_has_native_bf16
from kvpage.models.weight_quant import QuantizedWeight
from kvpage.ops import KERNEL_DTYPES


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; rotate the two halves of each head (the Hugging Face layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# Up to how many rows of x kvpage's linear kernels beat torch's GEMM depends on the CPU, so the
# dispatch is a table chosen from its flags. The kernels stream each weight row once for up to 4 rows
# of x, 8 floats wide (AVX2); the quantized one reads 1.06 or 0.63 bytes per weight instead of 4 or 2.
# Measured (SmolLM2-135M's linears and lm_head, 2 cores):
#   AVX2, no native bf16 (AMD EPYC): float32 1.8x torch at 1 row, 1.2x at 64, 0.7x at 256; bfloat16
#     4-6x torch at every size (torch emulates bfloat16 there); quantized float32 wins up to 64 rows.
#   AVX-512 + AVX512_BF16 without AMX (AMD EPYC Zen 5, kind avx512_bf16): torch's float32 GEMM runs
#     2.8x slower than the kernel at 1 row, 1.4x at 32-64, 1.14x at 128 (one stream float32: 26 -> 60
#     tokens/s with the kernel), so the kernel takes float32 up to 128 rows there.
#   AVX-512 + AMX (Sapphire Rapids): torch's float32 GEMM (16 wide) ties at 1 row (wins 1.3x on the
#     lm_head) and wins above; torch's bfloat16 GEMM runs on AMX tiles with a ~60-100 us floor per
#     call: the kernel (VDPBF16PS there) wins at 1-4 rows (2.2-4x at 1), torch from 6 (27x at 256);
#     the quantized kernel (either dtype) wins up to 16 rows, dequantize + GEMM above.
#     Re-measured 2026-12-03 with benchmarks/linear_policy.py, all 30 layers' weights from memory
#     rather than one layer's from cache: bfloat16 kernel 1.6x torch at 1 row, a tie at 3, torch
#     ahead from 4 (21 vs 19 ms a pass): the bound is 3 on this kind; quantized 16 holds (int4 ties
#     torch at 24 float32 rows).
#   AVX-512 + AVX512_BF16 without AMX, AMD EPYC Zen 4 (kind avx512_bf16), 2026-12-07, after the row kernels
#     read one weight row at a time (benchmarks/linear_policy.py, weights from memory): the bfloat16 kernel
#     no slower than torch's GEMM up to 24 rows in one run (18.6 vs 22.9 ms a pass at 16, a tie at 32) and up
#     to 64 in the next: the bound was 4, it is 24. Quantized bfloat16 measured 8 and 16 (int4), 12 and 12
#     (int8) in the two runs: left at 16. Float32 keeps Zen 5's 128 (here: 24, 32). 16 concurrent bfloat16
#     streams, bound 24 against 4 alternated in one run: 453 vs 443 tokens/s.
UNLIMITED = 1 << 62


def gemm_rows(rows: int) -> int:
    """The row count a bfloat16 GEMM of `rows` rows is padded to: a multiple of 16 up to 128, then
    eight sizes per doubling (at most 1/8 of the rows padding).

    oneDNN builds a primitive for every new row count of a bfloat16 GEMM (~5 ms on Sapphire Rapids)
    and keeps it: ~0.8 MB each in its cache, ~0.27 MB for good. A server's steps have any number of
    rows, so unpadded every prompt of a new length cost 1.6 MB and a step's delay, without bound
    (measured: 81 new lengths +160 MB). Padded, SmolLM2's five shapes have at most ~45 sizes each."""
    if rows <= 128:
        return -(-rows // 16) * 16
    step = 1 << ((rows - 1).bit_length() - 4)  # 1/8 of the doubling rows lies in
    return -(-rows // step) * step


@dataclass(frozen=True, slots=True)
class LinearPolicy:
    """The most rows of x for which the kernels run, per activation dtype; torch's GEMM above."""

    plain: dict[torch.dtype, int]
    quantized: dict[torch.dtype, int]
    # one row of x summed in the order of several (the row kernel's one-row loop is ~15% faster in its
    # own order): set by deterministic mode, where a row's bits must not depend on its company
    one_order: bool = False

    @staticmethod
    def for_cpu(flags: set[str] | None = None) -> LinearPolicy:
        flags = cpu_flags() if flags is None else flags  # under KVPAGE_CPU_KIND, that kind's flags
        avx512, native_bf16 = "avx512f" in flags, cpu_has_native_bf16(flags)
        kind = kind_of(flags)
        f32 = 128 if kind == "avx512_bf16" else 0 if avx512 else 64
        bf16 = {"amx": 3, "avx512_bf16": 24}.get(kind, 4) if native_bf16 else UNLIMITED
        return LinearPolicy(
            plain={torch.float32: f32, torch.bfloat16: bf16},
            quantized={torch.float32: 16 if avx512 else 64, torch.bfloat16: 16 if native_bf16 else UNLIMITED},
        )

    @staticmethod
    def batch_invariant() -> LinearPolicy:
        """Every row through the row kernels, each output summed in one order whatever the number of
        rows; torch's GEMM picks its blocking by the number of rows (deterministic mode)."""
        return dataclasses.replace(LinearPolicy.always_kernel(), one_order=True)

    @staticmethod
    def always_kernel() -> LinearPolicy:  # tests of the kernels themselves
        every = dict.fromkeys(KERNEL_DTYPES, UNLIMITED)
        return LinearPolicy(plain=every, quantized=dict(every))


class TorchLayerOps:
    name = "torch"

    def rms_norm(self, x, weight, eps):
        return rms_norm_ref(x, weight, eps)

    def add_rms_norm(self, x, delta, weight, eps):
        x = x + delta
        return x, rms_norm_ref(x, weight, eps)

    def qkv_rope(self, qkv, cos, sin, heads, kv_heads, head_dim):
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = apply_rope(q.view(-1, heads, head_dim), cos, sin)
        k = apply_rope(k.view(-1, kv_heads, head_dim), cos, sin)
        return q, k, v.view(-1, kv_heads, head_dim)

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up):  # Gemma's GeGLU (gelu_pytorch_tanh); the torch path on every kind
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def linear(self, x, weight, bias=None):
        if isinstance(weight, QuantizedWeight):  # slow but exact: widen the whole weight each call
            return F.linear(x, weight.dequantize().to(x.dtype), bias)
        return F.linear(x, weight, bias)


class KernelLayerOps(TorchLayerOps):
    name = "cpu"

    def __init__(self, policy: LinearPolicy | None = None) -> None:
        self._k = torch.ops.kvpage
        self.policy = policy or LinearPolicy.for_cpu()

    def rms_norm(self, x, weight, eps):
        if x.dtype not in KERNEL_DTYPES:
            return super().rms_norm(x, weight, eps)
        return self._k.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, delta, weight, eps):
        if x.dtype not in KERNEL_DTYPES:
            return super().add_rms_norm(x, delta, weight, eps)
        return x, self._k.add_rms_norm(x, delta, weight, eps)  # x += delta in place

    def qkv_rope(self, qkv, cos, sin, heads, kv_heads, head_dim):
        if qkv.dtype not in KERNEL_DTYPES:
            return super().qkv_rope(qkv, cos, sin, heads, kv_heads, head_dim)
        self._k.rope_(qkv, cos, sin, heads + kv_heads, head_dim)
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        q = qkv[:, :q_size].view(-1, heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(-1, kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(-1, kv_heads, head_dim)
        return q, k, v

    def silu_mul(self, gate_up):
        if gate_up.dtype not in KERNEL_DTYPES:
            return super().silu_mul(gate_up)
        return self._k.silu_mul(gate_up)

    def linear(self, x, weight, bias=None):
        rows = x.shape[0]
        if x.dtype not in KERNEL_DTYPES:
            return super().linear(x, weight, bias)
        if isinstance(weight, QuantizedWeight):
            if rows > self.policy.quantized[x.dtype]:  # compute-bound: torch's GEMM on the widened weight
                w = self._k.dequantize_weight(weight.q, weight.scales, weight.mins, weight.bits).to(x.dtype)
                return _gemm(x, w, None if bias is None else bias.to(x.dtype))
            b = None if bias is None else bias.float()
            return self._k.linear_quant(x.contiguous(), weight.q, weight.scales, weight.mins, weight.bits, b)
        ours = 0 < rows <= self.policy.plain[x.dtype]
        if ours and weight.dtype == x.dtype and x.stride(-1) == 1:
            return self._k.linear_rows(x, weight, bias, self.policy.one_order)
        return _gemm(x, weight, bias)


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """torch's GEMM; bfloat16 rows padded to `gemm_rows` (each row's result is its own)."""
    rows = x.shape[0]
    padded = gemm_rows(rows) if x.dtype == torch.bfloat16 and x.dim() == 2 else rows
    if padded == rows:
        return F.linear(x, weight, bias)
    xp = x.new_empty(padded, x.shape[1])
    xp[:rows].copy_(x)
    xp[rows:].zero_()
    return F.linear(xp, weight, bias)[:rows]
