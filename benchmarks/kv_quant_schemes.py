"""Which scale granularity for quantized KV blocks? Perplexity of SmolLM2 with each scheme we tried,
against the unquantized float32 cache, on the same windows of real English text.

kvpage stores int8 / fp8 blocks with a float32 scale per token and kv head (attention/kv_quant.py).
The alternatives are measured here by fake quantization: each K/V is quantized and dequantized
with the scheme as it is written into a float32 cache (the reference backend's write, patched), so
attention reads exactly what a cache in that format would give back. Every window starts at a
block boundary and every prefill chunk is a multiple of the block size, so a block is written in
one call and the per-block schemes see the whole block (as a scheme that must wait for a block to
fill would; decode, which writes one token at a time, is where per-block scales cannot work).

    python benchmarks/kv_quant_schemes.py [--tokens 8192] [--window 1024] [--chunk 512] [--no-results]
"""

from __future__ import annotations

import argparse
import time

import torch
from _report import append_results, parse, write_json

import kvpage.attention.torch_ref as torch_ref
from kvpage import LLM
from kvpage.tools.perplexity import corpus_digest, english_corpus, perplexity

HEAD_DIM, BLOCK = 64, 16


def _round(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """x / scale quantized to `kind` ("int8", "int4" or "fp8"), times scale again."""
    y = x / scale
    if kind == "fp8":
        return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    qmax = 127.0 if kind == "int8" else 7.0
    return torch.round(y).clamp_(-qmax, qmax) * scale


def per_token(x, blocks, kind, scale_dtype=torch.float32):
    qmax = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}[kind]
    scale = (x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / qmax).to(scale_dtype).float()
    return _round(x, scale, kind)


def _per_block(x, blocks, kind, reduce_dims):
    """One scale per (block, head) (reduce over tokens and head_dim) or per (block, head, channel)."""
    qmax = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}[kind]
    out = torch.empty_like(x)
    for b in torch.unique(blocks).tolist():
        rows = blocks == b
        xb = x[rows]  # [t, heads, d]
        amax = xb.abs().amax(dim=reduce_dims, keepdim=True).clamp_min(1e-12)
        out[rows] = _round(xb, amax / qmax, kind)
    return out


def per_block(x, blocks, kind):
    return _per_block(x, blocks, kind, (0, 2))


def per_channel_block(x, blocks, kind):
    return _per_block(x, blocks, kind, (0,))


# (label, K scheme, V scheme, bytes per token and kv head for K + V, scales included)
SCHEMES = [
    ("int8, scale per token and head, float32 (kvpage's)", lambda x, b: per_token(x, b, "int8"),
     lambda x, b: per_token(x, b, "int8"), 2 * (64 + 4)),
    ("int8, scale per token and head, float16", lambda x, b: per_token(x, b, "int8", torch.float16),
     lambda x, b: per_token(x, b, "int8", torch.float16), 2 * (64 + 2)),
    ("int8, scale per block and head", lambda x, b: per_block(x, b, "int8"),
     lambda x, b: per_block(x, b, "int8"), 2 * (64 + 4 / BLOCK)),
    ("int8, K per channel per block (KIVI), V per token", lambda x, b: per_channel_block(x, b, "int8"),
     lambda x, b: per_token(x, b, "int8"), (64 + 64 * 4 / BLOCK) + (64 + 4)),
    ("fp8 e4m3, scale per token and head (kvpage's)", lambda x, b: per_token(x, b, "fp8"),
     lambda x, b: per_token(x, b, "fp8"), 2 * (64 + 4)),
    ("fp8 e4m3, scale per block and head", lambda x, b: per_block(x, b, "fp8"),
     lambda x, b: per_block(x, b, "fp8"), 2 * (64 + 4 / BLOCK)),
    ("int4, scale per token and head", lambda x, b: per_token(x, b, "int4"),
     lambda x, b: per_token(x, b, "int4"), 2 * (32 + 4)),
    ("int4, K per channel per block (KIVI), V per token", lambda x, b: per_channel_block(x, b, "int4"),
     lambda x, b: per_token(x, b, "int4"), (32 + 64 * 4 / BLOCK) + (32 + 4)),
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--no-results", action="store_true")
    args = parse(ap, None, __file__)
    if args.window % BLOCK or args.chunk % BLOCK:
        raise SystemExit(f"--window and --chunk must be multiples of the block size {BLOCK}")
    llm = LLM("smollm2", dtype="float32", attention_backend="torch", block_size=BLOCK, enable_prefix_caching=False,
              max_num_batched_tokens=args.chunk, max_model_len=max(args.window, 2048))  # fmt: skip
    text = english_corpus()
    tokens = llm.get_tokenizer().encode(text)[: args.tokens]
    original = torch_ref.write_kv
    t0 = time.perf_counter()
    base = perplexity(llm, tokens, window=args.window).perplexity
    print(f"float32 cache: perplexity {base:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = [{"scheme": "float32 (unquantized)", "bytes": 2 * 64 * 4, "perplexity": base}]
    for label, fk, fv, nbytes in SCHEMES:

        def fake_write(k, v, kv, slots, fk=fk, fv=fv):
            blocks = slots // kv.k.shape[2]
            original(fk(k.float(), blocks).to(k.dtype), fv(v.float(), blocks).to(v.dtype), kv, slots)

        torch_ref.write_kv = fake_write
        try:
            p = perplexity(llm, tokens, window=args.window).perplexity
        finally:
            torch_ref.write_kv = original
        rows.append({"scheme": label, "bytes": nbytes, "perplexity": p})
        print(f"{label:>55}: {p:.4f} ({p / base - 1:+.3%}), {nbytes:.1f} bytes per token and head", flush=True)
    lines = ["| K / V scheme | bytes per token and kv head (K+V) | vs float32's 512 | perplexity | vs float32 |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['bytes']:.1f} | {r['bytes'] / 512:.1%} | {r['perplexity']:.4f} "
                     f"| {r['perplexity'] / base - 1:+.3%} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    write_json("kv_quant_schemes", {"rows": rows, "corpus": corpus_digest(text), "tokens": len(tokens),
                                    "window": args.window, "chunk": args.chunk})  # fmt: skip
    if not args.no_results:
        body = (f"Corpus `english_corpus()` digest {corpus_digest(text)}, first {len(tokens):,} tokens, windows of "
                f"{args.window}, prefill chunks of {args.chunk}, float32 model; fake quantization at the write "
                f"(attention reads what the format gives back).\n\n{table}")  # fmt: skip
        append_results("KV quantization schemes compared (benchmarks/kv_quant_schemes.py)", body, "torch")


if __name__ == "__main__":
    main()
