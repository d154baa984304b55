"""Paged decode attention on the GPU: effective HBM bandwidth of the Triton kernel.

For decode batches of 1-256 sequences at contexts of 512-8,192 tokens (16-token blocks scattered
through the pool, bfloat16), the time of one layer's decode attention (CUDA events, median of
--repeat) and the bytes it must read (every sequence's K and V once, plus q and out), as GB/s and
as a fraction of the device's peak: the spec-sheet figure where the device is known, and a
device-to-device copy measured in the same run. Two layer shapes: SmolLM2-135M's (9 query heads,
3 KV heads, head size 64) and a Llama-3-8B layer's (32 / 8 / 128).

    python benchmarks/gpu_kernels.py [--repeat 20] [--no-results]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _report import append_results, parse, recording, write_json

from kvpage.attention import AttentionMetadata, get_backend
from kvpage.attention.layer_kv import LayerKV

PEAK_GBS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
            "A100-SXM4-40GB": 1555, "A100": 1555, "L40S": 864, "L4": 300, "A10": 600, "RTX 4090": 1008}  # fmt: skip
SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}
BATCHES = [1, 16, 64, 256]
CONTEXTS = [512, 2048, 8192]
BLOCK = 16


def spec_peak(name: str) -> float | None:
    for key, gbs in PEAK_GBS.items():
        if key in name:
            return float(gbs)
    return None


def timed(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return statistics.median(times)


def copy_bandwidth(repeat: int) -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / timed(lambda: y.copy_(x), repeat) / 1e9


def measure(shape: str, batch: int, context: int, repeat: int) -> dict:
    heads, kv_heads, d = SHAPES[shape]
    per = -(-context // BLOCK)
    num_blocks = batch * per + 1
    kv = LayerKV.allocate((num_blocks, kv_heads, BLOCK, d), torch.bfloat16, "auto", "cuda")
    kv.k.normal_()
    kv.v.normal_()
    order = torch.randperm(num_blocks - 1, device="cpu").tolist()
    tables = [order[i * per : (i + 1) * per] for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, BLOCK, "cuda")
    q = torch.randn(batch, heads, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    backend = get_backend("triton", "cuda")
    seconds = timed(lambda: backend.decodes(out, q, kv, meta, d**-0.5), repeat)
    nbytes = 2 * batch * context * kv_heads * d * 2 + 2 * q.numel() * 2
    return {"shape": shape, "batch": batch, "context": context, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
            "splits": backend._choose_splits(batch * kv_heads, context)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--no-results", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = parse(ap, argv, __file__)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    name = torch.cuda.get_device_name(0)
    peak, copy = spec_peak(name), copy_bandwidth(args.repeat)
    rows = [measure(s, b, c, args.repeat) for s in SHAPES for b in BATCHES for c in CONTEXTS]
    lines = [
        "| layer | batch | context | splits | us | GB/s | of spec peak | of copy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spec = f"{r['gb_per_s'] / peak:.0%}" if peak else "n/a"
        lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['splits']} | {r['seconds'] * 1e6:.0f} | "
                     f"{r['gb_per_s']:.0f} | {spec} | {r['gb_per_s'] / copy:.0%} |")  # fmt: skip
    table = "\n".join(lines)
    print(f"{name}: spec peak {peak} GB/s, device copy {copy:.0f} GB/s\n{table}")
    write_json("gpu_kernels", {"device": name, "spec_peak_gb_s": peak, "copy_gb_s": copy, "rows": rows})
    if recording(args):
        body = (f"{name}; spec peak {peak or 'unknown'} GB/s; a device-to-device copy in the same run: "
                f"{copy:.0f} GB/s. One layer's paged decode attention (bfloat16, {BLOCK}-token blocks in "
                f"random order), median of {args.repeat}; bytes: every K and V once, q, out.\n\n{table}")  # fmt: skip
        append_results("Paged decode attention on the GPU (benchmarks/gpu_kernels.py)", body, "torch", "triton")


if __name__ == "__main__":
    main()
