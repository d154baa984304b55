"""Attention that reads only the blocks that matter (issue 27 §2): a decode read budget (Quest).

`kv_read_budget` lets each decode read, past the first two layers, the first block, the last two and
the blocks whose keys' min/max bound the query's scores highest, up to the budget in tokens; nothing
is freed (kvpage/attention/key_bounds.py). Two questions:

- Speed: decode tokens/s of SEQS sequences with contexts of CONTEXT tokens each (distinct text, so
  nothing is shared), budgets 256 / 512 / 1024 tokens against the full read, in one engine. A decode
  step's time is (time of prompt + DECODE tokens - time of prompt + 1 token) / (DECODE - 1), the
  prompts warm in the prefix cache, so only the decodes differ between arms.
- Fidelity at the same number of tokens read per decode: retrieval of a planted fact ("The code for
  NAME is 48213.") at a random depth of a CONTEXT-token text, greedy; and how many greedy tokens of a
  continuation of the text agree with the full read's before they part. Beside StreamingLLM (a sink
  block and a window) and H2O (half heavy, half recent), which drop the rest of the cache for good.
  The prompt's own forward reads in full under a budget, so the answer's first token is the full
  read's; the others are decodes.

    python benchmarks/read_budget.py [--seqs 16] [--context 4096] [--quick | --smoke] [--no-results]

A member of `make bench` (JSON and plot under benchmarks/results/, its section of RESULTS.md).
"""

from __future__ import annotations

import argparse
import math
import time

from _facts import contexts, planted_facts
from _report import append_results, parse, recording, save_plot, suite_args, write_json

from kvpage import LLM, SamplingParams
from kvpage.cpu_kind import machine
from kvpage.tools.perplexity import decode_nlls, english_corpus, token_nlls


def decode_rate(llm: LLM, prompts: list[list[int]], budget: int | None, steps: int) -> float:
    """Decode tokens per second over all sequences (prompts already cached)."""

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, kv_read_budget=budget)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    one, many = min(timed(1) for _ in range(2)), timed(steps)
    return len(prompts) * (steps - 1) / (many - one)


def figure(plt, speed: dict, fidelity: dict, kind: str, ppl_context: int):
    """Decode rates per shape and arm; perplexity per arm (the full read's as a line)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    arms = list(speed[next(iter(speed))])
    width = 0.8 / len(speed)
    for i, (shape, row) in enumerate(speed.items()):
        a.bar([x + i * width for x in range(len(arms))], [row[k] for k in arms], width, label=shape)
    a.set_xticks([x + width * (len(speed) - 1) / 2 for x in range(len(arms))], arms)
    a.set(ylabel="decode tokens/s (all sequences)", title=f"decode rate ({kind})")
    a.legend(fontsize=8)
    names = list(fidelity)
    ppl = [fidelity[n]["perplexity"] for n in names]
    colors = ["tab:gray" if n == "full read" else "tab:purple" if n.startswith("budget") else "tab:olive"
              for n in names]  # fmt: skip
    b.bar(names, ppl, color=colors)
    b.axhline(fidelity["full read"]["perplexity"], color="k", lw=0.8)
    b.set(ylim=(min(ppl) * 0.95, max(ppl) * 1.02), ylabel=f"perplexity at {ppl_context} tokens",
          title="fidelity at equal tokens read (purple: budget; olive: evicting)")  # fmt: skip
    b.tick_params(axis="x", labelrotation=60, labelsize=7)
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16x4096,32x4096,16x8128", help="SEQSxCONTEXT,... for the decode rate")
    ap.add_argument("--decode", type=int, default=12)
    ap.add_argument("--context", type=int, default=4096, help="of the planted facts and continuations")
    ap.add_argument("--facts", type=int, default=10)
    ap.add_argument("--ppl-context", type=int, default=8128, help="windows of this many tokens for perplexity")
    ap.add_argument("--ppl-windows", type=int, default=4)
    ap.add_argument("--ppl-tokens", type=int, default=256, help="scored at the end of each window")
    suite_args(ap)
    args = parse(ap, argv, __file__)
    budgets, follow = [256, 512, 1024], 32  # follow: tokens of each greedy continuation compared
    if args.quick:
        args.shapes, args.facts, args.ppl_windows, args.ppl_context = "8x4096", 6, 2, 4096
    if args.smoke:  # (the suite's check that the script runs: one budget, every arm, short everything)
        args.shapes, args.context, args.decode, args.facts, budgets, follow = "2x160", 160, 3, 1, [64], 6
        args.ppl_context, args.ppl_windows, args.ppl_tokens = 160, 1, 16
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    longest = max([c for _, c in shapes] + [args.context, args.ppl_context])
    most = max([n * (c + args.decode + 16) for n, c in shapes] + [longest + 64])  # tokens held at once
    llm = LLM("smollm2", max_model_len=longest + 64, num_kv_blocks=most // 16 + 64, kv_read_budget=0)
    tok, kind = llm.get_tokenizer(), machine()[0]
    dtype = llm.llm_engine.dtype_name
    ids = tok.encode(english_corpus(), add_special_tokens=False)
    speed = {}
    for seqs, context in shapes:
        prompts = contexts(ids, seqs, context)
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # the prompts cached once
        row = {"full read": decode_rate(llm, prompts, None, args.decode)}
        for b in budgets:
            row[f"budget {b}"] = decode_rate(llm, prompts, b, args.decode)
        speed[f"{seqs}x{context}"] = row
    prompts = contexts(ids, 4, args.context)

    # fidelity: planted facts at random depths, and agreement with the full read's continuation
    cases = planted_facts(tok, ids, args.facts, args.context)
    arms = {"full read": {}}
    for b in budgets:
        arms[f"budget {b}"] = {"kv_read_budget": b}
    for b in budgets:
        sink = 16
        arms[f"StreamingLLM {b}"] = {"kv_eviction": f"streaming:sink_tokens={sink},window_tokens={b - sink}"}
        arms[f"H2O {b}"] = {"kv_eviction": f"h2o:heavy_tokens={b // 2},recent_tokens={b // 2}"}
    fidelity, reference = {}, None
    for arm, kw in arms.items():
        found = 0
        for prompt, code in cases:
            out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=7, **kw), use_tqdm=False)
            found += code in out[0].outputs[0].text
        conts = llm.generate(prompts[: min(4, len(prompts))], SamplingParams(
            temperature=0.0, max_tokens=follow, ignore_eos=True, **kw), use_tqdm=False)  # fmt: skip
        conts = [o.outputs[0].token_ids for o in conts]
        reference = reference or conts
        agree = [next((i for i, (a, c) in enumerate(zip(r, x)) if a != c), len(r)) for r, x in zip(reference, conts)]
        fidelity[arm] = {"retrieved": found / len(cases), "agree_tokens": sum(agree) / len(agree)}

    # perplexity of each window's last tokens, every one predicted by a decode (teacher forcing); the
    # eviction policies through the engine's prompt log-probabilities, prefilled 64 tokens at a time
    windows = contexts(ids, args.ppl_windows, args.ppl_context)
    start = args.ppl_context - args.ppl_tokens - 1
    model = llm.llm_engine.runner.model
    chunked = LLM("smollm2", max_model_len=args.ppl_context + 64, max_num_batched_tokens=64,
                  num_kv_blocks=(args.ppl_context + 64) // 16 + 16)  # fmt: skip
    nll = {}
    for arm, kw in arms.items():
        scores = []
        for win in windows:
            if "kv_eviction" in kw:
                scores += token_nlls(chunked, win, window=len(win), kv_eviction=kw["kv_eviction"])[0][start:]
            else:
                scores += decode_nlls(model, win, start, read_budget=kw.get("kv_read_budget"))
        nll[arm] = sum(scores) / len(scores)
    for arm in arms:
        fidelity[arm]["perplexity"] = math.exp(nll[arm])

    head = f"CPU kind {kind}, SmolLM2-135M-Instruct ({dtype}), {args.decode} decodes per sequence"
    lines = [head, "", "| sequences x context | " + " | ".join(speed[next(iter(speed))]) + " |",
             "|---|" + "---|" * len(speed[next(iter(speed))])]  # fmt: skip
    for shape, row in speed.items():
        full = row["full read"]
        lines.append(f"| {shape} | " + " | ".join(f"{r:.1f} tok/s ({r / full:.2f}x)" for r in row.values()) + " |")
    lines += ["", f"{args.facts} planted facts at random depths of {args.context}-token texts; greedy continuations "
              f"of {follow} tokens of 4 such texts; perplexity of the last {args.ppl_tokens} tokens of "
              f"{args.ppl_windows} windows of {args.ppl_context} tokens", "",
              f"| arm | facts retrieved | tokens before parting from the full read (of {follow}) | perplexity |",
              "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {a} | {r['retrieved']:.0%} | {r['agree_tokens']:.1f} | {r['perplexity']:.3f} |"
              for a, r in fidelity.items()]  # fmt: skip
    table = "\n".join(lines)
    print(table)
    write_json("read_budget", {"speed": speed, "fidelity": fidelity, "cpu_kind": kind, "args": vars(args)})

    save_plot("read_budget", lambda plt: figure(plt, speed, fidelity, kind, args.ppl_context))
    if recording(args):
        body = (f"Plot `benchmarks/results/read_budget.png`. `kv_read_budget` (Quest's per-block key bounds, "
                "chosen per sequence and kv head inside the compiled decode task; the first two layers, the "
                "prompt's own forward, the first block and the last two always read in full). Decode rate: "
                "the prompts warm in the prefix cache, (time of prompt + N tokens - time of prompt + 1) / "
                f"(N - 1).\n\n{table}\n\nStreamingLLM and H2O read as many tokens per decode as the budget "
                "but have dropped the rest for good (their prefill evicts too); a budget frees nothing, so "
                "its memory is the full cache's plus the bounds (an eighth more per bfloat16 block).")  # fmt: skip
        append_results("A decode read budget (benchmarks/read_budget.py)", body, "torch", key="read_budget")


if __name__ == "__main__":
    main()
