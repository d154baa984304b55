"""Perplexity of SmolLM2 through the engine on real English text, for each precision of the model:
float32, bfloat16, and the weight-only quantized linears (int8 / int4), so that the accuracy cost
of each speed option is a number beside its tokens/s.

The text is `kvpage.tools.perplexity.english_corpus()` (Python's LICENSE and standard-library
docstrings: on every machine, no download), cut into non-overlapping windows of --window tokens,
scored with prompt_logprobs, prefilled in chunks of --chunk tokens (so the paged cache is read back).

    python benchmarks/perplexity.py [--tokens 24576] [--window 1024] [--chunk 512] [--no-results]
"""

from __future__ import annotations

import argparse
import time

from _report import append_results, parse, write_json

from kvpage import LLM
from kvpage.tools.perplexity import corpus_digest, english_corpus, perplexity

CONFIGS = [  # (label, LLM kwargs)
    ("float32", dict(dtype="float32")),
    ("bfloat16", dict(dtype="bfloat16")),
    ("float32, int8 weights", dict(dtype="float32", weight_dtype="int8")),
    ("float32, int4 weights", dict(dtype="float32", weight_dtype="int4")),
    ("bfloat16, int8 weights", dict(dtype="bfloat16", weight_dtype="int8")),
    ("bfloat16, int4 weights", dict(dtype="bfloat16", weight_dtype="int4")),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=24576, help="tokens of the corpus to score (default 24576)")
    ap.add_argument("--window", type=int, default=1024, help="tokens per window (default 1024)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk, max_num_batched_tokens (default 512)")
    ap.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parse(ap, None, __file__)
    text = english_corpus()
    rows = []
    tokens = None
    for label, kw in CONFIGS:
        llm = LLM("smollm2", max_num_batched_tokens=args.chunk, max_model_len=max(args.window, 2048), **kw)
        if tokens is None:
            all_tokens = llm.get_tokenizer().encode(text)
            tokens = all_tokens[: args.tokens]
            print(f"corpus {corpus_digest(text)}: {len(text):,} characters, {len(all_tokens):,} tokens; "
                  f"scoring {len(tokens):,}")  # fmt: skip
        t0 = time.perf_counter()
        r = perplexity(llm, tokens, window=args.window)
        seconds = time.perf_counter() - t0
        rows.append({"config": label, "perplexity": r.perplexity, "mean_nll": r.mean_nll, "tokens": r.tokens,
                     "windows": r.windows, "seconds": seconds})  # fmt: skip
        print(f"{label:>24}: perplexity {r.perplexity:.4f} over {r.tokens:,} tokens ({seconds:.1f} s)", flush=True)
        del llm
    base = {"float32": rows[0]["perplexity"], "bfloat16": rows[1]["perplexity"]}
    lines = ["| model precision | perplexity | vs float32 | vs its activation dtype's unquantized |",
             "|---|---|---|---|"]  # fmt: skip
    for row in rows:
        act = "bfloat16" if row["config"].startswith("bfloat16") else "float32"
        lines.append(f"| {row['config']} | {row['perplexity']:.4f} | {row['perplexity'] / base['float32'] - 1:+.3%} "
                     f"| {row['perplexity'] / base[act] - 1:+.3%} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    write_json("perplexity", {"rows": rows, "corpus": corpus_digest(text), "window": args.window,
                              "chunk": args.chunk})  # fmt: skip
    if not args.no_results:
        what = f"first {len(tokens):,} tokens, windows of {args.window}, prefill chunks of {args.chunk}"
        corpus = f"Corpus `english_corpus()` digest {corpus_digest(text)}"
        body = f"{corpus}, {what}; KV cache in the activation dtype.\n\n{table}"
        append_results("Perplexity by model precision (benchmarks/perplexity.py)", body, "torch")


if __name__ == "__main__":
    main()
