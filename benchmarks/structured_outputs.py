"""Issue 46: what structured outputs cost, on SmolLM2 through the engine (the model's default dtype on this CPU).

  batch       output tokens/s of one batch of chat requests with 0, 50 and 100% of its rows constrained to a
              JSON schema (the others free; every row greedy, at most `--tokens` new tokens, free rows ignoring
              EOS), beside the unconstrained batch
  mask cost   per constrained token: the step's masks (xgrammar fills a bitmask per row, unpacked once) and the
              matchers kept at their sequences' tokens, in microseconds, beside a decode step's time
  jump        jump-forward decoding (jump_forward=True) against none, on a schema with long fixed keys, one
              request and a batch, with the schema's default whitespace and compact: steps, output tokens per
              step and time to the whole answer

Grammars are compiled before the timed runs (compiling is off the engine's thread and cached: see
benchmarks/grammar_engines.py for what it costs). XGrammar's own paper (arXiv 2411.15100) puts its mask under
40 us per token.

    python benchmarks/structured_outputs.py [--quick | --smoke] [--no-results]
"""

from __future__ import annotations

import argparse
import time

from _report import append_results, parse, recording, save_plot, suite_args, write_json

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 16}, "hobbies": {"type": "array", "items": {"type": "string",
    "maxLength": 12}, "maxItems": 3}}, "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False}  # fmt: skip
SHARES = (0.0, 0.5, 1.0)
KEYS = ["customer_full_name", "shipping_address_first_line", "preferred_delivery_weekday", "number_of_items_ordered"]
ORDER = {"type": "object", "properties": {KEYS[0]: {"type": "string", "maxLength": 20},
         KEYS[1]: {"type": "string", "maxLength": 24}, KEYS[2]: {"enum": ["monday", "tuesday", "wednesday"]},
         KEYS[3]: {"type": "integer", "minimum": 1, "maximum": 9}}, "required": KEYS,
         "additionalProperties": False}  # fmt: skip


class _Timer:
    """Wall time spent in the engine's structured-output work (masks, matchers), and the rows it served."""

    def __init__(self, engine) -> None:
        from kvpage.structured import matchers

        self.seconds, self.rows = 0.0, 0
        structured, sync = engine.structured, matchers.RequestMatchers.sync
        allowed = structured.allowed

        def timed_allowed(ms):
            t0 = time.perf_counter()
            try:
                return allowed(ms)
            finally:
                self.seconds += time.perf_counter() - t0
                self.rows += len(ms)

        def timed_sync(m, wanted):
            t0 = time.perf_counter()
            try:
                return sync(m, wanted)
            finally:
                self.seconds += time.perf_counter() - t0

        structured.allowed = timed_allowed
        matchers.RequestMatchers.sync = timed_sync
        self._restore = lambda: setattr(matchers.RequestMatchers, "sync", sync)

    def close(self) -> None:
        self._restore()


def run(llm, n: int, share: float, tokens: int) -> dict:
    from kvpage import SamplingParams

    chats = [[{"role": "user", "content": f"Describe person number {i} (a name, an age, a city, hobbies)."}]
             for i in range(n)]  # fmt: skip
    k = round(share * n)
    free = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=tokens, structured_outputs={"json": PERSON})
    params = [constrained] * k + [free] * (n - k)
    timer = _Timer(llm.llm_engine)
    try:
        t0 = time.perf_counter()
        steps0 = llm.llm_engine.num_steps
        outs = llm.chat(chats, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = llm.llm_engine.num_steps - steps0
    finally:
        timer.close()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    constrained_tokens = sum(len(o.outputs[0].token_ids) for o in outs[:k])
    valid = sum(o.outputs[0].finish_reason == "stop" for o in outs[:k])
    return {"share": share, "rows": n, "constrained_rows": k, "output_tokens": out_tokens, "seconds": wall,
            "tok_s": out_tokens / wall, "steps": steps, "step_ms": 1e3 * wall / max(steps, 1),
            "constrained_tokens": constrained_tokens, "finished_by_grammar": valid,
            "structured_us_per_token": 1e6 * timer.seconds / constrained_tokens if constrained_tokens else 0.0,
            "structured_share": timer.seconds / wall}  # fmt: skip


def jump(llms: dict, n: int, tokens: int, repeats: int = 3) -> list[dict]:
    """Jump-forward off and on (`llms`: jump_forward -> LLM), one request and a batch of `n`, the schema's default
    whitespace and compact: steps, output tokens, tokens per step, seconds; the best of `repeats` runs."""
    import json

    from kvpage import SamplingParams

    out = []
    for compact in (False, True):
        for rows in (1, n):
            chats = [[{"role": "user", "content": f"Reply with JSON describing order {i} from a customer in "
                       "Paris."}] for i in range(rows)]  # fmt: skip
            spec = {"json": ORDER, "disable_any_whitespace": compact}
            params = SamplingParams(temperature=0.0, max_tokens=tokens, structured_outputs=spec)
            texts = {}
            for on, llm in llms.items():
                engine = llm.llm_engine
                llm.chat(chats[:1], params, use_tqdm=False)  # (compiled, warm)
                best = None
                for _ in range(repeats):
                    steps0, t0 = engine.num_steps, time.perf_counter()
                    got = llm.chat(chats, params, use_tqdm=False)
                    wall, steps = time.perf_counter() - t0, engine.num_steps - steps0
                    best = wall if best is None or wall < best else best
                toks = sum(len(o.outputs[0].token_ids) for o in got)
                valid = sum(o.outputs[0].finish_reason == "stop" and isinstance(json.loads(o.outputs[0].text), dict)
                            for o in got)  # fmt: skip
                texts[on] = [o.outputs[0].text for o in got]
                out.append({"compact": compact, "rows": rows, "jump_forward": on, "steps": steps,
                            "output_tokens": toks, "chars": sum(map(len, texts[on])),
                            "tokens_per_step": toks / steps / rows, "seconds": best, "valid": valid})  # fmt: skip
            out[-1]["same_text"] = sum(a == b for a, b in zip(texts[False], texts[True], strict=True))
            out[-1]["speedup"] = out[-2]["seconds"] / out[-1]["seconds"]
    return out


def jump_table(rows: list[dict]) -> str:
    lines = ["| JSON | requests | jump-forward | steps | output tokens (characters) | tokens per step per request | "
             "time | speed-up | answers with the same text as without |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        on = r["jump_forward"]
        gain = f"{r['speedup']:.2f}x" if on else ""
        same = f"{r['same_text']} of {r['rows']}" if on else ""
        json_kind = "compact" if r["compact"] else "default whitespace"
        lines.append(f"| {json_kind} | {r['rows']} | {'on' if on else 'off'} | {r['steps']} | {r['output_tokens']} "
                     f"({r['chars']}) | "
                     f"{r['tokens_per_step']:.2f} | {r['seconds']:.2f} s | {gain} | {same} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    suite_args(ap)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    args = parse(ap, argv, __file__)
    from kvpage import LLM, SamplingParams

    n, tokens = (2, 8) if args.smoke else (8, 64) if args.quick else (args.rows, args.tokens)
    llm = LLM("smollm2", max_num_seqs=max(n, 8))
    warm = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"json": PERSON})
    llm.chat([[{"role": "user", "content": "Hi"}]], warm, use_tqdm=False)  # (the grammar compiled and cached)
    rows = [run(llm, n, share, tokens) for share in SHARES]
    jumping = LLM("smollm2", max_num_seqs=max(n, 8), jump_forward=True)
    jumps = jump({False: llm, True: jumping}, n, 2 * tokens, repeats=1 if args.smoke else 3)
    base = rows[0]["tok_s"]
    for r in rows:
        r["vs_free"] = r["tok_s"] / base
    lines = ["| constrained rows | output tok/s | vs none constrained | step ms | structured work per "
             "constrained token | share of the run's time | rows the grammar ended |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['constrained_rows']} of {r['rows']} | {r['tok_s']:.1f} | {r['vs_free']:.2f}x | "
                     f"{r['step_ms']:.1f} | {r['structured_us_per_token']:.0f} µs | {r['structured_share']:.1%} | "
                     f"{r['finished_by_grammar']} of {r['constrained_rows']} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    print(jump_table(jumps))
    reference = "XGrammar (arXiv 2411.15100): under 40 us per token"
    facts = {"dtype": llm.llm_engine.dtype_name, "mask_reference": reference}
    write_json("structured_outputs", {"rows": rows, "jump_forward": jumps, **facts})

    def draw(plt):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([f"{r['constrained_rows']}/{r['rows']}" for r in rows], [r["tok_s"] for r in rows], color="#4c72b0")
        ax.set_xlabel("rows constrained to a JSON schema")
        ax.set_ylabel("output tokens/s")
        ax.set_title("Structured outputs: a batch's throughput (SmolLM2)")
        for i, r in enumerate(rows):
            ax.annotate(f"{r['structured_us_per_token']:.0f} µs/tok", (i, r["tok_s"]), ha="center", va="bottom")
        fig.tight_layout()
        return fig

    save_plot("structured_outputs", draw)
    if recording(args):
        body = (f"SmolLM2 ({llm.llm_engine.dtype_name}), {n} chat requests in one batch, greedy, at most {tokens} new "
                f"tokens; constrained rows follow a JSON schema (grammar compiled before the timing). Structured "
                f"work = the step's masks and the matchers kept at their tokens. Plot "
                f"`benchmarks/results/structured_outputs.png`.\n\n{table}\n\nJump-forward decoding "
                f"(`jump_forward=True`) against none: a schema of four long fixed keys, greedy, at most {2 * tokens} "
                f"new tokens, one request and a batch of {n}, the JSON's whitespace free (the default) or compact "
                f"(`disable_any_whitespace`); best of 3 runs. The answers' text differs (the model reads the keys in "
                f"the tokenizer's own spelling, not the odd ones it picks under a mask): characters beside tokens."
                f"\n\n{jump_table(jumps)}")  # fmt: skip
        title = "Structured outputs: a batch's throughput and the mask's cost (benchmarks/structured_outputs.py)"
        append_results(title, body, "xgrammar", "torch", key="structured_outputs")


if __name__ == "__main__":
    main()
