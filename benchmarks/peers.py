"""kvpage next to llama.cpp and OpenVINO GenAI on the same work, in the same run.

llama.cpp: the servers, one stream, time to first token.

The same seeded requests go through the official `openai` client (streaming completions, greedy,
ignore_eos, so each request yields exactly its max_tokens) to `kvpage serve` and to llama.cpp's
`llama-server` with `-np` equal to the concurrency, one server at a time:
  - output tokens/s, time to first token p50/p99, inter-token latency p50, at each --concurrency
    (at concurrency 1 every server is up at once and they take the requests in turns: the machine's
    speed moves by a third within an hour here, and one server at a time measured that too; the p99
    there is the slowest of the requests' TTFTs, the ITL the median of theirs);
  - time to first token of one 760-token prompt, cold, then again (prefix cache warm; the median of 5);
  - at concurrency 1 also kvpage's Python API and transformers' `generate` on the same requests
    (what the server path costs; the ">= 2x transformers" target).
llama-server runs the model's GGUF at the precision asked (--llama-types): F32 and BF16 are made
from the shipped Q4_1 file with llama-quantize (the same de-quantized values kvpage computes with),
Q4_1 is the shipped file. Binaries come from benchmarks/peers/build_llama_server.sh (built on first
use, ~10 minutes on 2 cores).

OpenVINO GenAI (Intel's continuous-batching pipeline with paged attention, the engine a CPU user picks
to serve many requests; it has no OpenAI server of its own): offline, the workloads of
peers/offline_workloads.py (one stream; 64 prompts at once; 31 prompts sharing a cached 1,024-token
system text), token ids in (its converted tokenizer mangles this GGUF's byte-level vocabulary), greedy,
ignore_eos, the same pool, batch limits and prefix caching, at equal precision (inference and KV cache:
bf16 against kvpage's bfloat16, f32 against float32). OpenVINO runs optimum-intel's export of the same
GGUF in its own environment (peers/openvino_env.sh, built on first use). Each repeat has prompts of
its own; the two engines alternate, one process at a time, and the figures are medians over repeats.

    python benchmarks/peers.py --concurrency 1 16 64 --kvpage-dtypes auto --llama-types F32 Q4_1
    python benchmarks/peers.py --peers openvino --openvino-precisions bf16 f32 --repeats 3
    python benchmarks/peers.py --peers llama --model-shape llama-3.2-1b --concurrency 1 16 --single-requests 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
sys.path.insert(0, str(ROOT / "peers"))
from shaped_models import SHAPES, shaped_gguf  # noqa: E402

THREADS = os.cpu_count() or 2


def llama_binaries() -> Path:
    out = subprocess.run(["bash", str(ROOT / "peers" / "build_llama_server.sh")], check=True, capture_output=True,
                         text=True).stdout.strip().splitlines()[-1]  # fmt: skip
    return Path(out).parent


def peers_dir() -> Path:
    return Path(os.environ.get("KVPAGE_PEERS_DIR", Path.home() / ".cache" / "kvpage" / "peers"))


def openvino_python() -> str:
    out = subprocess.run(["bash", str(ROOT / "peers" / "openvino_env.sh")], check=True, capture_output=True,
                         text=True).stdout.strip().splitlines()[-1]  # fmt: skip
    return out


OV_DTYPES = {"bf16": "bfloat16", "f32": "float32"}
OFFLINE = {"one_stream": "one stream: 128-token prompt, 256 new tokens (decode tokens/s)",
           "batch": "64 prompts of 64-512 tokens at once, 128 new each (output tokens/s)",
           "shared": "31 prompts sharing a cached 1,024-token system text, 32 new each (output tokens/s)"}  # fmt: skip


def _json_line(cmd: list[str]) -> dict:
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT.parent)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def run_openvino(precisions: list[str], repeats: int) -> tuple[list[str], dict]:
    """The offline workloads, kvpage and OpenVINO GenAI alternating (the first to run swaps each repeat)."""
    from kvpage.models.loader import resolve_model_path

    ovpy, gguf = openvino_python(), resolve_model_path("smollm2")
    rows, data = [], {}
    for prec in precisions:
        kv_cmd = lambda r, prec=prec: [sys.executable, str(ROOT / "peers" / "kvpage_offline.py"), "--dtype",
                                       OV_DTYPES[prec], "--repeat", str(r)]  # fmt: skip
        ov_cmd = lambda r, prec=prec: [ovpy, str(ROOT / "peers" / "openvino_run.py"), "--gguf", str(gguf),
                                       "--precision", prec, "--out-dir", str(peers_dir() / "openvino-smollm2"),
                                       "--repeat", str(r)]  # fmt: skip
        runs = {"kvpage": [], "openvino": []}
        for r in range(repeats):
            order = [("kvpage", kv_cmd), ("openvino", ov_cmd)]
            for name, cmd in order if r % 2 == 0 else order[::-1]:
                runs[name].append(_json_line(cmd(r)))
                print(f"  {prec} repeat {r} {name}: {runs[name][-1]['result']}", flush=True)
        for w, what in OFFLINE.items():
            k = statistics.median(x["result"][w] for x in runs["kvpage"])
            o = statistics.median(x["result"][w] for x in runs["openvino"])
            data[f"{w} {prec}"] = {"kvpage": [x["result"][w] for x in runs["kvpage"]],
                                   "openvino": [x["result"][w] for x in runs["openvino"]]}  # fmt: skip
            rows.append(f"| {what} | {prec} | {k:.1f} | {o:.1f} | **{k / o:.2f}** |")
            print(rows[-1], flush=True)
        data[f"info {prec}"] = {"kvpage": runs["kvpage"][0]["info"], "openvino": runs["openvino"][0]["info"]}
    return rows, data


def model_file(kind: str, shape: str | None, bindir: Path) -> Path:
    """The GGUF llama-server runs: SmolLM2's, or a random-weight model of `shape` (built once)."""
    return shaped_gguf(shape, kind, bindir, peers_dir() / "shapes") if shape else gguf_of(kind, bindir)


def start_kvpage(spec: str, shape: str | None, bindir: Path):
    dtype, extra = kvpage_args(spec)
    if shape:  # the same BF16 file llama-server reads (int4: quantized by kvpage as it loads)
        extra = (*extra, "--model", str(model_file("BF16", shape, bindir)), "--served-model-name", "smollm2")
    return start_server("default", dtype, extra)


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
        if first is None and chunk.choices:  # (a random-weight model's first token may have no text)
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


def measure_server(start, reqs, concurrency: int) -> dict:
    """Several clients, one server at a time (one stream: measure_interleaved)."""
    proc, url = start()
    try:
        asyncio.run(run_load(url, reqs[:2], min(concurrency, 2)))  # warm-up
        return asyncio.run(run_load(url, reqs, concurrency))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def measure_interleaved(servers, reqs, prompt: str) -> dict:
    """One stream: every server up at once (idle ones wait on their sockets), the requests taken in turns,
    request i by each server before request i + 1 (the first to go rotates), so a machine that slows
    down for a while slows every server alike; then each one's cold and warm TTFT of the long prompt."""
    up = [(name, *start()) for name, start in servers]
    try:
        for _, _, url in up:
            asyncio.run(run_load(url, reqs[:1], 1))  # warm-up
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in up}
        for i, req in enumerate(reqs):
            for name, _, url in up[i % len(up) :] + up[: i % len(up)]:
                runs[name].append(asyncio.run(run_load(url, [req], 1)))
        out = {}
        for name, _, url in up:
            rs = runs[name]
            r = {"output_tokens_per_s": sum(n for _, n in reqs) / sum(x["wall_s"] for x in rs),
                 "ttft_p50_s": statistics.median(x["ttft_p50_s"] for x in rs),
                 "ttft_p99_s": max(x["ttft_p50_s"] for x in rs),
                 "itl_p50_s": statistics.median(x["itl_p50_s"] for x in rs), "interleaved": True}  # fmt: skip
            r["ttft_cold_s"] = asyncio.run(ttft_once(url, prompt))
            warm = [asyncio.run(ttft_once(url, prompt)) for _ in range(WARM_REPEATS)]
            r["ttft_warm_runs_s"], r["ttft_warm_s"] = warm, statistics.median(warm)
            out[name] = r
        return out
    finally:
        for _, proc, _ in up:
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
    ap.add_argument("--peers", nargs="+", choices=["llama", "openvino"], default=["llama", "openvino"])
    ap.add_argument("--openvino-precisions", nargs="+", choices=sorted(OV_DTYPES), default=["bf16", "f32"])
    ap.add_argument("--repeats", type=int, default=3, help="OpenVINO comparison: repeats, medians reported")
    ap.add_argument(
        "--model-shape",
        choices=sorted(SHAPES),
        default=None,
        help="llama.cpp comparison on a random-weight model of this shape (peers/shaped_models.py)",
    )
    args = parse(ap, None, __file__)
    if "llama" in args.peers:
        run_llama(args)
    if "openvino" in args.peers:
        rows, data = run_openvino(args.openvino_precisions, args.repeats)
        table = ("| offline, the same token ids | precision | kvpage | OpenVINO GenAI | kvpage / OpenVINO |\n"
                 "|---|---|---|---|---|\n" + "\n".join(rows))  # fmt: skip
        print(table)
        write_json("peers_openvino", data)
        if not args.no_results:
            info = data[f"info {args.openvino_precisions[0]}"]["openvino"]
            body = (f"kvpage (`LLM.generate`) and OpenVINO GenAI {info['openvino_genai']} (ContinuousBatchingPipeline, "
                    f"optimum-intel's export of the same GGUF; inference and KV-cache precision as named), offline, "
                    f"token ids in, greedy, ignore_eos; both: prefix caching, a 2 GiB KV pool, 256 sequences and "
                    f"2,048 tokens a step at most. Median of {args.repeats} repeats, each with prompts of its own, the "
                    f"engines alternating one process at a time.\n\n{table}")  # fmt: skip
            append_results("Side by side with OpenVINO GenAI (benchmarks/peers.py --peers openvino)", body, "torch",
                           "transformers")  # fmt: skip
    return 0


def run_llama(args) -> None:
    bindir = llama_binaries()
    info = (bindir.parent / "BUILD_INFO.txt").read_text().strip() if (bindir.parent / "BUILD_INFO.txt").exists() else ""
    prompt = long_prompt()
    llama_args = shlex.split(args.llama_args)
    rows, data = [], {}
    shape = args.model_shape
    for c in args.concurrency:
        n = args.single_requests if c == 1 else args.requests
        reqs = workload(n, seed=100 + c, prompt_words=(24, 380), max_tokens=(32, 256) if c > 1 else (128, 128))
        servers = [(f"kvpage {d}", lambda d=d: start_kvpage(d, shape, bindir)) for d in args.kvpage_dtypes]
        servers += [(f"llama-server {t}", lambda t=t, c=c: start_llama(bindir, model_file(t, shape, bindir), c,
                                                                       2048, llama_args))
                    for t in args.llama_types]  # fmt: skip
        results = measure_interleaved(servers, reqs, prompt) if c == 1 else None
        for name, start in servers:
            r = results[name] if results else measure_server(start, reqs, c)
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
        model = (f"Model: random weights of {args.model_shape}'s shape ({SHAPES[args.model_shape]}), one GGUF for "
                 f"both. " if args.model_shape else "")  # fmt: skip
        body = (f"{model}Same seeded requests to each server, streamed through the openai client (greedy, ignore_eos). "
                f"Concurrency 1: {args.single_requests} requests of 128 tokens, every server up, taking them in turns; "
                f"higher: one server at a time, {args.requests} requests, prompts of 24-380 words (~32-512 tokens), "
                f"outputs 32-256 tokens. "
                f"llama-server: `-np` = clients, `-t {THREADS}` {args.llama_args}; "
                f"{info.splitlines()[0] if info else ''}; "
                f"{' '.join(info.splitlines()[1:2])}.\n\n{table}")  # fmt: skip
        append_results("Side by side with llama.cpp (benchmarks/peers.py)", body, "torch", "transformers", "openai")


if __name__ == "__main__":
    sys.exit(main())
