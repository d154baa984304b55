"""Serving through `kvpage serve`: many clients at once and one stream, as users feel it.

Starts `kvpage serve` in a subprocess for each server variant (an environment setting such as
OMP_WAIT_POLICY=PASSIVE, or a dtype), sends the same seeded requests through the official `openai`
client with --concurrency clients at a time (streaming completions, greedy, ignore_eos, so every
request yields exactly its max_tokens), and reports output tokens/s, time to first token p50/p99
and inter-token latency p50; at concurrency 1 also the same requests through the Python API in
this process (what the server path costs). Every variant runs in the same invocation, so the ratios are fair on a
noisy machine.

    python benchmarks/serving.py --concurrency 1 16 --variant default --variant OMP_WAIT_POLICY=PASSIVE
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx
from _report import append_results, parse, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "cache",
         "block", "memory", "page"]  # fmt: skip


def workload(n: int, seed: int, prompt_words: tuple[int, int], max_tokens: tuple[int, int]):
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(*prompt_words))), rng.randint(*max_tokens))
            for _ in range(n)]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, what: str) -> tuple[subprocess.Popen, str]:
    """Poll /health until the server answers 200 (2 minutes at most); kill it and raise otherwise."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{what} did not start: {proc.stdout.read() if proc.stdout else ''}")


def start_server(variant: str, dtype: str, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ)
    if variant != "default":
        key, _, value = variant.partition("=")
        env[key] = value
    cmd = [sys.executable, "-m", "kvpage.cli", "serve", "--port", str(port), "--dtype", dtype, "--log-level", "warning"]
    cmd += list(extra)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return wait_healthy(proc, port, "kvpage serve")


def make_client(url: str):
    """An openai client that opens a connection per request: llama-server closes idle keep-alive
    connections after a few seconds, and reusing one it closed fails the request."""
    import openai

    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0))
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600, http_client=http)


async def run_load(url: str, reqs, concurrency: int) -> dict:

    client = make_client(url)
    sem = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0

    async def one(prompt: str, max_tokens: int) -> None:
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            last = None
            stream = await client.completions.create(
                model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                if not chunk.choices or not chunk.choices[0].text:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now
            tokens += max_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p, m) for p, m in reqs))
    wall = time.perf_counter() - t0
    await client.close()
    q = statistics.quantiles(ttft, n=100) if len(ttft) > 1 else ttft * 99
    return {"output_tokens_per_s": tokens / wall, "wall_s": wall, "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": q[98], "itl_p50_s": statistics.median(itl) if itl else 0.0}  # fmt: skip


def run_api(reqs, dtype: str, weight_dtype: str | None = None) -> dict:
    """The same requests one at a time through the Python API in this process: the server's baseline."""
    from kvpage import LLM, SamplingParams

    llm = LLM("smollm2", dtype=dtype, weight_dtype=weight_dtype)
    llm.generate([reqs[0][0]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for prompt, max_tokens in reqs:
        out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           use_tqdm=False)  # fmt: skip
        tokens += len(out[0].outputs[0].token_ids)
    return {"output_tokens_per_s": tokens / (time.perf_counter() - t0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--variant", action="append", help="'default' or ENV=VALUE for the server (repeatable)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weight-dtype", choices=["int8", "int4"], default=None)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, nargs=2, default=[32, 128])
    ap.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parse(ap, None, __file__)
    variants = args.variant or ["default"]
    rows, data = [], {}
    for c in args.concurrency:
        reqs = workload(max(4, c * args.requests_per_client), seed=c, prompt_words=(16, 256),
                        max_tokens=tuple(args.max_tokens))  # fmt: skip
        for v in variants:
            proc, url = start_server(v, args.dtype, ("--weight-dtype", args.weight_dtype) if args.weight_dtype else ())
            try:
                asyncio.run(run_load(url, reqs[:2], min(c, 2)))  # warm-up (first-call costs)
                r = asyncio.run(run_load(url, reqs, c))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            data[f"{v} c={c}"] = r
            rows.append(f"| {c} | {v} | {r['output_tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} "
                        f"| {r['itl_p50_s'] * 1000:.0f} |")  # fmt: skip
            print(rows[-1], flush=True)
    if 1 in args.concurrency:
        reqs = workload(max(4, args.requests_per_client), seed=1, prompt_words=(16, 256),
                        max_tokens=tuple(args.max_tokens))  # fmt: skip
        api = run_api(reqs, args.dtype, args.weight_dtype)
        data["python API c=1"] = api
        rows.append(f"| 1 | (Python API, no server) | {api['output_tokens_per_s']:.1f} | | |")
    table = ("| clients | server variant | output tokens/s | TTFT p50 / p99 (s) | ITL p50 (ms) |\n"
             "|---|---|---|---|---|\n" + "\n".join(rows))  # fmt: skip
    print(table)
    write_json("serving", {"dtype": args.dtype, "results": data})
    if not args.no_results:
        body = (f"{len(variants)} server variant(s), dtype {args.dtype}, {args.requests_per_client} requests per "
                f"client, prompts of 16-256 words, outputs {args.max_tokens[0]}-{args.max_tokens[1]} tokens "
                f"(greedy, ignore_eos), streamed through the openai client.\n\n{table}")  # fmt: skip
        append_results("Serving through kvpage serve", body, "torch", "openai")
    return 0


if __name__ == "__main__":
    sys.exit(main())
