"""Shared plumbing of the benchmark scripts: machine description, JSON and PNG output, RESULTS.md entries.

Output goes to benchmarks/results/ (committed: the README links its plots), or to $KVPAGE_BENCH_OUT
(tests point it at a temporary folder). Every script of the suite takes the same three flags
(`suite_args`): --quick (a few minutes for the whole suite), --smoke (seconds: what the tests run,
never recorded) and --no-results (both write under results/unrecorded/).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "RESULTS.md"


def out_dir() -> Path:
    """$KVPAGE_BENCH_OUT, else benchmarks/results/ (benchmarks/results/unrecorded/ for a run that records
    nothing: --smoke or --no-results, so the JSON and plots beside RESULTS.md stay the recorded ones)."""
    default = ROOT / "results" / "unrecorded" if _UNRECORDED else ROOT / "results"
    path = Path(os.environ.get("KVPAGE_BENCH_OUT") or default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def suite_args(ap) -> None:
    ap.add_argument("--quick", action="store_true", help="a smaller run (the whole suite in a few minutes)")
    ap.add_argument("--smoke", action="store_true", help="the tiniest run, for tests (implies --no-results)")
    ap.add_argument("--no-results", action="store_true", help="do not write benchmarks/RESULTS.md")


_INVOKED: list[str] = []  # the script and arguments of the run in progress (see parse)
_UNRECORDED = False  # a --smoke / --no-results run in progress: its output never lands where the README links


def parse(ap, argv: list[str] | None, script: str):
    """ap.parse_args(argv), remembering the command line for the records (argv None: sys.argv)."""
    global _UNRECORDED
    args = ap.parse_args(argv)
    _UNRECORDED = bool(getattr(args, "smoke", False) or getattr(args, "no_results", False))
    _INVOKED[:] = [Path(script).name, *(sys.argv[1:] if argv is None else argv)]
    return args


def recording(args) -> bool:
    return not (args.no_results or args.smoke)


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
    """What the figures depend on: kvpage's CPU kind (kvpage/cpu_kind.py; emulated under KVPAGE_CPU_KIND),
    torch's vector ISA and whether bfloat16 is native (see dtype_choice)."""
    try:
        import torch

        from kvpage import cpu_kind
        from kvpage.models.dtype_choice import cpu_has_native_bf16
    except ImportError:
        return "capability unknown"
    kind, native_kind = cpu_kind.machine()[0], cpu_kind.kind_of(cpu_kind.read_flags())
    kind_note = f"kind {kind}" + (f" (emulated on {native_kind})" if kind != native_kind else "")
    native = "native bf16" if cpu_has_native_bf16() else "no native bf16"
    return f"{kind_note}, {torch.backends.cpu.get_cpu_capability()}, {native}"


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
        # (what the suite itself writes does not count: RESULTS.md, results/, the README's table)
        outputs = [":(exclude,top)benchmarks/RESULTS.md", ":(exclude,top)benchmarks/results", ":(exclude,top)README.md"]
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)", *outputs],
                               capture_output=True, text=True, cwd=ROOT).stdout.strip()  # fmt: skip
        parts.append(f"kvpage@{rev.stdout.strip()}" + ("+uncommitted changes" if dirty else ""))
    except OSError:
        pass
    return ", ".join(parts)


def write_json(name: str, data: dict) -> Path:
    """<out>/<name>.json: the figures, plus where and how they were measured under "_meta"."""
    meta = {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
            "versions": versions("torch"), "command": command()}  # fmt: skip
    path = out_dir() / f"{name}.json"
    path.write_text(json.dumps(data | {"_meta": meta}, indent=2, allow_nan=False))
    return path


def command() -> str:
    name, *rest = _INVOKED or [Path(sys.argv[0]).name, *sys.argv[1:]]
    return " ".join(["python", f"benchmarks/{name}", *rest])


def save_plot(name: str, draw) -> Path | None:
    """draw(plt) makes one figure; it is written to <out>/<name>.png. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    fig = draw(plt)
    path = out_dir() / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def append_results(title: str, body: str, *modules: str, key: str | None = None) -> None:
    """A dated section of RESULTS.md: what ran, where, with which versions and commit.

    With a `key` (the suite's scripts) the section replaces the one the same script wrote last, between
    `<!-- suite:key -->` markers, so RESULTS.md shows each claim's latest measurement once; without
    one it is appended (the history of the other scripts)."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"\n## {title} — {stamp}\n\n"
        f"- command: `{command()}`\n- machine: {machine()}\n- versions: {versions(*modules)}\n\n{body.rstrip()}\n"
    )
    if not RESULTS.exists():
        RESULTS.write_text("# Benchmark results\n\nEach section is written by a script in `benchmarks/`.\n")
    text = RESULTS.read_text()
    if key is None:
        RESULTS.write_text(text + section)
        return
    start, end = f"<!-- suite:{key} -->", f"<!-- /suite:{key} -->"
    block = f"{start}{section}{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text += "\n" + block + "\n"
    RESULTS.write_text(text)
