"""What deterministic mode costs: `deterministic=True` against the default, same run, same requests.

Deterministic mode (kvpage/models/batch_invariant.py) sends every linear through the row kernels
and every prefill query through the paged decode kernel, so a request's bits do not depend on its
batch. Measured where users feel it, alternating the two engines round by round (the machine's
speed drifts between runs here), the median of the rounds:

  one stream     one chat request alone, --gen tokens: decode tokens/s (what an interactive user sees)
  prefill        TTFT of a --prefill-len token prompt alone (the compute-bound part that pays most)
  offline        --requests seeded requests at once (prompts 32-384 tokens, outputs 16-96): output tokens/s

    python benchmarks/determinism.py [--dtype auto float32] [--rounds 3] [--no-results]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from _report import append_results, parse, recording, save_plot, suite_args, write_json

from kvpage import LLM, SamplingParams


def one_stream(llm: LLM, gen: int) -> float:
    tok = llm.get_tokenizer()
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about the Moon."}]))
    llm.reset_prefix_cache()
    engine = llm.llm_engine
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True))
    engine.step()  # the prefill (and first token)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (gen - 1) / (time.perf_counter() - t0)


def prefill(llm: LLM, n: int) -> float:
    prompt = [random.Random(n).randrange(100, 49000) for _ in range(n)]
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t0


def offline(llm: LLM, n: int, seed: int) -> float:
    rng = random.Random(seed)
    reqs = [([rng.randrange(100, 49000) for _ in range(rng.randint(32, 384))], rng.randint(16, 96)) for _ in range(n)]
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate([p for p, _ in reqs], [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs],
                 use_tqdm=False)  # fmt: skip
    return sum(o for _, o in reqs) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", nargs="+", default=["auto", "float32"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--requests", type=int, default=32)
    suite_args(ap)
    args = parse(ap, argv, __file__)
    if args.quick:
        args.rounds, args.requests = 2, 16
    if args.smoke:
        args.rounds, args.gen, args.prefill_len, args.requests, args.dtype = 1, 4, 32, 2, ["float32"]
    rows = []
    for dtype in args.dtype:
        engines = {det: LLM("smollm2", dtype=dtype, kv_cache_memory="1GiB", deterministic=det) for det in (False, True)}
        name = engines[False].llm_engine.dtype_name
        got: dict[tuple[bool, str], list[float]] = {}
        for r in range(args.rounds):
            for det in (False, True) if r % 2 == 0 else (True, False):
                llm = engines[det]
                got.setdefault((det, "stream"), []).append(one_stream(llm, args.gen))
                got.setdefault((det, "prefill"), []).append(prefill(llm, args.prefill_len))
                got.setdefault((det, "offline"), []).append(offline(llm, args.requests, seed=r))
        med = {k: statistics.median(v) for k, v in got.items()}
        for what, unit, higher in (
            ("stream", "tokens/s", True),
            ("prefill", "s", False),
            ("offline", "tokens/s", True),
        ):
            base, det = med[(False, what)], med[(True, what)]
            cost = (base / det - 1) if higher else (det / base - 1)  # how much slower deterministic is
            rows.append({"dtype": name, "what": what, "unit": unit, "default": base, "deterministic": det,
                         "slower": cost, "rounds": got[(False, what)] + got[(True, what)]})  # fmt: skip
        del engines
    lines = ["| dtype | measure | default | deterministic | deterministic is slower by |", "|---|---|---|---|---|"]
    for r in rows:
        label = {"stream": f"one stream, {args.gen} tokens", "prefill": f"TTFT, {args.prefill_len}-token prompt",
                 "offline": f"offline, {args.requests} requests"}[r["what"]]  # fmt: skip
        fmt = "{:.3f} s" if r["unit"] == "s" else "{:.1f} tokens/s"
        lines.append(f"| {r['dtype']} | {label} | {fmt.format(r['default'])} | {fmt.format(r['deterministic'])} "
                     f"| {r['slower']:+.1%} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    write_json("determinism", {"rows": rows, "args": vars(args)})

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{r['dtype']}\n{r['what']}" for r in rows]
        ax.bar(labels, [100 * r["slower"] for r in rows], color="#4c72b0")
        ax.axhline(10, color="gray", linestyle="--", linewidth=1)
        ax.set_ylabel("deterministic slower by (%)")
        ax.set_title("The cost of deterministic mode (median of alternating rounds)")
        return fig

    save_plot("determinism", draw)
    if recording(args):
        append_results("Deterministic mode against the default", table + "\n", "torch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
