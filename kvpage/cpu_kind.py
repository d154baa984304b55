"""The kind of CPU kvpage chooses its kernels and policies for: this machine's, or an older kind it can run.

The machines kvpage meets come in a few x86 kinds, each able to run everything the kinds left of it run:

    generic  <  avx2  <  avx512  <  avx512_bf16  <  amx
    (no AVX2)   Haswell+ AVX-512F    + AVX512_BF16   + AMX tiles (Sapphire Rapids)
                Zen 1-3  Skylake-X   Zen 4/5, Cooper Lake

Three things differ by kind: how the compiled kernels are built (-march), `LinearPolicy` (which rows
go to our kernels, which to torch's GEMM) and `dtype="auto"` (bfloat16 only with native BF16). The
environment variable KVPAGE_CPU_KIND=<kind> makes all three take that kind's choices on a machine of a
higher kind, so one machine can run the other kinds' paths; a kind the CPU cannot execute is refused.
torch's own kernels are pointed at the same kind (`torch_env`: ATen's dispatch, oneDNN, MKL), which
must happen before torch starts: `import kvpage` calls `apply_torch_env()` (so do the CLI, the
benchmarks and the test suite, which import kvpage before torch) and warns when torch came first.

No torch here: the flags come from /proc/cpuinfo, so `kvpage.ops.build` and the tests read them cheaply.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path

KINDS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
ENV = "KVPAGE_CPU_KIND"

# What each kind adds over the one before it (flags as /proc/cpuinfo spells them); a kind's emulation
# hides the flags of every kind above it.
_ADDS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f"},
    "avx512_bf16": {"avx512_bf16"},
    "amx": {"amx_bf16", "amx_tile"},
}
_MARCH = {"avx2": "haswell", "avx512": "skylake-avx512", "avx512_bf16": "cooperlake", "amx": "sapphirerapids"}
# The flags each -march lets the compiler emit on its own (scalar bit tricks, vector ISA), cumulative
# with the kinds below: a machine of a kind builds for its kind's -march only when it has them all,
# so a real Zen 4 and an AMX machine emulating avx512_bf16 compile the very same kernels.
_MARCH_NEEDS = {
    "avx2": {"avx2", "fma", "bmi1", "bmi2", "movbe", "f16c", "abm", "popcnt"},
    "avx512": {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "adx"},
    "avx512_bf16": {"avx512_vnni", "avx512_bf16"},
    "amx": {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16", "avx512vbmi", "avx512_vbmi2", "avx512_bitalg",
            "avx512_vpopcntdq", "avx512ifma", "gfni", "vaes", "vpclmulqdq", "avx_vnni"},
}  # fmt: skip
# torch's own dispatch for each emulated kind (ATen has default / avx2 / avx512 on x86)
_TORCH = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "avx512_bf16": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },  # fmt: skip
}


def read_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from `cpuinfo`, or from /proc/cpuinfo (x86 "flags", arm64 "Features";
    read once per process); empty elsewhere."""
    if cpuinfo is None:
        return set(_proc_flags())
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


@functools.cache
def _proc_flags() -> frozenset[str]:
    try:
        return frozenset(read_flags(Path("/proc/cpuinfo").read_text()))
    except OSError:
        return frozenset()


def kind_of(flags: set[str]) -> str:
    """The highest kind whose flags (and every lower kind's) the set has."""
    kind = "generic"
    for name in KINDS[1:]:
        if not _ADDS[name] <= flags:
            break
        kind = name
    return kind


def requested(environ: dict[str, str] | None = None) -> str | None:
    """KVPAGE_CPU_KIND, checked by name; None when unset or empty."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in KINDS:
        raise ValueError(f"{ENV}={value!r} is not a CPU kind; choose one of {', '.join(KINDS)}")
    return value


def effective(flags: set[str], kind: str | None) -> tuple[str, set[str]]:
    """(kind, flags) the choices are made for: the machine's, or `kind` with the higher kinds' flags hidden."""
    native = kind_of(flags)
    if kind is None or kind == native:
        return native, set(flags)
    if KINDS.index(kind) > KINDS.index(native):
        raise ValueError(f"{ENV}={kind} asks for more than this CPU can execute (it is of kind {native!r})")
    hidden = set().union(*(_ADDS[k] for k in KINDS[KINDS.index(kind) + 1 :]))
    # every flag of the higher kinds' families goes too (avx512_vnni, amx_int8, ...), not just the ones named
    prefixes = ("amx",) + (("avx512",) if KINDS.index(kind) < KINDS.index("avx512") else ())
    kept = {f for f in flags if f not in hidden and not f.startswith(prefixes)}
    return kind, kept


def machine() -> tuple[str, set[str]]:
    """This process's (kind, flags): the machine's, under KVPAGE_CPU_KIND when it is set."""
    return effective(read_flags(), requested())


def march(flags: set[str], kind: str | None) -> str:
    """The compiler's -march for the kernels: the kind's CPU, on a machine of that kind as under its
    emulation; native on the machine's own kind when it lacks a flag that CPU implies (or is below avx2)."""
    chosen, _ = effective(flags, kind)
    if chosen == kind_of(flags):
        needs = set().union(*(_MARCH_NEEDS[k] for k in KINDS[1 : KINDS.index(chosen) + 1]))
        return _MARCH[chosen] if chosen in _MARCH and needs <= flags else "native"
    return _MARCH.get(chosen, "x86-64-v2")


def torch_env(kind: str) -> dict[str, str]:
    """The variables that point torch's own kernels (ATen's dispatch, oneDNN, MKL) at `kind`."""
    return dict(_TORCH.get(kind, {}))


def apply_torch_env() -> str | None:
    """Under KVPAGE_CPU_KIND, set torch's variables (unless already set); call before torch starts."""
    kind = requested()
    if kind is None:
        return None
    flags = read_flags()
    chosen, _ = effective(flags, kind)  # refuses a kind the CPU cannot run, before anything else happens
    if chosen != kind_of(flags):
        if "torch" in sys.modules:
            why = "so torch's own kernels keep this machine's kind (kvpage's take the one asked for)"
            warnings.warn(f"{ENV}={kind}: torch was imported before kvpage, {why}", stacklevel=2)
        for name, value in torch_env(kind).items():
            os.environ.setdefault(name, value)
    return kind


def runnable_kinds(flags: set[str] | None = None) -> list[str]:
    """The kinds this machine can run, from avx2 up to its own (its own alone when below avx2)."""
    native = kind_of(read_flags() if flags is None else flags)
    return list(KINDS[1 : KINDS.index(native) + 1]) or [native]
