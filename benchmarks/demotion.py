"""Blocks demoted instead of dropped (issue 27 §3): `kv_eviction="demote:..."` at equal memory
against block H2O and StreamingLLM.

Demote ranks a sequence's blocks by the attention mass they received (H2O's score) and keeps the
best `hot_tokens` in the cache's precision, the next `int8_tokens` in int8, the next `int4_tokens`
in int4 (KIVI's layout), and drops the rest; the last `recent_tokens` stay hot. Each arm gets the
same KV bytes per sequence, a budget of BUDGET tokens in the cache's own precision:

- StreamingLLM: a 16-token sink block and a window of BUDGET - 16;
- H2O: BUDGET / 2 heavy, BUDGET / 2 recent;
- Demote: BUDGET / 4 recent, BUDGET / 8 heavy kept hot, and the remaining bytes shared evenly by an
  int8 and an int4 rung (so it holds about twice as many tokens as the others); "Demote, H2O's
  window": the same with H2O's recent window, BUDGET / 2.

Measured: perplexity of each window's last tokens (prompts prefilled 64 tokens a step, every chunk
evicting or demoting as it goes); planted facts retrieved at random depths of CONTEXT-token texts;
how many greedy tokens of a continuation agree with the full cache's; and the decode rate (the
demoted blocks take the torch path, as H2O's attention mass does).

    python benchmarks/demotion.py [--quick | --smoke] [--no-results]

A member of `make bench` (JSON and plot under benchmarks/results/, its section of RESULTS.md).
"""

from __future__ import annotations

import argparse
import math
import time

from _facts import contexts, planted_facts
from _report import append_results, parse, recording, save_plot, suite_args, write_json

from kvpage import LLM, SamplingParams
from kvpage.core.eviction import Demote, parse_eviction
from kvpage.cpu_kind import machine
from kvpage.models import parse_dtype
from kvpage.tools.perplexity import english_corpus, token_nlls
from kvpage.worker.kv_cache import KVCache

BS = 16


def demote_at(budget: int, cost: dict[str, int], recent_share: int = 4) -> Demote:
    """The Demote arm holding the bytes of `budget` hot tokens (block costs in `cost`): a recent
    window of budget / `recent_share`, budget / 8 heavy hitters kept hot, the rest in the rungs."""
    recent, hot = budget // recent_share, budget // 8
    rest = (budget - recent - hot) // BS * cost["hot"]  # bytes left for the rungs, shared evenly
    int8, int4 = (rest // 2 // cost[p] * BS for p in ("int8", "int4"))
    return Demote(hot_tokens=hot, int8_tokens=int8, int4_tokens=int4, recent_tokens=recent)


def bytes_of(policy, cost: dict[str, int]) -> int:
    """KV bytes a sequence holds at most under `policy` (whole blocks outside the partial last one)."""
    if isinstance(policy, Demote):
        hot, int8, int4, _ = policy.quotas(BS)  # (no arm here uses the CPU-tier rung: host memory)
        return (hot + -(-policy.recent_tokens // BS)) * cost["hot"] + int8 * cost["int8"] + int4 * cost["int4"]
    return policy.budget_tokens(BS) // BS * cost["hot"]


def decode_rate(llm: LLM, prompts: list[list[int]], policy, steps: int) -> float:
    def timed(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, kv_eviction=policy)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    timed(1)  # the prompts' prefix blocks cached (an evicting arm hits within its budget only)
    one, many = timed(1), timed(steps)
    return len(prompts) * (steps - 1) / (many - one)


def figure(plt, rows: dict, budgets: list[int], kind: str, ppl_context: int):
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, color in (
        ("StreamingLLM", "tab:olive"),
        ("H2O", "tab:orange"),
        ("Demote", "tab:purple"),
        ("Demote, H2O's window", "tab:red"),
    ):
        if f"{name} {budgets[0]}" not in rows:
            continue
        a.plot(budgets, [rows[f"{name} {x}"]["perplexity"] for x in budgets], "o-", color=color, label=name)
        b.plot(budgets, [rows[f"{name} {x}"]["agree_tokens"] for x in budgets], "o-", color=color, label=name)
    a.axhline(rows["full cache"]["perplexity"], color="k", lw=0.8, label="full cache")
    b.axhline(rows["full cache"]["agree_tokens"], color="k", lw=0.8, label="full cache")
    a.set(xscale="log", xlabel="KV bytes per sequence, in hot tokens", ylabel=f"perplexity at {ppl_context} tokens",
          title=f"equal memory ({kind})")  # fmt: skip
    b.set(xscale="log", xlabel="KV bytes per sequence, in hot tokens",
          ylabel="greedy tokens agreeing with the full cache (of 32)", title="fidelity")  # fmt: skip
    for ax in (a, b):
        ax.set_xticks(budgets, [str(x) for x in budgets])
        ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096, help="of the planted facts and continuations")
    ap.add_argument("--facts", type=int, default=10)
    ap.add_argument("--ppl-context", type=int, default=8128)
    ap.add_argument("--ppl-windows", type=int, default=4)
    ap.add_argument("--ppl-tokens", type=int, default=256, help="scored at the end of each window")
    ap.add_argument("--decode", type=int, default=24)
    suite_args(ap)
    args = parse(ap, argv, __file__)
    budgets, follow, num_texts = [256, 512, 1024], 32, 4  # follow: tokens of each greedy continuation compared
    if args.quick:
        args.facts, args.ppl_windows, args.ppl_context = 6, 2, 4096
    if args.smoke:  # (the suite's check that the script runs: one budget, every arm, short everything)
        args.context, args.facts, args.decode, budgets, follow, num_texts = 128, 1, 3, [64], 6, 1
        args.ppl_context, args.ppl_windows, args.ppl_tokens = 128, 1, 16
    longest = max(args.context, args.ppl_context) + 64
    probe = LLM("smollm2", max_model_len=64, num_kv_blocks=8).llm_engine
    cfg, dtype = probe.runner.model.config, parse_dtype(probe.dtype_name)
    cost = {"hot": KVCache.bytes_per_block(cfg, BS, dtype),
            **{p: KVCache.demoted_bytes_per_block(cfg, BS, p) for p in ("int8", "int4")}}  # fmt: skip
    del probe
    arms: dict = {"full cache": "none"}
    for b in budgets:
        arms[f"StreamingLLM {b}"] = f"streaming:sink_tokens=16,window_tokens={b - 16}"
        arms[f"H2O {b}"] = f"h2o:heavy_tokens={b // 2},recent_tokens={b // 2}"
        arms[f"Demote {b}"] = demote_at(b, cost)
        arms[f"Demote, H2O's window {b}"] = demote_at(b, cost, recent_share=2)
    # one engine for every arm: started with the largest Demote so its pools hold any arm's rungs,
    # prefilling 64 tokens a step as an evicting prompt does
    llm = LLM("smollm2", max_model_len=longest, max_num_batched_tokens=64, num_kv_blocks=4 * longest // BS + 64,
              kv_eviction=arms[f"Demote {budgets[-1]}"])  # fmt: skip
    tok, kind = llm.get_tokenizer(), machine()[0]
    dtype_name = llm.llm_engine.dtype_name
    ids = tok.encode(english_corpus(), add_special_tokens=False)

    cases = planted_facts(tok, ids, args.facts, args.context)
    texts = contexts(ids, num_texts, args.context)
    windows = contexts(ids, args.ppl_windows, args.ppl_context)
    start = args.ppl_context - args.ppl_tokens - 1
    rows, reference = {}, None
    for arm, policy in arms.items():
        found = 0
        for prompt, code in cases:
            out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=7, kv_eviction=policy),
                               use_tqdm=False)  # fmt: skip
            found += code in out[0].outputs[0].text
        conts = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=follow, ignore_eos=True,
                                                   kv_eviction=policy), use_tqdm=False)  # fmt: skip
        conts = [o.outputs[0].token_ids for o in conts]
        reference = reference or conts
        agree = [next((i for i, (a, c) in enumerate(zip(r, x)) if a != c), len(r)) for r, x in zip(reference, conts)]
        scores = []
        for win in windows:
            scores += token_nlls(llm, win, window=len(win), kv_eviction=policy)[0][start:]
        rate = decode_rate(llm, texts, policy, args.decode)
        parsed = parse_eviction(policy)
        held = None if parsed is None else bytes_of(parsed, cost)
        rows[arm] = {
            "retrieved": found / len(cases),
            "agree_tokens": sum(agree) / len(agree),
            "perplexity": math.exp(sum(scores) / len(scores)),
            "decode_tok_s": rate,
            "bytes_per_seq": held,
            "policy": policy if isinstance(policy, str) else policy.describe(),
        }
        print(arm, rows[arm], flush=True)
    demoted = dict(llm.llm_engine.kv_manager.eviction.num_demoted)

    head = (f"CPU kind {kind}, SmolLM2-135M-Instruct ({dtype_name}); block bytes: {cost['hot']} "
            f"({dtype_name}), {cost['int8']} (int8), {cost['int4']} (int4)")  # fmt: skip
    lines = [head, "", f"perplexity of the last {args.ppl_tokens} tokens of {args.ppl_windows} windows of "
             f"{args.ppl_context} tokens; {args.facts} planted facts in {args.context}-token texts; greedy "
             f"continuations of {follow} tokens of {num_texts} such texts; decode rate of those {num_texts} "
             "at once", "",
             f"| arm | KV bytes per sequence | perplexity | facts retrieved | tokens agreeing (of {follow}) "
             "| decode tok/s |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for arm, r in rows.items():
        size = "all" if r["bytes_per_seq"] is None else f"{r['bytes_per_seq'] / 2**20:.1f} MiB"
        lines.append(f"| {arm} | {size} | {r['perplexity']:.3f} | {r['retrieved']:.0%} | {r['agree_tokens']:.1f} "
                     f"| {r['decode_tok_s']:.1f} |")  # fmt: skip
    lines += ["", "Demote arms: " + "; ".join(f"{b}: {arms[f'Demote {b}'].describe()}" for b in budgets),
              f"Blocks demoted over the run: {demoted}"]  # fmt: skip
    table = "\n".join(lines)
    print(table)
    write_json("demotion", {"rows": rows, "budgets": budgets, "cost": cost, "cpu_kind": kind, "args": vars(args)})
    save_plot("demotion", lambda plt: figure(plt, rows, budgets, kind, args.ppl_context))
    if recording(args):
        body = (f"Plot `benchmarks/results/demotion.png`. `kv_eviction=\"demote:...\"` (H2O's ranking by "
                "attention mass, with an int8 and an int4 rung below the heavy hitters instead of dropping) "
                "against block H2O and StreamingLLM, every arm holding the same KV bytes per sequence "
                f"(the budget in tokens of the cache's own precision).\n\n{table}")  # fmt: skip
        append_results("Blocks demoted instead of dropped (benchmarks/demotion.py)", body, "torch", key="demotion")


if __name__ == "__main__":
    main()
