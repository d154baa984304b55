"""KV memory of beam search on shared blocks, against independent copies per beam.

The seed documents claim (GPT-3 175B) that sharing saves 62.5% of beam-search KV memory at width 4
and 71.9% at width 8. Here: SmolLM2 on the paged cache, beam search over a chat prompt, and at every
step the blocks actually used against the logical blocks (the sum of the beams' block tables, which
is what independent copies of each beam would store). Reported at the step of peak use and averaged.

    python benchmarks/beam_memory.py [--max-tokens 64] [--no-results]
"""

from __future__ import annotations

import argparse

from _report import append_results, write_json

from kvpage import LLM, BeamSearchParams

PROMPT = "Explain, step by step, how a hash table handles collisions, and compare two strategies."


def measure(llm: LLM, width: int, max_tokens: int) -> dict:
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    engine.add_request(
        f"beam{width}", prompt, BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    )
    samples = []
    while engine.has_unfinished_requests():
        engine.step()
        st = llm.cache_stats()
        if st.logical_blocks:
            samples.append((st.used_blocks, st.logical_blocks))
    engine.kv_manager.check_invariants()
    peak_used, peak_logical = max(samples)
    return {
        "width": width,
        "prompt_tokens": len(prompt),
        "peak_used_blocks": peak_used,
        "peak_logical_blocks": peak_logical,
        "saving_at_peak": 1 - peak_used / peak_logical,
        "mean_saving": sum(1 - u / lg for u, lg in samples) / len(samples),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args()
    llm = LLM("smollm2", dtype="bfloat16", num_kv_blocks=512, enable_prefix_caching=False)
    seed = {4: "62.5%", 8: "71.9%"}
    rows = [measure(llm, w, args.max_tokens) for w in (1, 2, 4, 8)]
    lines = ["| beam width | blocks used (peak) | independent copies (peak) | saved at peak | saved, mean over steps "
             "| seed documents' claim |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['width']} | {r['peak_used_blocks']} | {r['peak_logical_blocks']} | "
                     f"{r['saving_at_peak']:.1%} | {r['mean_saving']:.1%} | {seed.get(r['width'], '')} |")  # fmt: skip
    print("\n".join(lines))
    write_json("beam_memory", {"rows": rows, "max_tokens": args.max_tokens})
    if not args.no_results:
        body = (f"Beam search over a {rows[0]['prompt_tokens']}-token chat prompt, {args.max_tokens} new tokens, "
                "16-token blocks: blocks used with sharing against the logical blocks that independent per-beam "
                "copies would hold.\n\n" + "\n".join(lines))  # fmt: skip
        append_results("Beam-search memory (benchmarks/beam_memory.py)", body, "torch")


if __name__ == "__main__":
    main()
