"""Where kvpage's linear kernels stop beating torch's GEMM on this machine: the measurement behind
`LinearPolicy.for_cpu`'s table (kvpage/models/layer_ops.py), one CPU kind at a time.

For each activation dtype, plain and int4/int8 weights, and a sweep of row counts, the linears of all 30
layers of SmolLM2-135M (random weights of its shapes, so the working set is the model's: streamed
from memory as in a real step, not hot in cache) run through the kernel and through what the policy
uses above its bound (torch's GEMM; for quantized weights, dequantize + GEMM). Reported: ms per pass
each way, and the largest row count up to which the kernel is at least as fast. Run it on each kind
(the kind is in the record) and set that kind's row of the table from it.

    python benchmarks/linear_policy.py
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from _report import append_results, parse, write_json

from kvpage.cpu_kind import kind_of
from kvpage.models.dtype_choice import cpu_flags
from kvpage.models.layer_ops import LinearPolicy
from kvpage.models.weight_quant import quantize
from kvpage.ops import load

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
ROWS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128]


def passes(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def sweep(dtype: torch.dtype, bits: int, layers: int, reps: int, rows: list[int]) -> list[dict]:
    k = torch.ops.kvpage
    torch.manual_seed(0)
    weights = []
    for _ in range(layers):
        for n, kk in SHAPES:
            w = torch.randn(n, kk) * 0.02
            weights.append(quantize(w, bits) if bits else w.to(dtype))
    out = []
    for m in rows:
        xs = {kk: torch.randn(m, kk).to(dtype) for kk in (576, 1536)}

        def kernel(xs=xs):
            for w in weights:
                x = xs[w.shape[1]]
                if bits:
                    k.linear_quant(x, w.q, w.scales, w.mins, w.bits, None)
                else:
                    k.linear_rows(x, w, None, False)

        def torch_path(xs=xs):
            for w in weights:
                x = xs[w.shape[1]]
                F.linear(x, k.dequantize_weight(w.q, w.scales, w.mins, w.bits).to(dtype) if bits else w)

        ours, theirs = passes(kernel, reps), passes(torch_path, reps)
        out.append({"rows": m, "kernel_ms": ours, "torch_ms": theirs})
        print(f"{dtype} bits={bits} rows={m}: kernel {ours:.2f} ms, torch {theirs:.2f} ms", flush=True)
    return out


def bound(points: list[dict]) -> int:
    """The largest row count up to which the kernel is never slower (0: torch from the first row)."""
    best = 0
    for p in points:
        if p["kernel_ms"] > p["torch_ms"]:
            break
        best = p["rows"]
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parse(ap, argv, __file__)
    if not load():
        print("the CPU kernels are unavailable here")
        return 1
    kind = kind_of(cpu_flags())
    table = LinearPolicy.for_cpu()
    data, rows = {"kind": kind}, []
    for dtype in (torch.float32, torch.bfloat16):
        for bits in (0, 4, 8):
            points = sweep(dtype, bits, args.layers, args.reps, ROWS)
            name = f"{str(dtype).removeprefix('torch.')} {f'int{bits}' if bits else 'plain'}"
            measured = bound(points)
            now = (table.quantized if bits else table.plain)[dtype]
            data[name] = {"points": points, "bound": measured, "table": now}
            at1 = points[0]["torch_ms"] / points[0]["kernel_ms"]
            rows.append(f"| {name} | {measured} | {min(now, 1 << 20) if now < (1 << 62) else 'unlimited'} | "
                        f"{at1:.2f} |")  # fmt: skip
    text = ("| activations, weights | kernel no slower up to (rows, measured) | the table's bound | torch / kernel "
            "at 1 row |\n|---|---|---|---|\n" + "\n".join(rows))  # fmt: skip
    print(text)
    write_json("linear_policy", data)
    if not args.no_results:
        body = (
            f"CPU kind **{kind}**. All {args.layers} layers' linears of SmolLM2-135M's shapes per pass (the "
            f"model's working set, from memory), {args.reps} passes each, rows {ROWS}.\n\n{text}"
        )
        append_results("Linear kernels against torch's GEMM by rows (benchmarks/linear_policy.py)", body, "torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
