"""Shared plumbing of the benchmark scripts: machine description, JSON output, RESULTS.md entries."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "out"
RESULTS = ROOT / "RESULTS.md"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {cpu_capability()}, {platform.system()} {platform.release()}"


def cpu_capability() -> str:
    """What the figures depend on: torch's vector ISA and whether bfloat16 is native (see dtype_choice)."""
    try:
        import torch

        from kvpage.models.dtype_choice import cpu_has_native_bf16
    except ImportError:
        return "capability unknown"
    native = "native bf16" if cpu_has_native_bf16() else "no native bf16"
    return f"{torch.backends.cpu.get_cpu_capability()}, {native}"


def versions(*modules: str) -> str:
    parts = [f"python {platform.python_version()}"]
    for name in modules:
        try:
            mod = __import__(name)
            parts.append(f"{name} {getattr(mod, '__version__', '?')}")
        except ImportError:
            pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        parts.append(f"kvpage@{rev.stdout.strip()}")
    except OSError:
        pass
    return ", ".join(parts)


def write_json(name: str, data: dict) -> Path:
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def append_results(title: str, body: str, *modules: str) -> None:
    """Append a dated section to RESULTS.md: what ran, where, with which versions."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cmd = " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    section = (
        f"\n## {title} — {stamp}\n\n"
        f"- command: `{cmd}`\n- machine: {machine()}\n- versions: {versions(*modules)}\n\n{body.rstrip()}\n"
    )
    if not RESULTS.exists():
        RESULTS.write_text("# Benchmark results\n\nEach section is appended by a script in `benchmarks/`.\n")
    with RESULTS.open("a") as f:
        f.write(section)
