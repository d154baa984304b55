"""KV dtypes side by side: memory, accuracy and speed of kv_cache_dtype "auto", "int8" and "fp8".

memory    blocks (and tokens) a 512 MiB cache holds; bytes per block, scales included
accuracy  perplexity over the first --tokens of `english_corpus()` (windows of --window tokens,
          prefilled in chunks of --chunk so later chunks read earlier ones back from the cache);
          greedy agreement with the unquantized cache: the share of identical tokens over 8
          prompts x --gen tokens (positions after a first difference count as different)
speed     decode tokens/s of --batch sequences x --gen tokens (prompts of 128 random tokens)

  python benchmarks/kv_dtypes.py [--dtype float32] [--tokens 24576] [--no-results]
"""

from __future__ import annotations

import argparse
import random
import time

from _report import append_results, parse, write_json

from kvpage import LLM, SamplingParams
from kvpage.tools.perplexity import corpus_digest, english_corpus, perplexity

QUESTIONS = ["What is the capital of France?", "Write a haiku about memory pages.",
             "Explain in two sentences why the sky is blue.", "List three prime numbers larger than 100.",
             "Tell me about the history of Rome.", "How does a hash table work?",
             "Give me a recipe for pancakes.", "How is a list different from a tuple in Python?"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", help="the model's dtype (default float32)")
    ap.add_argument("--tokens", type=int, default=24576, help="corpus tokens scored (default 24576)")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64, help="generated tokens per prompt (default 64)")
    ap.add_argument("--batch", type=int, default=64, help="sequences in the speed run (default 64)")
    ap.add_argument("--no-results", action="store_true")
    args = parse(ap, None, __file__)
    text = english_corpus()
    rows, ref = [], None
    for kind in ("auto", "int8", "fp8"):
        llm = LLM("smollm2", dtype=args.dtype, kv_cache_dtype=kind, kv_cache_memory="512MiB",
                  max_num_batched_tokens=args.chunk, max_model_len=2048)  # fmt: skip
        tok, st = llm.get_tokenizer(), llm.cache_stats()
        ids = tok.encode(text)[: args.tokens]
        t0 = time.perf_counter()
        ppl = perplexity(llm, ids, window=args.window)
        ppl_s = time.perf_counter() - t0
        greedy = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
        outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], greedy, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        ref = ref or tokens
        same = sum(a == b for x, y in zip(ref, tokens, strict=True) for a, b in zip(x, y, strict=True))
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 40000) for _ in range(128)] for _ in range(args.batch)]
        t0 = time.perf_counter()
        llm.generate(prompts, greedy, use_tqdm=False)
        speed = args.batch * args.gen / (time.perf_counter() - t0)
        row = {"kv_cache_dtype": kind, "bytes_per_block": st.bytes_per_block, "blocks": st.total_blocks,
               "perplexity": ppl.perplexity, "tokens": ppl.tokens, "perplexity_seconds": ppl_s,
               "greedy_agreement": same / sum(len(x) for x in ref), "decode_tokens_per_s": speed}  # fmt: skip
        rows.append(row)
        print(row, flush=True)
        del llm
    base = rows[0]
    lines = ["| kv_cache_dtype | bytes / block | blocks in 512 MiB | vs auto | perplexity | change | greedy agreement "
             "| tokens/s (prefill+decode, batch) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['kv_cache_dtype']} | {r['bytes_per_block']:,} | {r['blocks']:,} | "
                     f"{r['blocks'] / base['blocks']:.2f}x | {r['perplexity']:.4f} | "
                     f"{r['perplexity'] / base['perplexity'] - 1:+.3%} | {r['greedy_agreement']:.1%} | "
                     f"{r['decode_tokens_per_s']:.1f} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    write_json("kv_dtypes", {"rows": rows, "dtype": args.dtype, "corpus": corpus_digest(text)})
    if not args.no_results:
        what = (f"model dtype {args.dtype}; perplexity over {base['tokens']:,} scored tokens of `english_corpus()` "
                f"(digest {corpus_digest(text)}), windows of {args.window}, chunks of {args.chunk}; greedy "
                f"agreement over 8 chat prompts x {args.gen} tokens; speed: {args.batch} random 128-token prompts "
                f"x {args.gen} tokens")  # fmt: skip
        append_results("KV dtypes: memory, accuracy, speed (benchmarks/kv_dtypes.py)", f"{what}.\n\n{table}", "torch")


if __name__ == "__main__":
    main()
