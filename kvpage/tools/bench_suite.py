"""`kvpage bench --suite NAME` / `make bench`: the seed documents' claims, re-measured on this machine.

Each suite member is a script in the repository's benchmarks/ folder (they need the source checkout,
not only the installed package). Each writes JSON and a PNG under benchmarks/results/ and replaces
its own section of benchmarks/RESULTS.md; after a recorded run, benchmarks/headline.py rewrites the
README's headline table from the JSON the suite last wrote.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

# issue order: the seed claim each one checks
SUITE = {
    "cache_vs_nocache": "time per token with a KV cache against recomputing without one",
    "paged_vs_static": "waste at 8 concurrent requests; requests and tokens/s in one KV budget",
    "sharing": "full-sequence (n samples) and prefix (customer service) sharing; TTFT warm vs cold",
    "beam_memory": "parallel sampling and beam search against contiguous copies per sequence",
    "block_size": "block sizes 8-256: waste, prefix hits, throughput; the seed's rule and kvpage blocks",
    "kv_policies": "int8 / fp8 KV and StreamingLLM / H2O: bytes, perplexity, requests in one budget",
    "forward_pass": "the machine's limit: the forward pass against the model's linear layers alone",
    "segments": "documents reused at any position: full prefill, naive reuse, block-LegoLink and CacheBlend",
    "read_budget": "a decode read budget (Quest): decode tokens/s and fidelity against StreamingLLM and H2O",
    "demotion": "blocks demoted to int8 / int4 instead of dropped, at equal memory against H2O and StreamingLLM",
    "tensor_parallel": "tensor parallelism on CPU at TP=1/2/3: memory per rank, step time, share in all-reduces",
    "kv_groups": "KV-cache groups (sliding windows, chunks) against every layer sized as full attention",
    "structured_outputs": "structured outputs: a batch's tokens/s at 0 / 50 / 100% constrained rows, the mask's cost",
}


def benchmarks_dir() -> Path:
    path = Path(__file__).resolve().parents[2] / "benchmarks"
    if not (path / "_report.py").exists():
        raise ValueError(f"the suite's scripts live in the repository's benchmarks/ folder ({path} has none): "
                         "run it from a source checkout")  # fmt: skip
    return path


def resolve(names: list[str]) -> list[str]:
    if names == ["all"]:
        return list(SUITE)
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        raise ValueError(f"unknown suite benchmark(s) {', '.join(unknown)}; choose from all, {', '.join(SUITE)}")
    return names


def run_suite(names: list[str], *, quick: bool = False, smoke: bool = False, no_results: bool = False) -> int:
    """Run the named benchmarks one after another (the machine has few cores: never two at once)."""
    names, where = resolve(names), benchmarks_dir()
    flags = [f for f, on in (("--quick", quick), ("--smoke", smoke), ("--no-results", no_results)) if on]
    failed = []
    for name in names:
        print(f"== {name}: {SUITE[name]}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, f"{name}.py", *flags], cwd=where).returncode
        print(
            f"== {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.0f} s", flush=True
        )
        if rc:
            failed.append(name)
    if not (smoke or no_results):
        subprocess.run([sys.executable, "headline.py"], cwd=where, check=False)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
