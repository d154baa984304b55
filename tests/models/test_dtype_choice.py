"""`dtype="auto"`: bfloat16 only where the CPU computes it natively, float32 elsewhere."""

from __future__ import annotations

import pytest
import torch

from kvpage.config import EngineConfig
from kvpage.models import choose_dtype
from kvpage.models.dtype_choice import cpu_flags, cpu_has_native_bf16

X86_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
X86_AVX512_NO_BF16 = "flags\t\t: avx2 avx512f avx512bw avx512vl avx512dq avx512_vnni\n"
X86_SAPPHIRE = "flags\t\t: avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile\n"
ARM64_BF16 = "Features\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(
    ("cpuinfo", "native"), [(X86_AVX2, False), (X86_AVX512_NO_BF16, False), (X86_SAPPHIRE, True), (ARM64_BF16, True),
                            ("", False)]
)  # fmt: skip
def test_native_bf16_comes_from_the_cpu_flags(cpuinfo, native):
    flags = cpu_flags(cpuinfo)
    assert cpu_has_native_bf16(flags) is native
    name, why = choose_dtype("auto", "cpu", flags)
    assert name == ("bfloat16" if native else "float32")
    assert why.startswith("auto: this CPU ") and torch.backends.cpu.get_cpu_capability() in why


def test_an_explicit_dtype_is_kept_and_cuda_gets_bfloat16():
    assert choose_dtype("float32", "cpu", {"avx512_bf16"}) == ("float32", "as asked")
    assert choose_dtype("bfloat16", "cpu", set()) == ("bfloat16", "as asked")
    assert choose_dtype(torch.float16, "cpu") == ("float16", "as asked")
    assert choose_dtype("auto", "cuda") == ("bfloat16", "auto: a CUDA device")


def test_auto_is_the_default_and_a_wrong_dtype_names_the_field():
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ValueError, match="^dtype must be auto, float32, bfloat16 or float16; got 'int3'$"):
        EngineConfig(dtype="int3")


def test_the_engine_runs_in_the_dtype_auto_picks_for_this_machine():
    from kvpage import LLM

    llm = LLM("smollm2", num_kv_blocks=8)  # the default dtype
    engine = llm.llm_engine
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert engine.dtype_name == expected and engine.dtype_reason.startswith("auto: ")
    assert next(engine.runner.model.parameters()).dtype == getattr(torch, expected)
    assert engine.kv_cache.layers[0].k.dtype == getattr(torch, expected)
