"""Speed before and after a change, in one run: a git revision against the working tree.

A refactor must not cost speed where users feel it. This checks out `--rev` in a temporary worktree
and measures it and the working tree alternately, round by round (the machine's speed drifts between
runs here), each measure in a fresh process that imports kvpage from its own tree; the medians:

  one stream     one chat request alone, --gen tokens: decode tokens/s (what an interactive user sees)
  offline        --requests seeded requests at once (prompts 32-384 tokens, outputs 16-96): output tokens/s

    python benchmarks/before_after.py --rev 16a20e3 [--rounds 3] [--dtype auto] [--no-results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import append_results, parse, recording, suite_args, write_json

ROOT = Path(__file__).resolve().parents[1]

_MEASURE = r"""
import json, random, sys, time
from kvpage import LLM, SamplingParams
what, dtype, gen, requests, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = LLM("smollm2", dtype=dtype, kv_cache_memory="1GiB")
engine = llm.llm_engine
if what == "stream":
    tok = llm.get_tokenizer()
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about the Moon."}]))
    llm.generate([prompt[:8]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True))
    engine.step()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    value = (gen - 1) / (time.perf_counter() - t0)
else:
    rng = random.Random(seed)
    reqs = [([rng.randrange(100, 49000) for _ in range(rng.randint(32, 384))], rng.randint(16, 96))
            for _ in range(requests)]
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
    t0 = time.perf_counter()
    llm.generate([p for p, _ in reqs], [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs],
                 use_tqdm=False)
    value = sum(o for _, o in reqs) / (time.perf_counter() - t0)
print(json.dumps({"value": value, "dtype": engine.dtype_name}))
"""


def measure(tree: Path, what: str, args, seed: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", _MEASURE, what, args.dtype, str(args.gen), str(args.requests),
                          str(seed)], cwd=tree, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"{tree}: {what} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the git revision to measure against the working tree")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--requests", type=int, default=32)
    suite_args(ap)
    args = parse(ap, argv, __file__)
    if args.smoke:
        args.rounds, args.gen, args.requests = 1, 4, 2
    rev = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvpage-before-") as tmp:
        before = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), rev], cwd=ROOT, check=True,
                       capture_output=True)  # fmt: skip
        try:
            trees = {"before": before, "after": ROOT}
            got: dict[tuple[str, str], list[float]] = {}
            dtype = None
            for r in range(args.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for what in ("stream", "offline"):
                    for side in order:
                        m = measure(trees[side], what, args, seed=r)
                        dtype = m["dtype"]
                        got.setdefault((side, what), []).append(m["value"])
                        print(f"round {r}: {side:6s} {what:7s} {m['value']:.1f} tokens/s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)
    med = {k: statistics.median(v) for k, v in got.items()}
    labels = {"stream": f"one stream, {args.gen} tokens", "offline": f"offline, {args.requests} requests"}
    lines = [f"| {dtype} | before ({rev}) | after (this tree) | after / before |", "|---|---|---|---|"]
    rows = []
    for what in ("stream", "offline"):
        b, a = med[("before", what)], med[("after", what)]
        rows.append({"what": what, "before": b, "after": a, "ratio": a / b,
                     "rounds": {"before": got[("before", what)], "after": got[("after", what)]}})  # fmt: skip
        lines.append(f"| {labels[what]} | {b:.1f} tokens/s | {a:.1f} tokens/s | {a / b:.3f} |")
    table = "\n".join(lines)
    print(table)
    write_json("before_after", {"rev": rev, "rows": rows, "args": vars(args)})
    if recording(args):
        append_results(f"Speed before and after ({rev} against the working tree)", table + "\n", "torch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
