"""A freshly started server: the time to first token of its first requests, and what it keeps resident.

Each server (kvpage, and llama-server on the same GGUF values) is started fresh, then gets 40 chat
requests one after the other, all with the same ~1,000-token system prompt and a question of a new
length each (so every request is a prompt length the server has not seen; max_tokens 8, greedy,
streamed through the openai client). Reported: the first request's TTFT (it computes the system
prompt: cold), the max and p90 of the next 20 against the median of the last 20 (warm); the goal is
that max <= 2x that median. Resident memory (VmRSS,
and the peak VmHWM) is read from /proc after the run, at the same context capacity: kvpage's pool is
sized to llama-server's `-c`.

    python benchmarks/first_requests.py --kvpage-dtypes auto auto:int4 --llama-types BF16 Q4_1
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

import httpx
from _report import append_results, parse, write_json
from peers import gguf_of, kvpage_args, llama_binaries, start_llama
from serving import WORDS, make_client, start_server

CONTEXT = 2048  # tokens of context either server holds (kvpage: 128 blocks of 16)


def system_prompt(words: int = 900, seed: int = 11) -> str:
    rng = random.Random(seed)
    return "You answer questions about this text. " + " ".join(rng.choice(WORDS) for _ in range(words))


def questions(n: int, seed: int = 12) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(4 + i)) + "?" for i in range(n)]  # a new length each


async def ttft(client, system: str, question: str) -> float:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model="smollm2", messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=8, temperature=0, stream=True,
    )  # fmt: skip
    first = float("nan")
    async for chunk in stream:
        if first != first and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    return first


async def drive(url: str, n: int) -> list[float]:
    client = make_client(url)
    system = system_prompt()
    out = [await ttft(client, system, q) for q in questions(n)]
    await client.close()
    return out


def memory_mb(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) // 1024
    return out


def kv_pool_mb(url: str) -> int:
    """The KV pool a kvpage server reports (/metrics), 0 for another server."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("kvpage:kv_cache_bytes{") and 'state="total"' in line:
            return int(float(line.rsplit(" ", 1)[1])) // 2**20
    return 0


def measure(start, n: int) -> dict:
    proc, url = start()
    try:
        times = asyncio.run(drive(url, n))
        mem = memory_mb(proc.pid)
        pool = kv_pool_mb(url)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    first, warm = times[1:21], times[21:]  # (times[0] computes the system prompt: cold)
    median = statistics.median(warm)
    p90 = sorted(first)[int(0.9 * (len(first) - 1))]
    return {"ttft_s": times, "cold_s": times[0], "first_max_s": max(first), "first_p90_s": p90,
            "warm_median_s": median, "first_max_over_warm": max(first) / median, "rss_mb": mem["VmRSS"],
            "peak_rss_mb": mem["VmHWM"], "kv_pool_mb": pool}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvpage-dtypes", nargs="+", default=["auto", "auto:int4"])
    ap.add_argument("--llama-types", nargs="+", default=["BF16", "Q4_1"])
    ap.add_argument("--requests", type=int, default=41, help="per server: the cold one, 20 first, the rest warm")
    ap.add_argument("--no-llama", action="store_true", help="kvpage servers only")
    ap.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parse(ap, argv, __file__)
    blocks = ("--num-kv-blocks", str(CONTEXT // 16))
    servers = [(f"kvpage {d}", lambda d=d: start_server("default", kvpage_args(d)[0], (*kvpage_args(d)[1], *blocks)))
               for d in args.kvpage_dtypes]  # fmt: skip
    if not args.no_llama:
        bindir = llama_binaries()
        extra = {"Q4_1": ["-nr"]}  # (without -nr the repacking build hangs at start on Sapphire Rapids)

        def llama(t):
            return lambda: start_llama(bindir, gguf_of(t, bindir), 1, CONTEXT, extra.get(t, []))

        servers += [(f"llama-server {t}", llama(t)) for t in args.llama_types]
    rows, data = [], {}
    for name, start in servers:
        r = data[name] = measure(start, args.requests)
        kv_mb = r["kv_pool_mb"]
        ms = {k: f"{r[k] * 1000:.0f}" for k in ("cold_s", "first_max_s", "first_p90_s")}
        rows.append(f"| {name} | {ms['cold_s']} | {ms['first_max_s']} | {ms['first_p90_s']} | "
                    f"{r['warm_median_s'] * 1000:.0f} | {r['first_max_over_warm']:.2f} | {r['rss_mb']} "
                    f"({r['rss_mb'] - kv_mb} beyond its {kv_mb} MB pool) | {r['peak_rss_mb']} |")  # fmt: skip
        print(rows[-1], flush=True)
    table = ("| server | cold TTFT (ms) | next 20: max TTFT (ms) | p90 | warm median (ms) | max / warm | RSS (MB) | "
             "peak RSS (MB) |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))  # fmt: skip
    print(table)
    write_json("first_requests", data)
    if not args.no_results:
        body = (f"Fresh servers, {args.requests} chat requests one at a time sharing a ~1,000-token system prompt, "
                f"each question a new length, max_tokens 8; context {CONTEXT} tokens on both (kvpage "
                f"`--num-kv-blocks {CONTEXT // 16}`, llama-server `-c {CONTEXT} -np 1`).\n\n{table}")  # fmt: skip
        append_results("A fresh server's first requests and memory (benchmarks/first_requests.py)", body, "torch",
                       "openai")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
