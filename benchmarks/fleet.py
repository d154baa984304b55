"""A fleet on one machine, as its users feel it: `kvpage serve --replicas N` under each router, and the
shared KV tier (a real redis-server) between two servers.

Part "routers": the issue's workload, 16 system prompts x 8 users, each a two-turn chat (the second turn
carries the first reply), conversations arriving as a Poisson process, streamed through the official
openai client against `kvpage serve --replicas N --router R` for R in round_robin, pow2, ray_prefix
(Ray Serve LLM's own), kv, and kv with --remote-kv. Each replica's pool is smaller than the prompts'
KV, so where a request goes decides what it finds. Reported per router: the fleet's prefix-hit tokens
(the responses' usage.prompt_tokens_details.cached_tokens) against the most possible (what one
replica with an unbounded cache would have found: the leading full blocks of each prompt that an
earlier request's prompt or prompt + reply already held), TTFT p50 / p90 and output tokens/s.

Part "transfer": two `kvpage serve --remote-kv` servers A and B; a 1k-token prompt computed on A, then
its time to first token on B (fetched from the shared tier), against B's time to first token for a
fresh prompt of the same length (computed): the same server, the same length, only where the KV
comes from differs.

    python benchmarks/fleet.py                      # both parts, recorded in RESULTS.md
    python benchmarks/fleet.py --part transfer --no-results
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

import httpx
from _report import append_results, cpu_capability, parse, write_json
from serving import ROOT, free_port, make_client, wait_healthy

ROUTERS = ("round_robin", "pow2", "ray_prefix", "kv", "kv+remote")
TOPICS = ["water utility billing", "airline rebooking", "home insurance claims", "mobile phone plans",
          "bank card disputes", "parcel delivery", "university admissions", "car rental", "hotel bookings",
          "internet outages", "gym memberships", "pharmacy refills", "tax filing", "library loans",
          "electric vehicle charging", "pet insurance"]  # fmt: skip
WORDS = ["policy", "account", "customer", "request", "payment", "refund", "schedule", "service", "support",
         "order", "ticket", "update", "balance", "contract", "delivery", "booking", "network", "renewal",
         "limit", "fee", "status", "record"]  # fmt: skip
QUESTIONS = ["How do I start?", "What does it cost?", "Can I cancel?", "Who do I call?", "Is it open today?",
             "What do I need to bring?", "How long does it take?", "Can you summarise the rules?"]  # fmt: skip


# ---------------------------------------------------------------------------------------------- servers
def start_redis() -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (make install installs it)")
    port = free_port()
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL)  # fmt: skip
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}"


def start_kvpage(args: list[str], what: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvpage.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return wait_healthy(proc, port, what)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def wait_trusted(url: str, replicas: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(url)
        if sum(v for k, v in m.items() if k.startswith("kvpage:fleet_replica_trusted")) >= replicas:
            return
        time.sleep(0.5)
    raise RuntimeError("the fleet's replicas were not heard by its index")


# ---------------------------------------------------------------------------------------------- workload
def system_prompt(i: int, words: int) -> str:
    rng = random.Random(i)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are the assistant of a {TOPICS[i % len(TOPICS)]} help desk (desk {i}). Rules: {body}."


class MostPossible:
    """What one replica with an unbounded prefix cache would have served each prompt (full blocks)."""

    def __init__(self, tokenizer, block_size: int = 16) -> None:
        self.tok, self.bs = tokenizer, block_size
        self.seen: set[tuple[int, ...]] = set()  # every full-block prefix held so far

    def ids(self, messages) -> list[int]:
        return self.tok.encode_chat(messages)

    def hit(self, ids: list[int]) -> int:
        n = 0
        while (n + 1) * self.bs <= len(ids) - 1 and tuple(ids[: (n + 1) * self.bs]) in self.seen:
            n += 1
        return n * self.bs

    def add(self, ids: list[int]) -> None:
        for n in range(1, len(ids) // self.bs + 1):
            self.seen.add(tuple(ids[: n * self.bs]))


async def run_workload(url: str, cfg, tokenizer) -> dict:
    client = make_client(url)
    rng = random.Random(cfg.seed)
    systems = [system_prompt(i, cfg.system_words) for i in range(cfg.prompts)]
    convs = [(s, u) for s in range(cfg.prompts) for u in range(cfg.users)]
    rng.shuffle(convs)
    most = MostPossible(tokenizer)
    ttft: list[float] = []
    prompt_tokens = cached = possible = out_tokens = 0
    lock = asyncio.Lock()

    async def ask(messages) -> str:
        nonlocal prompt_tokens, cached, possible, out_tokens
        ids = most.ids(messages)
        async with lock:
            possible += most.hit(ids)
            most.add(ids)
        t0, first, text = time.perf_counter(), None, []
        stream = await client.chat.completions.create(model="smollm2", messages=messages, max_tokens=cfg.max_tokens,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                u = chunk.usage
                prompt_tokens += u.prompt_tokens
                cached += u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
                out_tokens += u.completion_tokens
                if u.prompt_tokens != len(ids):
                    raise RuntimeError(f"the server counted {u.prompt_tokens} prompt tokens, the client {len(ids)}")
        ttft.append((first or time.perf_counter()) - t0)
        reply = "".join(text)
        async with lock:
            most.add(most.ids([*messages, {"role": "assistant", "content": reply}])[:-3])  # (its generation prompt)
        return reply

    async def conversation(start: float, s: int, u: int) -> None:
        await asyncio.sleep(start)
        messages = [{"role": "system", "content": systems[s]}, {"role": "user", "content": QUESTIONS[u % 8]}]
        for turn in range(cfg.turns):
            reply = await ask(messages)
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": QUESTIONS[(u + turn + 3) % 8]}]  # fmt: skip
            await asyncio.sleep(rng.expovariate(1 / cfg.think))

    starts, t = [], 0.0
    for _ in convs:
        t += rng.expovariate(cfg.rate)
        starts.append(t)
    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(st, s, u) for st, (s, u) in zip(starts, convs, strict=True)))
    wall = time.perf_counter() - t0
    await client.close()
    q = statistics.quantiles(ttft, n=10)
    return {"requests": len(ttft), "prompt_tokens": prompt_tokens, "cached_tokens": cached, "possible": possible,
            "hit_rate": cached / prompt_tokens, "of_possible": cached / possible if possible else 0.0,
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": q[8], "output_tokens_per_s": out_tokens / wall,
            "wall_s": wall}  # fmt: skip


def routers_part(cfg, tokenizer) -> tuple[str, dict]:
    data, rows = {}, []
    redis_proc, redis_url = start_redis()
    try:
        for name in cfg.routers:
            router, _, remote = name.partition("+")
            args = ["--replicas", str(cfg.replicas), "--router", router, "--dtype", cfg.dtype,
                    "--num-kv-blocks", str(cfg.blocks), "--max-model-len", str(min(2048, cfg.blocks * 16))]  # fmt: skip
            if remote:
                args += ["--remote-kv", redis_url]
            t0 = time.perf_counter()
            proc, url = start_kvpage(args, f"the {name} fleet")
            try:
                wait_trusted(url, cfg.replicas)
                started = time.perf_counter() - t0
                r = asyncio.run(run_workload(url, cfg, tokenizer))
                m = metrics(url)
                r["fallbacks"] = m.get("kvpage:fleet_router_fallbacks_total{}", 0.0)
                r["route_p99_ms"] = 1000 * m.get("kvpage:fleet_route_seconds{quantile=p99}", 0.0)
                r["start_s"] = started
            finally:
                stop(proc)
            data[name] = r
            print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    finally:
        stop(redis_proc)
    rr = data.get("round_robin", {}).get("hit_rate") or float("nan")
    ray = data.get("ray_prefix", {}).get("ttft_p90_s") or float("nan")
    for name, r in data.items():
        route = f"{r['route_p99_ms']:.1f}" if name.startswith("kv") else "-"
        rows.append(f"| {name} | {r['hit_rate']:.1%} | {r['of_possible']:.0%} | {r['hit_rate'] / rr:.2f}x | "
                    f"{r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} | {r['ttft_p90_s'] / ray:.2f} | "
                    f"{r['output_tokens_per_s']:.1f} | {route} |")  # fmt: skip
    table = ("| router | prefix-hit tokens | of the most possible | vs round_robin | TTFT p50 / p90 (s) | "
             "p90 vs ray_prefix | output tok/s | route p99 (ms) |\n|---|---|---|---|---|---|---|---|\n"
             + "\n".join(rows))  # fmt: skip
    return table, data


# ---------------------------------------------------------------------------------------------- transfer
def ttft(url: str, prompt: str) -> float:
    import openai

    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
    t0 = time.perf_counter()
    stream = c.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            break
    dt = time.perf_counter() - t0
    for _ in stream:
        pass
    return dt


def transfer_part(cfg) -> tuple[str, dict]:
    import redis

    redis_proc, redis_url = start_redis()
    server = redis.Redis.from_url(redis_url)
    a = b = None
    try:
        common = ["--dtype", cfg.dtype, "--remote-kv", redis_url, "--max-model-len", "2048"]
        a, url_a = start_kvpage(common, "server A")
        b, url_b = start_kvpage(common, "server B")
        rng = random.Random(7)

        def prompt(i: int) -> str:  # ~1,000 tokens, a fresh one each time
            return f"Report {i}: " + " ".join(rng.choice(WORDS) for _ in range(cfg.transfer_words))

        ttft(url_b, prompt(-1))  # warm-up of both servers
        ttft(url_a, prompt(-2))
        fetched, computed, tokens = [], [], 0
        for i in range(cfg.trials):
            p = prompt(i)
            before = server.dbsize()
            ttft(url_a, p)  # A computes it and writes its blocks through
            want = before + cfg.transfer_words // 16
            deadline = time.monotonic() + 30
            while server.dbsize() < want and time.monotonic() < deadline:
                time.sleep(0.05)
            fetched.append(ttft(url_b, p))  # B: from the shared tier
            computed.append(ttft(url_b, prompt(1000 + i)))  # B: the same length, computed
        m = metrics(url_b)
        tokens = m.get("kvpage:remote_kv_fetched_tokens_total{}", 0.0) / cfg.trials
    finally:
        for p in (a, b):
            if p is not None:
                stop(p)
        stop(redis_proc)
    f, c = statistics.median(fetched), statistics.median(computed)
    data = {"fetched_ttft_s": fetched, "computed_ttft_s": computed, "fetched_tokens_per_trial": tokens,
            "speedup": c / f}  # fmt: skip
    table = ("| prompt on B | TTFT median (s) |\n|---|---|\n"
             f"| computed on A, fetched from the shared tier ({tokens:.0f} tokens) | {f:.3f} |\n"
             f"| fresh, computed on B | {c:.3f} |\n| **ratio** | **{c / f:.1f}x** |")  # fmt: skip
    return table, data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["routers", "transfer", "all"], default="all")
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--system-words", type=int, default=220, help="words per system prompt (~250 tokens)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rate", type=float, default=3.0, help="conversations started per second (Poisson)")
    ap.add_argument("--think", type=float, default=1.0, help="mean seconds between a reply and the next turn")
    ap.add_argument("--blocks", type=int, default=256, help="KV blocks per replica (16 tokens each)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--transfer-words", type=int, default=1000, help="words of the transferred prompt (~1k tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    cfg = parse(ap, argv, __file__)
    from kvpage.models import load_model

    tokenizer = load_model("smollm2", dtype="bfloat16").tokenizer
    out, body = {"config": vars(cfg), "cpu_kind": cpu_capability(), "cores": os.cpu_count()}, []
    if cfg.part in ("routers", "all"):
        table, out["routers"] = routers_part(cfg, tokenizer)
        print(table, flush=True)
        body.append(f"{cfg.replicas} replicas of {cfg.blocks} blocks each, dtype {cfg.dtype}; {cfg.prompts} system "
                    f"prompts x {cfg.users} users, {cfg.turns} turns, {cfg.max_tokens} tokens a reply, conversations "
                    f"at {cfg.rate}/s (Poisson), think time {cfg.think} s; streamed through the openai client.\n\n"
                    + table)  # fmt: skip
    if cfg.part in ("transfer", "all"):
        table, out["transfer"] = transfer_part(cfg)
        print(table, flush=True)
        body.append(f"A prefix computed on server A served on server B through --remote-kv (redis-server on "
                    f"127.0.0.1), median of {cfg.trials} prompts of ~{cfg.transfer_words} words, dtype {cfg.dtype}.\n\n"
                    + table)  # fmt: skip
    write_json("fleet", out)
    if not cfg.no_results:
        append_results("A fleet on one machine: routers and the shared KV tier", "\n\n".join(body), "torch", "ray",
                       "redis")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
