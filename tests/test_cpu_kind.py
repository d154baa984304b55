"""KVPAGE_CPU_KIND: which kind of CPU the kernels, LinearPolicy and dtype="auto" are chosen for."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvpage import cpu_kind
from kvpage.models import choose_dtype
from kvpage.models.layer_ops import UNLIMITED, LinearPolicy

HASWELL = {"sse2", "avx", "avx2", "fma"}
SKYLAKE_X = HASWELL | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
ZEN4 = SKYLAKE_X | {"avx512_bf16", "avx512_vbmi2"}
SAPPHIRE = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8"}


@pytest.mark.parametrize(("flags", "kind"), [(set(), "generic"), ({"avx2"}, "generic"), (HASWELL, "avx2"),
                                             (SKYLAKE_X, "avx512"), (ZEN4, "avx512_bf16"), (SAPPHIRE, "amx"),
                                             ({"avx512_bf16", "amx_bf16", "amx_tile"}, "generic")])  # fmt: skip
def test_the_kind_is_the_highest_whose_flags_and_the_lower_kinds_flags_are_all_there(flags, kind):
    assert cpu_kind.kind_of(flags) == kind


def test_an_emulated_kind_hides_every_flag_of_the_kinds_above_it():
    assert cpu_kind.effective(SAPPHIRE, None) == ("amx", SAPPHIRE)
    assert cpu_kind.effective(SAPPHIRE, "amx") == ("amx", SAPPHIRE)
    assert cpu_kind.effective(SAPPHIRE, "avx512_bf16") == ("avx512_bf16", ZEN4)
    assert cpu_kind.effective(SAPPHIRE, "avx512") == ("avx512", SKYLAKE_X | {"avx512_vbmi2"})
    assert cpu_kind.effective(ZEN4, "avx2") == ("avx2", HASWELL)
    assert cpu_kind.effective(ZEN4, "generic") == ("generic", {"sse2", "avx"})


def test_a_kind_the_cpu_cannot_execute_or_an_unknown_name_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match=r"^KVPAGE_CPU_KIND=amx asks for more than this CPU can execute \(it is of "
                                         r"kind 'avx512_bf16'\)$"):  # fmt: skip
        cpu_kind.effective(ZEN4, "amx")
    with pytest.raises(ValueError, match="^KVPAGE_CPU_KIND='zen4' is not a CPU kind; choose one of generic, avx2, "):
        cpu_kind.requested({"KVPAGE_CPU_KIND": "zen4"})
    assert cpu_kind.requested({"KVPAGE_CPU_KIND": " AVX2 "}) == "avx2"
    assert cpu_kind.requested({"KVPAGE_CPU_KIND": ""}) is None and cpu_kind.requested({}) is None


# the flags a real machine of each kind shows (/proc/cpuinfo, the ones -march lets the compiler emit)
REAL_HASWELL = HASWELL | {"bmi1", "bmi2", "movbe", "f16c", "abm", "popcnt"}
REAL_ZEN4 = ZEN4 | REAL_HASWELL | {"avx512cd", "adx", "avx512vbmi", "gfni", "vaes"}
REAL_SAPPHIRE = SAPPHIRE | REAL_ZEN4 | {"avx512_fp16", "avx512_bitalg", "avx512_vpopcntdq", "avx512ifma",
                                        "vpclmulqdq", "avx_vnni"}  # fmt: skip


def test_each_kind_builds_for_its_own_cpu_and_points_torch_at_it():
    # a machine of a kind builds for that kind's CPU, as its emulation on a higher machine does
    assert cpu_kind.march(REAL_ZEN4, None) == cpu_kind.march(REAL_SAPPHIRE, "avx512_bf16") == "cooperlake"
    assert cpu_kind.march(REAL_SAPPHIRE, None) == cpu_kind.march(REAL_SAPPHIRE, "amx") == "sapphirerapids"
    assert cpu_kind.march(REAL_HASWELL, None) == cpu_kind.march(REAL_ZEN4, "avx2") == "haswell"
    assert [cpu_kind.march(SAPPHIRE, k) for k in ("avx512_bf16", "avx512", "avx2", "generic")] == [
        "cooperlake", "skylake-avx512", "haswell", "x86-64-v2"]  # fmt: skip
    # a machine without a flag its kind's CPU implies (a VM hiding bmi2, say) builds for itself
    assert cpu_kind.march(SAPPHIRE, None) == cpu_kind.march(HASWELL, "avx2") == "native"
    assert cpu_kind.march(REAL_ZEN4 - {"bmi2"}, None) == "native" and cpu_kind.march(set(), None) == "native"
    assert cpu_kind.torch_env("avx2") == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                          "MKL_ENABLE_INSTRUCTIONS": "AVX2"}  # fmt: skip
    assert cpu_kind.torch_env("avx512_bf16")["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    assert cpu_kind.runnable_kinds(SAPPHIRE) == ["avx2", "avx512", "avx512_bf16", "amx"]
    assert cpu_kind.runnable_kinds(HASWELL) == ["avx2"] and cpu_kind.runnable_kinds(set()) == ["generic"]


@pytest.mark.parametrize(("flags", "plain_f32", "plain_bf16", "auto"), [
    (HASWELL, 64, UNLIMITED, "float32"), (SKYLAKE_X, 0, UNLIMITED, "float32"), (ZEN4, 128, 24, "bfloat16"),
    (SAPPHIRE, 0, 3, "bfloat16")])  # fmt: skip
def test_each_kinds_flags_give_its_linear_policy_and_auto_dtype(flags, plain_f32, plain_bf16, auto):
    policy = LinearPolicy.for_cpu(flags)
    assert (policy.plain[torch.float32], policy.plain[torch.bfloat16]) == (plain_f32, plain_bf16)
    assert choose_dtype("auto", "cpu", flags)[0] == auto


def _in_fresh_process(kind: str, code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in cpu_kind.torch_env("avx2")}
    env["KVPAGE_CPU_KIND"] = kind
    prelude = "import kvpage\n"  # applies KVPAGE_CPU_KIND before torch starts
    proc = subprocess.run([sys.executable, "-c", prelude + code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_under_the_override_this_process_takes_the_lower_kinds_choices_end_to_end():
    """On this machine, every kind below its own: the kernels' -march, torch's dispatch, the policy, auto."""
    native = cpu_kind.kind_of(cpu_kind.read_flags())
    lower = cpu_kind.runnable_kinds()[:-1]
    if not lower:
        pytest.skip(f"this machine is of kind {native}: nothing below it to emulate")
    kind = lower[0]
    code = (
        "import torch\nfrom kvpage.ops.build import build_flags\nfrom kvpage.models import choose_dtype\n"
        "from kvpage.models.layer_ops import LinearPolicy\n"
        "print(build_flags()[0], torch.backends.cpu.get_cpu_capability(), choose_dtype('auto')[0],"
        " LinearPolicy.for_cpu().plain[torch.float32])"
    )
    expected_policy = LinearPolicy.for_cpu(cpu_kind.effective(cpu_kind.read_flags(), kind)[1]).plain[torch.float32]
    assert _in_fresh_process(kind, code).split() == [
        f"-march={cpu_kind.march(cpu_kind.read_flags(), kind)}", kind.upper() if kind == "avx2" else "AVX512",
        "float32", str(expected_policy)]  # fmt: skip
    env = {**os.environ, "KVPAGE_CPU_KIND": "nope"}
    code = "from kvpage import cpu_kind; cpu_kind.machine()"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "KVPAGE_CPU_KIND='nope' is not a CPU kind" in bad.stderr
