"""Compiles kvpage's CPU kernels (csrc/cpu_ops.cpp) once per machine and loads them as torch.ops.kvpage.*.

The library is built with the system C++ compiler against the installed torch's headers, for this
CPU (-march=native; under KVPAGE_CPU_KIND the named kind's -march, kvpage/cpu_kind.py), into
~/.cache/kvpage/ops/<key>/ (KVPAGE_CACHE_DIR overrides ~/.cache/kvpage); the key covers the source,
torch's version, the CPU's flags and the build flags, so a change of any rebuilds it.
A build takes ~15-30 s the first time and nothing afterwards. Where no compiler is found or the build
fails, `load()` returns False and says why once; callers then keep to the pure-torch reference.
Set KVPAGE_CPU_KERNELS=0 to never build or load them.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings
from pathlib import Path

import torch

from kvpage import cpu_kind

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels compute; other dtypes take the torch path
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "why": str


def cache_root() -> Path:
    return Path(os.environ.get("KVPAGE_CACHE_DIR", Path.home() / ".cache" / "kvpage"))


# -ffp-contract=off: no fused multiply-adds where the source has a multiply then an add, so the
# elementwise ops (RoPE, SiLU) round as torch's do, step by step. -fopenmp: at::parallel_for is a
# header template that splits work with `#pragma omp parallel` (torch's CPU build is OpenMP); without
# it the kernels run on one thread. The libgomp.so.1 torch loads is the one that runs them.
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-w"]


def build_flags() -> list[str]:
    """The compiler flags: -march for this process's CPU kind, then the fixed ones."""
    return [f"-march={cpu_kind.march(cpu_kind.read_flags(), cpu_kind.requested())}", *_FLAGS]


def _key(cxx: str) -> str:
    h = hashlib.sha256()
    flags = " ".join(sorted(cpu_kind.read_flags())) or platform.processor()
    for part in (_SOURCE.read_bytes(), torch.__version__, flags, cxx, sys.version, " ".join(build_flags())):
        h.update(part if isinstance(part, bytes) else part.encode())
    return h.hexdigest()[:16]


def _compile(cxx: str, out: Path) -> None:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [cxx, *build_flags()]
    cmd += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_EXTENSION_NAME=kvpage_cpu_ops"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd += [f"-I{sysconfig.get_paths()['include']}", str(_SOURCE), "-o", str(tmp)]
    cmd += [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cxx} failed:\n{proc.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: a concurrent process never loads a half-written library


def load() -> bool:
    """Build (first time) and load the kernels; True when torch.ops.kvpage.* are usable."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok, why = False, ""
        if os.environ.get("KVPAGE_CPU_KERNELS", "1") == "0":
            why = "disabled by KVPAGE_CPU_KERNELS=0"
        elif not (cxx := os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
            why = "no C++ compiler found (install g++ or set CXX)"
        else:
            lib = cache_root() / "ops" / _key(cxx) / "kvpage_cpu_ops.so"
            try:
                if not lib.exists():
                    lib.parent.mkdir(parents=True, exist_ok=True)
                    _compile(cxx, lib)
                torch.ops.load_library(str(lib))
                ok = True
            except Exception as e:  # noqa: BLE001 - any failure means: use the reference path
                why = f"build or load failed: {e}"
        _state.update(ok=ok, why=why)
        if not ok:
            warnings.warn(f"kvpage CPU kernels unavailable ({why}); using the pure-torch reference", stacklevel=2)
        return ok


def unavailable_reason() -> str:
    return str(_state.get("why", ""))
