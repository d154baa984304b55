"""How close is one forward pass of the real model to the cost of its matmuls alone?

SmolLM2-135M-Instruct on the paged KV cache, float32 and bfloat16:
  decode   batch 1, 16, 64, 256, each sequence with 256 tokens of context
  prefill  one prompt of 512 tokens
For each shape: tokens/s of the full forward (as the model runner runs it: logits of the last token
of each sequence), next to a bound measured in the same run: the same model's linear layers alone
(q/k/v, o, gate/up, down in every layer, and the lm_head on the same rows), no attention, no cache.
The ratio forward/bound is the figure; the attention share is the time inside the attention backend.
Also the load time of the model: from our conversion cache, converting the GGUF afresh, and
transformers' own GGUF loader (the oracle), in the same run.

    python benchmarks/forward_pass.py [--repeat 3] [--no-transformers] [--no-results] [--kv-cache-dtypes auto,int8]
"""

from __future__ import annotations

import argparse
import time

import torch
from _bound import linears_only, median_time
from _report import append_results, parse, recording, save_plot, suite_args, write_json

from kvpage.core import KVCacheManager
from kvpage.core.scheduler_output import ScheduledSequence, SchedulerOutput
from kvpage.models import load_model
from kvpage.models.dtype_choice import choose_dtype
from kvpage.worker.fused_decode import step_forward
from kvpage.worker.input_builder import build_inputs
from kvpage.worker.kv_cache import KVCache

BLOCK = 16
CONTEXT = 256
DECODE_BATCHES = [1, 16, 64, 256]
PREFILL = 512


class TimedBackend:
    """Wraps an attention backend and adds up the wall time spent inside it."""

    def __init__(self, inner):
        self.inner, self.name, self.seconds = inner, inner.name, 0.0

    def forward(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.inner.forward(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        return out


def step_for(kind: str, batch: int, mgr: KVCacheManager) -> SchedulerOutput:
    """A decode step over `batch` sequences with CONTEXT cached tokens, or one PREFILL-token prompt."""
    seqs = []
    if kind == "decode":
        for i in range(batch):
            mgr.allocate_slots(f"s{i}", CONTEXT + 1)
            seqs.append(ScheduledSequence(f"s{i}", [1], CONTEXT, mgr.block_table(f"s{i}")))
    else:
        mgr.allocate_slots("p", PREFILL)
        seqs.append(ScheduledSequence("p", list(range(PREFILL)), 0, mgr.block_table("p")))
    return SchedulerOutput(seqs)


def measure(lm, kind: str, batch: int, repeat: int, kv_cache_dtype: str = "auto") -> dict:
    model, cfg = lm.model, lm.config
    dtype = next(model.parameters()).dtype
    tokens = batch if kind == "decode" else PREFILL
    num_blocks = (batch * (CONTEXT + 1) if kind == "decode" else PREFILL) // BLOCK + batch + 2
    mgr = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False)
    kv = KVCache(cfg, num_blocks, BLOCK, dtype, kv_cache_dtype=kv_cache_dtype)
    for layer in kv.layers:  # any values do: the cost of attention does not depend on them
        if layer.quantized:
            for t in (layer.k, layer.v):
                t.view(torch.uint8).random_(0, 100)
            layer.k_scale.fill_(0.01)
            layer.v_scale.fill_(0.01)
        else:
            layer.k.normal_()
            layer.v.normal_()
    step = step_for(kind, batch, mgr)
    inputs = build_inputs(step.sequences, BLOCK, "cpu")

    run = step_forward(model)

    @torch.inference_mode()
    def forward():
        hidden = run(inputs.input_ids, inputs.positions, kv.layers, inputs.meta)
        model.compute_logits(hidden[inputs.logits_index])

    t_forward = median_time(forward, repeat)  # as the runner runs it: fused where every sequence decodes
    # the attention share from one pass layer by layer, the backend timed (the fused call has no seams)
    timed = TimedBackend(model.layers[0].self_attn.backend)
    for layer in model.layers:
        layer.self_attn.backend = timed
    t0 = time.perf_counter()
    forward()
    attention_share = timed.seconds / (time.perf_counter() - t0)
    for layer in model.layers:
        layer.self_attn.backend = timed.inner

    rows = len(inputs.logits_seq_ids)
    t_bound = median_time(linears_only(model, tokens, rows), repeat)
    return {
        "kind": kind,
        "batch": batch,
        "tokens": tokens,
        "forward_s": t_forward,
        "bound_s": t_bound,
        "tokens_per_s": tokens / t_forward,
        "bound_tokens_per_s": tokens / t_bound,
        "ratio": t_bound / t_forward,
        "attention_share": attention_share,
    }


def load_times(repeat: int, with_transformers: bool) -> dict:
    out = {"cached_s": median_time(lambda: load_model("smollm2"), repeat)}
    t0 = time.perf_counter()
    load_model("smollm2", use_cache=False)
    out["convert_s"] = time.perf_counter() - t0
    if with_transformers:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers

        from kvpage.models.loader import resolve_model_path

        path = resolve_model_path("smollm2")
        t0 = time.perf_counter()
        transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        out["transformers_s"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> None:
    global CONTEXT, DECODE_BATCHES, PREFILL
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per shape; the median is reported")
    ap.add_argument("--no-transformers", action="store_true", help="skip timing transformers' loader")
    ap.add_argument("--backends", default="cpu,torch", help="attention backends to compare (default cpu,torch)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="dtypes (default float32,bfloat16)")
    ap.add_argument("--weight-dtype", choices=["int8", "int4"], default=None, help="weight-only quantization")
    ap.add_argument("--kv-cache-dtypes", default="auto", help="KV dtypes to compare, e.g. auto,int8 (default auto)")
    ap.add_argument("--context", type=int, default=CONTEXT, help=f"cached tokens per decode (default {CONTEXT})")
    ap.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)), help="decode batch sizes")
    suite_args(ap)
    args = parse(ap, argv, __file__)
    if args.quick:
        args.repeat, args.no_transformers, args.dtypes = 2, True, choose_dtype("auto")[0]
        args.batches = "1,64,256"
    if args.smoke:
        args.repeat, args.no_transformers, args.dtypes, args.backends = 1, True, "float32", "torch"
        args.batches, args.context, PREFILL = "1,4", 32, 32
    CONTEXT, DECODE_BATCHES = args.context, [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    rows = []
    header = "| backend | dtype | shape | tokens/s | linear-only bound tokens/s | forward/bound | attention share |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            lm = load_model("smollm2", dtype=dtype, backend=backend, weight_dtype=args.weight_dtype)
            shapes = [("decode", b) for b in DECODE_BATCHES] + [("prefill", 1)]
            for (kind, batch), kv_dtype in ((sh, kvd) for sh in shapes for kvd in args.kv_cache_dtypes.split(",")):
                label = f"{dtype}, {args.weight_dtype} weights" if args.weight_dtype else dtype
                label += f", {kv_dtype} KV" if kv_dtype != "auto" else ""
                r = measure(lm, kind, batch, args.repeat, kv_dtype) | {"dtype": label, "backend": backend}
                rows.append(r)
                shape = f"decode batch {batch}, context {CONTEXT}" if kind == "decode" else f"prefill {PREFILL}"
                lines.append(
                    f"| {backend} | {label} | {shape} | {r['tokens_per_s']:,.0f} | {r['bound_tokens_per_s']:,.0f} | "
                    f"{r['ratio']:.2f} | {r['attention_share']:.0%} |"
                )
                print(lines[-1], flush=True)
    loads = {"cached_s": 0.0, "convert_s": 0.0} if args.smoke else load_times(args.repeat, not args.no_transformers)
    load_line = (
        f"Load time of SmolLM2-135M-Instruct (float32): {loads['cached_s']:.2f} s from kvpage's conversion cache, "
        f"{loads['convert_s']:.2f} s converting the GGUF afresh"
        + (f", {loads['transformers_s']:.1f} s with transformers' GGUF loader" if "transformers_s" in loads else "")
        + "."
    )
    print(load_line)
    write_json("forward_pass", {"rows": rows, "load": loads, "block_size": BLOCK})
    _plot(rows)
    if recording(args):
        body = (
            "Forward pass of SmolLM2-135M-Instruct on the paged cache (16-token blocks), per attention backend "
            "(cpu: kvpage's compiled kernels; torch: the reference), against the same model's linear layers "
            "alone at the same shapes, run as the model runs them.\n\n" + "\n".join(lines) + f"\n\n{load_line}\n"
        )
        append_results("Forward pass (benchmarks/forward_pass.py)", body, "torch", "transformers", key="forward_pass")


def _plot(rows) -> None:
    panels = sorted({(r["backend"], r["dtype"]) for r in rows})

    def draw(plt):
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        for ax, (backend, dtype) in zip(axes[0], panels, strict=True):  # dtype: the row's label
            sel = [r for r in rows if (r["backend"], r["dtype"]) == (backend, dtype)]
            labels = [f"dec {r['batch']}" if r["kind"] == "decode" else f"pre {r['tokens']}" for r in sel]
            xs = range(len(sel))
            ax.bar([x - 0.2 for x in xs], [r["tokens_per_s"] for r in sel], 0.4, label="forward")
            ax.bar([x + 0.2 for x in xs], [r["bound_tokens_per_s"] for r in sel], 0.4, label="linear layers only")
            ax.set_xticks(list(xs), labels)
            ax.set_yscale("log")
            ax.set_title(f"SmolLM2-135M {dtype}, {backend}: tokens/s")
            ax.legend()
        return fig

    save_plot("forward_pass", draw)


if __name__ == "__main__":
    main()
