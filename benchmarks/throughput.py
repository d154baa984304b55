"""Offline throughput: kvpage against transformers' batched generate, on the same model and dtype.

Workload: --num-requests requests (default 256) with prompt lengths uniform in [32, 512] and output
lengths uniform in [32, 256], drawn from a seeded generator; random prompt tokens; greedy,
ignore_eos (every request produces exactly its output length).

  kvpage        all requests submitted at once; continuous batching over the paged cache
  transformers  batches of --hf-batch (16) in arrival order, left padded, generate() until the
                longest output of the batch; each of its attention implementations (sdpa, eager)

Reports output tokens/s (only the tokens the requests asked for), the ratio kvpage / the faster
transformers configuration, whether transformers' padded batches return the same tokens as the same
prompts run unpadded, and kvpage's per-step split between the model forward and the Python-side work
(scheduling, block bookkeeping, input building, sampling, detokenization), over the steps that ran
with the most sequences.

    python benchmarks/throughput.py [--num-requests 256] [--skip-hf] [--hf-attn sdpa] [--no-results]
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
from _report import append_results, parse, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 49000) for _ in range(rng.randint(32, 512))], rng.randint(32, 256)) for _ in range(n)]


def run_kvpage(reqs, dtype: str, device: str = "cpu") -> dict:
    from kvpage import LLM, SamplingParams

    llm = LLM("smollm2", dtype=dtype, device=device, kv_cache_memory="6GiB", max_num_seqs=256,
              max_num_batched_tokens=2048, enable_prefix_caching=False)  # fmt: skip
    engine = llm.llm_engine
    for i, (prompt, out_len) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    steps = []
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        running = engine.scheduler.num_running_seqs()
        e0, r0 = dict(engine.timings), dict(engine.runner.timings)
        s0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        total = time.perf_counter() - s0
        forward = engine.runner.timings["forward"] - r0["forward"]
        steps.append({"running": running, "total": total, "forward": forward,
                      "schedule": engine.timings["schedule"] - e0["schedule"],
                      "prepare": engine.runner.timings["prepare"] - r0["prepare"],
                      "copy": engine.runner.timings["copy"] - r0["copy"],
                      "sample": engine.timings["sample"] - e0["sample"]})  # fmt: skip
    elapsed = time.perf_counter() - t0
    assert sorted(len(t) for t in tokens.values()) == sorted(o for _, o in reqs)
    engine.kv_manager.check_invariants()
    peak = max(s["running"] for s in steps)
    busy = [s for s in steps if s["running"] >= 0.8 * peak]  # the steps that ran close to the peak batch
    split = {k: sum(s[k] for s in busy) for k in ("total", "forward", "schedule", "prepare", "sample", "copy")}
    return {
        "seconds": elapsed,
        "output_tokens": sum(o for _, o in reqs),
        "steps": len(steps),
        "preemptions": engine.scheduler.num_preemptions,
        "peak_running": peak,
        "busy_steps": len(busy),
        "split": split,
        "python_share": 1 - split["forward"] / split["total"],
    }


def run_hf(reqs, dtype, impl: str, batch: int, device: str = "cpu") -> dict:
    import transformers

    from kvpage.models.loader import resolve_model_path

    path = resolve_model_path("smollm2")
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype, attn_implementation=impl
        )
        .eval()
        .to(device)
    )
    pad = 2
    useful = 0
    t0 = time.perf_counter()
    first_batch_tokens = None
    for b in range(0, len(reqs), batch):
        chunk = reqs[b : b + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
        n = max(o for _, o in chunk)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=pad)  # fmt: skip
        useful += sum(o for _, o in chunk)
        if first_batch_tokens is None:
            first_batch_tokens = out[:, width:].tolist()
    elapsed = time.perf_counter() - t0
    # are the padded rows right? the same prompts, one at a time, unpadded, first 16 tokens
    agree = 0
    for (p, _), row in zip(reqs[:batch], first_batch_tokens, strict=True):
        with torch.no_grad():
            single = model.generate(torch.tensor([p], device=device),
                                    attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                                    max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None,
                                    pad_token_id=pad)[0, len(p):].tolist()  # fmt: skip
        agree += single == row[:16]
    return {"impl": impl, "seconds": elapsed, "output_tokens": useful, "padded_rows_correct": agree,
            "rows_checked": len(first_batch_tokens)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--dtype", default="auto", help="auto (default: what kvpage picks on this CPU), float32, bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: both engines on it")
    ap.add_argument("--skip-hf", action="store_true", help="measure kvpage only")
    ap.add_argument("--hf-attn", nargs="+", default=["sdpa", "eager"], help="transformers attention implementations")
    ap.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parse(ap, None, __file__)
    if args.dtype == "auto":
        from kvpage.models import choose_dtype

        args.dtype = choose_dtype("auto", args.device)[0]
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    reqs = workload(args.num_requests, args.seed)
    ours = run_kvpage(reqs, args.dtype, args.device)
    ours_tps = ours["output_tokens"] / ours["seconds"]
    sp = ours["split"]
    lines = [
        f"Workload: {len(reqs)} requests, prompts {min(len(p) for p, _ in reqs)}-{max(len(p) for p, _ in reqs)} "
        f"tokens, outputs {min(o for _, o in reqs)}-{max(o for _, o in reqs)} tokens "
        f"({ours['output_tokens']} in all), greedy, ignore_eos, {args.dtype}"
        + (f", both engines on {torch.cuda.get_device_name(0)}." if args.device != "cpu" else "."),
        "",
        "| engine | seconds | output tokens/s | ratio to kvpage | padded batches correct |",
        "|---|---|---|---|---|",
        f"| kvpage (continuous batching, paged KV) | {ours['seconds']:.1f} | {ours_tps:.1f} | 1.00 | n/a |",
    ]
    print(lines[-1], flush=True)
    hf_runs = []
    if not args.skip_hf:
        for impl in args.hf_attn:
            r = run_hf(reqs, torch_dtype, impl, args.hf_batch, args.device)
            hf_runs.append(r)
            tps = r["output_tokens"] / r["seconds"]
            lines.append(f"| transformers generate, batch {args.hf_batch}, left padded, attn={impl} | "
                         f"{r['seconds']:.1f} | {tps:.1f} | {tps / ours_tps:.2f} | "
                         f"{r['padded_rows_correct']}/{r['rows_checked']} rows |")  # fmt: skip
            print(lines[-1], flush=True)
    summary = []
    if hf_runs:
        best = max(hf_runs, key=lambda r: r["output_tokens"] / r["seconds"])
        speedup = ours_tps / (best["output_tokens"] / best["seconds"])
        summary.append(f"kvpage / fastest transformers ({best['impl']}): {speedup:.2f}x (target: >= 4x).")
    busy = ours["busy_steps"]
    summary.append(
        f"kvpage per-step split over the {busy} steps with {int(0.8 * ours['peak_running'])}-{ours['peak_running']} "
        "running sequences: "
        f"forward {sp['forward'] / sp['total']:.1%}, scheduling {sp['schedule'] / sp['total']:.1%}, "
        f"input building {sp['prepare'] / sp['total']:.1%}, sampling + detokenization + stop checks "
        f"{sp['sample'] / sp['total']:.1%}, block copies {sp['copy'] / sp['total']:.1%}; "
        f"Python-side work {ours['python_share']:.1%} of step time (target: < 10%). "
        f"{ours['steps']} steps, {ours['preemptions']} preemptions."
    )
    print("\n".join(summary))
    write_json("throughput", {"kvpage": ours, "transformers": hf_runs, "num_requests": len(reqs)})
    if not args.no_results:
        append_results("Offline throughput (benchmarks/throughput.py)", "\n".join(lines + [""] + summary),
                       "torch", "transformers")  # fmt: skip


if __name__ == "__main__":
    main()
