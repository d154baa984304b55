"""`dtype="auto"`: bfloat16 only where the hardware computes it natively, float32 elsewhere.

On a CPU without native bfloat16 (AVX2 only, or AVX-512 without the BF16 extension) torch's bfloat16
matmuls are emulated and several times slower than float32 (measured on an AVX2 machine: ~20 GFLOP/s
against ~137), so "auto" picks float32 there; with AVX512_BF16 / AMX (x86) or FEAT_BF16 (arm64,
"bf16" in /proc/cpuinfo) it picks bfloat16, which halves memory traffic. CUDA devices get bfloat16.
"""

from __future__ import annotations

import torch

from kvpage.cpu_kind import machine, read_flags

_NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """Feature flags: parsed from `cpuinfo`, or this machine's as KVPAGE_CPU_KIND lets kvpage see them."""
    return read_flags(cpuinfo) if cpuinfo is not None else machine()[1]


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool:
    return bool((cpu_flags() if flags is None else flags) & _NATIVE_BF16_FLAGS)


def choose_dtype(dtype: str | torch.dtype, device: str = "cpu", flags: set[str] | None = None) -> tuple[str, str]:
    """(dtype name, why): "auto" resolved for this machine; any other name is kept as asked."""
    if dtype != "auto":
        return (str(dtype).removeprefix("torch."), "as asked")
    if torch.device(device).type == "cuda":
        return "bfloat16", "auto: a CUDA device"
    capability = torch.backends.cpu.get_cpu_capability()
    if flags is None:
        kind, flags = machine()
        capability += f", kvpage kind {kind}"
    if cpu_has_native_bf16(flags):
        return "bfloat16", f"auto: this CPU computes bfloat16 natively ({capability} with BF16)"
    return "float32", f"auto: this CPU has no native bfloat16 ({capability}), where float32 is faster"
