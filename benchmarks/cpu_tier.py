"""The prefix cache's CPU tier: time to first token of a repeated prompt whose blocks were pushed
out of the pool, brought back from the tier against recomputed, and the same greedy tokens.

A pool of --blocks blocks (default 80: 1,280 tokens); a --prompt-len-token prompt (default 1,024,
real text) is served, then two other prompts of the same length push every one of its blocks out;
then the first prompt again, timed (max_tokens=1 is the time to first token through the API).
With --cpu-offload-memory its blocks come back from the tier; without, they are recomputed.

    python benchmarks/cpu_tier.py [--dtype bfloat16] [--repeat 3] [--no-results]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _report import append_results, parse, write_json

from kvpage import LLM, SamplingParams
from kvpage.tools.perplexity import english_corpus


def run(args, tier: str, ids: list[list[int]]) -> dict:
    llm = LLM("smollm2", dtype=args.dtype, num_kv_blocks=args.blocks, max_model_len=args.blocks * 16,
              cpu_offload_memory=tier)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = llm.generate([ids[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    times, outs = [], []
    for _ in range(args.repeat):
        for other in ids[1:]:  # push the first prompt's blocks out of the pool
            llm.generate([other], SamplingParams(max_tokens=1), use_tqdm=False)
        t0 = time.perf_counter()
        llm.generate([ids[0]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        times.append(time.perf_counter() - t0)
        for other in ids[1:]:
            llm.generate([other], SamplingParams(max_tokens=1), use_tqdm=False)
        outs.append(llm.generate([ids[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    st = llm.cache_stats()
    return {"tier": tier, "ttft_s": statistics.median(times), "all_ttft_s": times,
            "same_tokens": all(o == first for o in outs), "tier_hit_tokens": st.tier_hit_tokens,
            "first": first}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--blocks", type=int, default=80)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cpu-offload-memory", default="512MiB")
    ap.add_argument("--no-results", action="store_true")
    args = parse(ap, None, __file__)
    text_ids = LLM("smollm2", num_kv_blocks=4, max_model_len=64).get_tokenizer().encode(english_corpus())
    n = args.prompt_len
    ids = [text_ids[i * n : (i + 1) * n] for i in range(3)]
    rows = [run(args, args.cpu_offload_memory, ids), run(args, "0", ids)]
    tier, recompute = rows
    same = tier["first"] == recompute["first"] and tier["same_tokens"] and recompute["same_tokens"]
    table = "\n".join([
        "| prompt blocks come back | time to first token (median) | greedy tokens as a cold run |",
        "|---|---|---|",
        f"| from the CPU tier ({tier['tier_hit_tokens']:,} tokens restored in the run) | {tier['ttft_s'] * 1e3:.0f} ms "
        f"| {same} |",
        f"| recomputed (no tier) | {recompute['ttft_s'] * 1e3:.0f} ms | {same} |",
    ])  # fmt: skip
    ratio = recompute["ttft_s"] / tier["ttft_s"]
    print(table)
    print(f"restored / recomputed: {ratio:.1f}x faster")
    write_json("cpu_tier", {"rows": rows, "ratio": ratio})
    if not args.no_results:
        body = (f"A {n}-token prompt (english_corpus text) in a {args.blocks}-block pool, pushed out by two other "
                f"{n}-token prompts, then asked again (max_tokens=1), {args.repeat} times, dtype {args.dtype}."
                f"\n\n{table}\n\nRestoring is {ratio:.1f}x faster than recomputing.")  # fmt: skip
        append_results("CPU tier of the prefix cache (benchmarks/cpu_tier.py)", body, "torch")


if __name__ == "__main__":
    main()
