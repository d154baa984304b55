"""kvpage next to llama.cpp on the same work, in the same run: the servers, one stream, time to first token.

The same seeded requests go through the official `openai` client (streaming completions, greedy,
ignore_eos, so each request yields exactly its max_tokens) to `kvpage serve` and to llama.cpp's
`llama-server` with `-np` equal to the concurrency, one server at a time:
  - output tokens/s, time to first token p50/p99, inter-token latency p50, at each --concurrency;
  - time to first token of one 760-token prompt, cold, then again (prefix cache warm; the median of 5);
  - at concurrency 1 also kvpage's Python API and transformers' `generate` on the same requests
    (what the server path costs; the ">= 2x transformers" target).
llama-server runs the model's GGUF at the precision asked (--llama-types): F32 and BF16 are made
from the shipped Q4_1 file with llama-quantize (the same de-quantized values kvpage computes with),
Q4_1 is the shipped file. Binaries come from benchmarks/peers/build_llama_server.sh (built on first
use, ~10 minutes on 2 cores).

    python benchmarks/peers.py --concurrency 1 16 64 --kvpage-dtypes auto --llama-types F32 Q4_1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _report import append_results, parse, write_json
from serving import free_port, make_client, run_api, run_load, start_server, wait_healthy, workload

ROOT = Path(__file__).resolve().parent
THREADS = os.cpu_count() or 2


def llama_binaries() -> Path:
    out = subprocess.run(["bash", str(ROOT / "peers" / "build_llama_server.sh")], check=True, capture_output=True,
                         text=True).stdout.strip().splitlines()[-1]  # fmt: skip
    return Path(out).parent


def gguf_of(kind: str, bindir: Path) -> Path:
    from kvpage.models.loader import resolve_model_path

    shipped = resolve_model_path("smollm2")
    if kind == "Q4_1":
        return shipped
    out = bindir.parent.parent / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if not out.exists():
        subprocess.run([str(bindir / "llama-quantize"), "--allow-requantize", str(shipped), str(out), kind],
                       check=True, capture_output=True)  # fmt: skip
    return out


def start_llama(
    bindir: Path, gguf: Path, parallel: int, ctx_per_slot: int, extra: list[str]
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(bindir / "llama-server"), "-m", str(gguf), "--port", str(port), "-np", str(parallel),
           "-c", str(parallel * ctx_per_slot), "-t", str(THREADS), "-tb", str(THREADS), "--log-disable",
           *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return wait_healthy(proc, port, f"llama-server ({' '.join(cmd)})")


def long_prompt(words: int = 760, seed: int = 7) -> str:
    """760 tokens of text (SmolLM2's tokenizer makes one token of each word of this vocabulary)."""
    return workload(1, seed, (words, words), (1, 1))[0][0]


WARM_REPEATS = 5  # the warm TTFT is a few tens of ms: one sample is mostly noise, the median of 5 is not


async def ttft_once(url: str, prompt: str) -> float:
    client = make_client(url)
    t0 = time.perf_counter()
    stream = await client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})  # fmt: skip
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - t0
    await client.close()
    return first if first is not None else float("nan")


def run_transformers(reqs, dtype: str) -> dict:
    """transformers' generate in `dtype`, one request at a time (greedy, ignore_eos by min_new_tokens),
    after one warm-up request (its first call pays one-off costs that kvpage's warm-up also pays)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from kvpage.models.loader import resolve_model_path

    path = resolve_model_path("smollm2")
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=getattr(torch, dtype)).eval()  # fmt: skip

    def generate(prompt, n):
        ids = tok(prompt, return_tensors="pt").input_ids
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False).shape[1] - ids.shape[1]

    with torch.inference_mode():
        generate(reqs[0][0], 4)
        tokens, t0 = 0, time.perf_counter()
        for prompt, n in reqs:
            tokens += generate(prompt, n)
    return {"output_tokens_per_s": tokens / (time.perf_counter() - t0)}


def kvpage_args(spec: str) -> tuple[str, tuple[str, ...]]:
    dtype, _, weight_dtype = spec.partition(":")
    return dtype, (("--weight-dtype", weight_dtype) if weight_dtype else ())


def measure_server(start, reqs, concurrency: int, prompt: str) -> dict:
    proc, url = start()
    try:
        asyncio.run(run_load(url, reqs[:2], min(concurrency, 2)))  # warm-up
        r = asyncio.run(run_load(url, reqs, concurrency))
        if concurrency == 1:
            r["ttft_cold_s"] = asyncio.run(ttft_once(url, prompt))
            warm = [asyncio.run(ttft_once(url, prompt)) for _ in range(WARM_REPEATS)]
            r["ttft_warm_runs_s"], r["ttft_warm_s"] = warm, statistics.median(warm)
        return r
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument(
        "--kvpage-dtypes",
        nargs="+",
        default=["auto", "auto:int4"],
        help="kvpage servers: DTYPE or DTYPE:WEIGHT_DTYPE (default auto auto:int4)",
    )
    ap.add_argument("--llama-types", nargs="+", default=["F32", "Q4_1"])
    ap.add_argument("--llama-args", default="", help='more llama-server arguments, e.g. "-nr" (no weight repacking)')
    ap.add_argument("--requests", type=int, default=64, help="requests per run at concurrency > 1 (default 64)")
    ap.add_argument("--single-requests", type=int, default=4, help="requests at concurrency 1 (default 4)")
    ap.add_argument("--no-baselines", action="store_true", help="skip the Python API and transformers at c=1")
    ap.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parse(ap, None, __file__)
    bindir = llama_binaries()
    info = (bindir.parent / "BUILD_INFO.txt").read_text().strip() if (bindir.parent / "BUILD_INFO.txt").exists() else ""
    prompt = long_prompt()
    llama_args = shlex.split(args.llama_args)
    rows, data = [], {}
    for c in args.concurrency:
        n = args.single_requests if c == 1 else args.requests
        reqs = workload(n, seed=100 + c, prompt_words=(24, 380), max_tokens=(32, 256) if c > 1 else (128, 128))
        servers = [(f"kvpage {d}", lambda d=d: start_server("default", *kvpage_args(d))) for d in args.kvpage_dtypes]
        servers += [(f"llama-server {t}", lambda t=t, c=c: start_llama(bindir, gguf_of(t, bindir), c, 2048, llama_args))
                    for t in args.llama_types]  # fmt: skip
        for name, start in servers:
            r = measure_server(start, reqs, c, prompt)
            data[f"{name} c={c}"] = r
            ttft = f"{r['ttft_cold_s']:.2f} / {r['ttft_warm_s']:.3f}" if c == 1 else ""
            rows.append(f"| {c} | {name} | {r['output_tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} / "
                        f"{r['ttft_p99_s']:.2f} | {r['itl_p50_s'] * 1000:.0f} | {ttft} |")  # fmt: skip
            print(rows[-1], flush=True)
        if c == 1 and not args.no_baselines:
            for d in args.kvpage_dtypes:
                dtype, _, wd = d.partition(":")
                api = run_api(reqs, dtype, wd or None)
                data[f"kvpage {d} Python API c=1"] = api
                rows.append(f"| 1 | kvpage {d}, Python API (no server) | {api['output_tokens_per_s']:.1f} | | | |")
                print(rows[-1], flush=True)
            for dtype in ("float32", "bfloat16"):
                hf = run_transformers(reqs, dtype)
                data[f"transformers {dtype} c=1"] = hf
                tps = hf["output_tokens_per_s"]
                rows.append(f"| 1 | transformers generate, {dtype} (no server) | {tps:.1f} | | | |")
                print(rows[-1], flush=True)
    table = ("| clients | engine | output tokens/s | TTFT p50 / p99 (s) | ITL p50 (ms) | "
             "TTFT 760-token prompt cold / warm (s) |\n|---|---|---|---|---|---|\n" + "\n".join(rows))  # fmt: skip
    print(table)
    write_json("peers", {"results": data, "llama_build": info})
    if not args.no_results:
        body = (f"Same seeded requests to each server, one server at a time, streamed through the openai client "
                f"(greedy, ignore_eos). Concurrency 1: {args.single_requests} requests of 128 tokens; higher: "
                f"{args.requests} requests, prompts of 24-380 words (~32-512 tokens), outputs 32-256 tokens. "
                f"llama-server: `-np` = clients, `-t {THREADS}` {args.llama_args}; "
                f"{info.splitlines()[0] if info else ''}; "
                f"{' '.join(info.splitlines()[1:2])}.\n\n{table}")  # fmt: skip
        append_results("Side by side with llama.cpp (benchmarks/peers.py)", body, "torch", "transformers", "openai")
    return 0


if __name__ == "__main__":
    sys.exit(main())
