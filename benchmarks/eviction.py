"""Eviction policies on the real model: perplexity, KV blocks held and decode speed of StreamingLLM
and H2O against the full cache, on real English text (`english_corpus()`), through the engine.

1. Within the model's context (--context tokens, default 8,192 = SmolLM2's): one sequence scored
   with prompt_logprobs under the full cache, StreamingLLM (4 sinks + 1,020 recent, the paper's
   cache of 1,024), a window without sinks, and H2O (512 heavy + 512 recent: the same budget).
2. Past the context (--long tokens, default 24,576 = 3x): the full cache cannot run it (the engine
   refuses a prompt over max_model_len, as it must: positions past 8,192 were never trained);
   StreamingLLM with its positions inside the cache, the same without (sinks seen at their
   original distance), and the window without sinks, each scored per 8,192-token segment.
3. Speed: a --prompt-token prompt (default 4,096) then --gen tokens (default 256), decode tokens/s
   and blocks held, full cache against each policy.

Every figure is measured in this run; prefill chunks are the policy's window (a token sees the
sinks, the window and its chunk before it), the full cache's are --chunk tokens.

    python benchmarks/eviction.py [--context 8192] [--long 24576] [--quick] [--no-results]
"""

from __future__ import annotations

import argparse
import math
import time

from _report import append_results, parse, write_json

from kvpage import LLM, SamplingParams
from kvpage.core.eviction import H2O, StreamingLLM
from kvpage.tools.perplexity import corpus_digest, english_corpus, token_nlls


class StreamingOriginalPositions(StreamingLLM):
    """Ablation: StreamingLLM's blocks, but the sinks keep their original positions (so past the
    model's context a query sees them at distances it was never trained on)."""

    __slots__ = ()
    reposition = False

    def describe(self) -> str:
        return "streaming without repositioning"


def ppl(nlls: list[float]) -> float:
    return math.exp(sum(nlls) / len(nlls)) if nlls else float("nan")


def record_used(llm: LLM) -> list[int]:
    """Blocks in use as each step runs (after the scheduler took them, before anything is freed)."""
    engine, used = llm.llm_engine, []
    execute = engine.runner.execute

    def recording_execute(step):
        used.append(engine.kv_manager.pool.num_used)
        return execute(step)

    engine.runner.execute = recording_execute
    return used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192, help="tokens scored within the context (default 8192)")
    ap.add_argument("--long", type=int, default=24576, help="tokens scored past the context (default 24576)")
    ap.add_argument("--chunk", type=int, default=1024, help="full cache's prefill chunk (default 1024)")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parse(ap, None, __file__)
    window = 1020
    if args.quick:
        args.context, args.long, args.prompt_tokens, args.gen, window = 1024, 2048, 512, 32, 124
    heavy = (window + 4) // 2
    policies = {
        "full cache": None,
        f"StreamingLLM 4 + {window}": StreamingLLM(4, window),
        f"window {window + 4}, no sinks": StreamingLLM(0, window + 4),
        f"H2O {heavy} heavy + {heavy} recent": H2O(heavy, heavy),
    }
    text = english_corpus()
    llm = LLM("smollm2", dtype=args.dtype, max_model_len=args.context, max_num_batched_tokens=args.chunk,
              kv_cache_memory="1GiB", enable_prefix_caching=False)  # fmt: skip
    all_tokens = llm.get_tokenizer().encode(text)
    if len(all_tokens) < args.long:
        raise SystemExit(f"the corpus has {len(all_tokens)} tokens, fewer than --long {args.long}")
    used = record_used(llm)
    bs = llm.llm_engine.config.block_size
    print(f"corpus {corpus_digest(text)}: {len(all_tokens):,} tokens; block size {bs}", flush=True)

    within = []
    ids = all_tokens[: args.context]
    for label, policy in policies.items():
        used.clear()
        t0 = time.perf_counter()
        nlls = token_nlls(llm, ids, window=len(ids), kv_eviction=policy)[0]
        row = {"config": label, "perplexity": ppl(nlls), "tokens": len(nlls), "peak_blocks": max(used),
               "seconds": time.perf_counter() - t0}  # fmt: skip
        within.append(row)
        print(f"{label:>34}: perplexity {row['perplexity']:.4f}, peak {row['peak_blocks']} blocks", flush=True)

    past = []
    long_ids = all_tokens[: args.long]
    try:
        token_nlls(llm, long_ids, window=len(long_ids))
        full_past = "ran"
    except RuntimeError as e:
        full_past = str(e)
    print(f"full cache on {len(long_ids):,} tokens: {full_past}", flush=True)
    seg = args.context
    used.clear()
    t0 = time.perf_counter()
    per_window = token_nlls(llm, long_ids, window=seg)  # the full cache where it fits: each segment from scratch
    flat = [x for w in per_window for x in w]
    past.append({"config": f"full cache, each {seg:,}-token segment on its own", "perplexity": ppl(flat),
                 "segments": [ppl(w) for w in per_window], "peak_blocks": max(used),
                 "seconds": time.perf_counter() - t0})  # fmt: skip
    for label, policy in [
        (f"StreamingLLM 4 + {window}", StreamingLLM(4, window)),
        (f"StreamingLLM 4 + {window}, original positions", StreamingOriginalPositions(4, window)),
        (f"window {window + 4}, no sinks", StreamingLLM(0, window + 4)),
    ]:
        used.clear()
        t0 = time.perf_counter()
        nlls = token_nlls(llm, long_ids, window=len(long_ids), kv_eviction=policy)[0]
        segments = [ppl(nlls[i : i + seg]) for i in range(0, len(nlls), seg)]
        row = {"config": label, "perplexity": ppl(nlls), "segments": segments, "peak_blocks": max(used),
               "seconds": time.perf_counter() - t0}  # fmt: skip
        past.append(row)
        print(f"{label:>44}: {row['perplexity']:.4f}; per {seg}-token segment "
              f"{', '.join(f'{p:.3f}' for p in segments)}; peak {row['peak_blocks']} blocks", flush=True)  # fmt: skip

    speed = []
    prompt = all_tokens[: args.prompt_tokens]
    for label, policy in policies.items():
        times = {}
        for n in (1, args.gen):
            used.clear()
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, kv_eviction=policy),
                         use_tqdm=False)  # fmt: skip
            times[n] = time.perf_counter() - t0
        row = {"config": label, "prefill_s": times[1], "decode_tok_s": (args.gen - 1) / (times[args.gen] - times[1]),
               "peak_blocks": max(used)}  # fmt: skip
        speed.append(row)
        print(f"{label:>34}: prefill {row['prefill_s']:.2f} s, decode {row['decode_tok_s']:.1f} tok/s, "
              f"peak {row['peak_blocks']} blocks", flush=True)  # fmt: skip

    base = within[0]
    lines = [f"Within the context ({args.context:,} tokens, one sequence, {args.dtype}):", "",
             "| cache | perplexity | vs full | KV blocks held (peak) | memory vs full |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in within:
        lines.append(f"| {r['config']} | {r['perplexity']:.4f} | {r['perplexity'] / base['perplexity'] - 1:+.1%} "
                     f"| {r['peak_blocks']} | {r['peak_blocks'] / base['peak_blocks']:.1%} |")  # fmt: skip
    lines += ["", f"Past the context ({args.long:,} tokens; full cache: \"{full_past[:160]}\"):", "",
              f"| cache | perplexity | per {seg:,}-token segment | KV blocks held (peak) |",
              "|---|---|---|---|"]  # fmt: skip
    for r in past:
        segs = ", ".join(f"{p:.3f}" for p in r["segments"])
        lines.append(f"| {r['config']} | {r['perplexity']:.4f} | {segs} | {r['peak_blocks']} |")
    lines += ["", f"Speed ({args.prompt_tokens:,}-token prompt, {args.gen} generated, greedy, one stream):", "",
              "| cache | prefill s | decode tokens/s | vs full | KV blocks held (peak) |",
              "|---|---|---|---|---|"]  # fmt: skip
    for r in speed:
        lines.append(f"| {r['config']} | {r['prefill_s']:.2f} | {r['decode_tok_s']:.1f} "
                     f"| {r['decode_tok_s'] / speed[0]['decode_tok_s']:.2f}x | {r['peak_blocks']} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    write_json("eviction", {"within": within, "past": past, "speed": speed, "full_past": full_past,
                            "corpus": corpus_digest(text), "block_size": bs, "dtype": args.dtype})  # fmt: skip
    if not args.no_results:
        body = (f"Corpus `english_corpus()` digest {corpus_digest(text)}; block size {bs}; policies at block "
                f"granularity, prefill chunks of one window.\n\n{table}")  # fmt: skip
        append_results("Eviction policies: StreamingLLM and H2O (benchmarks/eviction.py)", body, "torch")


if __name__ == "__main__":
    main()
