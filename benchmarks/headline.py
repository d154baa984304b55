"""The README's headline table, rewritten from the JSON the suite last wrote (benchmarks/results/).

`kvpage bench --suite ...` runs this after a recorded run; by hand: python benchmarks/headline.py.
The table sits between <!-- headline:start --> and <!-- headline:end --> in README.md; each row is
one seed claim, the figure measured here, the plot and the command that measured it.
"""

from __future__ import annotations

import json
from pathlib import Path

from _report import ROOT, out_dir

README = ROOT.parent / "README.md"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"


def _load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _pct(x: float) -> str:
    return f"{x:.1%}"


def rows(results: Path) -> list[tuple[str, str, str, str]]:
    """(claim, the seeds' figure, measured here, name of the benchmark) per claim, where measured."""
    out = []
    d = _load(results, "cache_vs_nocache")
    if d:
        by = {r["context"]: r for r in d["rows"]}
        got = " / ".join(f"{by[c]['speedup']:.1f}x at {c:,}" for c in sorted(by))
        out.append(("KV cache against recomputing without one, decode time per token", "4.8x at 512, 15x at 2,048 "
                    "(A100)", got, "cache_vs_nocache"))  # fmt: skip
        by_n: dict[int, list[float]] = {}
        for r in d.get("short", []):
            by_n.setdefault(r["tokens"], []).append(r["no_cache_s"] / r["paged_s"])
        if by_n:
            got = "; ".join(
                f"{n} token{'s' if n > 1 else ''}: {min(v):.2f}-{max(v):.2f}x" for n, v in sorted(by_n.items())
            )
            out.append(("Short outputs, whole requests (no cache / paged time)", "under 512 tokens no cache may be "
                        "simpler and as efficient", got, "cache_vs_nocache"))  # fmt: skip
    d = _load(results, "paged_vs_static")
    if d:
        p = d["part1"]
        less = 1 - (p["paged_slots"] - p["held"]) / (p["static_slots"] - p["held"])
        out.append(("Waste at 8 concurrent requests, paged vs a static cache", "73% less waste; paged < 4% "
                    "(vLLM paper)", f"paged {_pct(p['paged_waste'])}, static {_pct(p['static_waste'])}: "
                    f"{_pct(less)} less", "paged_vs_static"))  # fmt: skip
        q = d["part2"]
        ratio = q["paged"]["tok_s"] / max(q["static"]["tok_s"], 1e-9)
        out.append((f"Requests at once in one {d['budget']} KV budget", "", f"paged up to {q['paged']['concurrent']}"
                    f", static {q['static']['concurrent']}; {ratio:.2f}x tokens/s", "paged_vs_static"))  # fmt: skip
    d = _load(results, "sharing")
    if d:
        full = max(d["full_sequence"], key=lambda r: (r["n"], -r["gen"]))
        out.append((f"Full-sequence sharing, n = {full['n']} samples of one prompt", "90%+",
                    f"{_pct(full['saved'])} (the most possible {_pct(full['most_saved'])})", "sharing"))  # fmt: skip
        cs = d["customer_service"]
        out.append(("Prefix sharing, customer-service system prompt", "58% on average (40-70%)",
                    f"{_pct(cs['saved'])} (the most possible {_pct(cs['most_saved'])})", "sharing"))  # fmt: skip
        t = d["ttft"]
        out.append(("Time to first token, system prompt warm vs cold", "", f"{t['speedup']:.1f}x faster warm",
                    "sharing"))  # fmt: skip
        quantized = [r for r in d.get("by_kv_dtype", []) if r["kv_cache_dtype"] == "int8"]
        if quantized:
            got = [f"{_pct(r['further'])} ({r['model_dtype']} model)" for r in quantized]
            out.append(("int8 KV on top of paging and prefix sharing, customer service", "a further 50-70%",
                        " / ".join(got), "sharing"))  # fmt: skip
    d = _load(results, "beam_memory")
    if d:
        beam = {r["width"]: r for r in d["rows"] if r["mode"] == "beam" and r["prompt_tokens"] == d["rows"][0][
            "prompt_tokens"]}  # fmt: skip
        got = " / ".join(f"{_pct(beam[w]['saved_vs_contiguous'])} at {w}" for w in (4, 8) if w in beam)
        out.append(("Beam search memory against contiguous copies per beam (peak)", "62.5% at width 4, 71.9% at 8",
                    got, "beam_memory"))  # fmt: skip
    d = _load(results, "block_size")
    if d:
        out.append(("Block size for this workload", f"max(64, 2^floor(log2(avg/4))) = {d['seed_rule']}",
                    f"measured best {d['measured_best']}; `kvpage blocks` {d['advised']}", "block_size"))  # fmt: skip
    d = _load(results, "kv_policies")
    if d:
        base = d["rows"][0]
        int8 = next((r for r in d["rows"] if r["kv_cache_dtype"] == "int8" and r["kv_eviction"] == "none"), None)
        if int8:
            out.append(("int8 KV blocks", "half the memory of fp16, < 1% loss",
                        f"{int8['bytes_per_token'] / base['bytes_per_token']:.2f}x the bytes of {d['args']['dtype']}, "
                        f"perplexity {int8['perplexity'] / base['perplexity'] - 1:+.2%}", "kv_policies"))  # fmt: skip
    d = _load(results, "forward_pass")
    if d:
        dec = [r for r in d["rows"] if r["kind"] == "decode"]
        if dec:
            batch = max(r["batch"] for r in dec)
            backend = "cpu" if any(r["backend"] == "cpu" for r in dec) else dec[0]["backend"]
            got = " / ".join(f"{r['ratio']:.2f} ({r['dtype']})" for r in dec if r["batch"] == batch and
                             r["backend"] == backend)  # fmt: skip
            out.append((f"The machine's limit: forward pass / linear layers alone, decode batch {batch}", "",
                        f"{got}, {backend} backend", "forward_pass"))  # fmt: skip
    d = _load(results, "segments")
    if d:
        by = {r["arm"]: r for r in d["rows"]}
        full = by["full prefill"]
        got = "; ".join(f"{arm}: {full['ttft_ms'] / r['ttft_ms']:.1f}x TTFT, {r['accuracy']:.0%} exact"
                        for arm, r in by.items() if arm != "full prefill")  # fmt: skip
        out.append(("Documents reused at any position (the seeds' research direction), planted facts",
                    "EPIC: up to 8x TTFT against CacheBlend (2.2-3.3x against full prefill)",
                    f"full prefill {full['accuracy']:.0%} exact; {got}", "segments"))  # fmt: skip
    d = _load(results, "read_budget")
    if d:
        shape, row = list(d["speed"].items())[-1]  # the longest contexts
        fid = d["fidelity"]

        def ppl(arm):
            return f"{fid[arm]['perplexity']:.2f}"

        budgets = [a.split()[1] for a in row if a != "full read"]
        got = "; ".join(f"{b} tokens: {row[f'budget {b}'] / row['full read']:.2f}x decode, perplexity "
                        f"{ppl(f'budget {b}')} (StreamingLLM {ppl(f'StreamingLLM {b}')}, H2O {ppl(f'H2O {b}')})"
                        for b in budgets)  # fmt: skip
        out.append((f"Attention that reads only the blocks that matter (Quest), {shape} tokens, perplexity at "
                    f"{d['args']['ppl_context']}", "Quest: 7.03x self-attention, 2.23x end to end at 32k",
                    f"full read: perplexity {ppl('full read')}; {got}", "read_budget"))  # fmt: skip
    d = _load(results, "demotion")
    if d:
        r = d["rows"]

        def p(arm):
            return f"{r[arm]['perplexity']:.2f}"

        def window(b):  # the arm with H2O's recent window (not in runs before it was added)
            arm = f"Demote, H2O's window {b}"
            return f", with H2O's window {p(arm)}" if arm in r else ""

        got = "; ".join(f"{b} tokens' bytes: {p(f'Demote {b}')}{window(b)} (H2O {p(f'H2O {b}')}, StreamingLLM "
                        f"{p(f'StreamingLLM {b}')})" for b in d["budgets"])  # fmt: skip
        out.append((f"Blocks demoted to int8 / int4 instead of dropped, perplexity at {d['args']['ppl_context']} "
                    "tokens at equal memory", "ZipCache: 4.98x compression at -0.38% GSM8k (Mistral-7B)",
                    f"full cache {r['full cache']['perplexity']:.2f}; {got}", "demotion"))  # fmt: skip
    d = _load(results, "tensor_parallel")
    if d:
        base = {r["model"]: r for r in d["rows"] if r["tp"] == 1}

        def tp_row(r):
            b = base[r["model"]]
            return (f"TP={r['tp']} ({r['model'].split(' (')[0]}): per rank KV "
                    f"{r['kv_bytes_per_block'] / b['kv_bytes_per_block']:.2f}x, weights "
                    f"{r['weight_bytes'] / b['weight_bytes']:.2f}x; one stream {r['stream_ms'] / b['stream_ms']:.1f}x "
                    f"slower ({r['stream_coll']:.0%} in all-reduce)")  # fmt: skip

        got = "; ".join(tp_row(r) for r in d["rows"] if r["tp"] > 1)
        out.append((f"Tensor parallelism on {d['cores']} CPU cores (gloo): memory per rank, not speed",
                    "beyond the seeds (vLLM's Megatron-style split)",
                    got, "tensor_parallel"))  # fmt: skip
    d = _load(results, "kv_groups")
    if d:
        g = {(r["model"], r["tokens"]): r for r in d["per_sequence"]}
        n = max(r["tokens"] for r in d["per_sequence"])
        pool = {r["model"]: r for r in d["one_pool"]}["gemma-3-27b"]
        got = (f"Gemma 3 27B at {n:,} tokens: {g[('gemma-3-27b', n)]['ratio']:.3f}x the bytes (gpt-oss-20b "
               f"{g[('gpt-oss-20b', n)]['ratio']:.3f}x, Llama 4 Scout {g[('llama-4-scout', n)]['ratio']:.3f}x); "
               f"{pool['grouped']} sequences of {pool['tokens']:,} tokens in {pool['pool_gib']} GiB against "
               f"{pool['full']}")  # fmt: skip
        out.append(("KV-cache groups (a table per kind of layer) against every layer as full attention",
                    "beyond the seeds (vLLM's hybrid allocator: ~10x KV capacity, Gemma 3)", got,
                    "kv_groups"))  # fmt: skip
    d = _load(results, "structured_outputs")
    if d:
        full = d["rows"][-1]
        got = (f"every row constrained to a JSON schema: {full['vs_free']:.2f}x the unconstrained batch's tokens/s; "
               f"{full['structured_us_per_token']:.0f} µs of masks and matchers per constrained token")  # fmt: skip
        out.append(("Structured outputs (JSON schemas as token masks, xgrammar) in a batch",
                    "beyond the seeds (XGrammar: under 40 µs per token)", got, "structured_outputs"))  # fmt: skip
        one = [r for r in d["jump_forward"] if r["rows"] == 1 and r["jump_forward"]]
        if one:
            got = "; ".join(f"{'compact' if r['compact'] else 'default whitespace'}: {r['speedup']:.2f}x faster, "
                            f"{r['tokens_per_step']:.2f} tokens per step" for r in one)  # fmt: skip
            out.append(("Jump-forward decoding: the text a grammar forces appended in one step (one request, "
                        "long fixed keys)", "beyond the seeds (SGLang: jump-forward decoding)", got,
                        "structured_outputs"))  # fmt: skip
    return out


def table(results: Path) -> str:
    lines = ["| claim | the seeds | measured here | plot, command, date |", "|---|---|---|---|"]
    machines = set()
    for claim, seed, got, name in rows(results):
        meta = (_load(results, name) or {}).get("_meta", {})
        machines.add(meta.get("machine"))
        how = [f"[plot](benchmarks/results/{name}.png)"] if (results / f"{name}.png").exists() else []
        how += [f"`{meta['command']}`"] if "command" in meta else []
        how += [meta["date"][:10]] if "date" in meta else []
        lines.append(f"| {claim} | {seed} | {got} | {', '.join(how)} |")
    machines.discard(None)
    note = f"\n\nMeasured on: {'; '.join(sorted(machines))}." if machines else ""
    return "\n".join(lines) + note


def update_readme(readme: Path, text: str) -> bool:
    body = readme.read_text()
    if START not in body or END not in body:
        return False
    head, rest = body.split(START, 1)
    readme.write_text(head + START + "\n" + text + "\n" + END + rest.split(END, 1)[1])
    return True


def main() -> None:
    text = table(out_dir())
    print(text)
    if not update_readme(README, text):
        print(f"{README} has no {START} ... {END} markers: nothing written")


if __name__ == "__main__":
    main()
