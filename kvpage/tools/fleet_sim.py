"""A model-free simulation of a fleet: the real scheduler, KV-cache manager, KV events, index and
routers over 8-256 simulated replicas, on a clock of its own (no torch, no Ray).

Each replica is a real `Scheduler` over a real `KVCacheManager` (prefix caching, a CPU tier); only
the model is replaced, by a compute-time model: a step of `t` scheduled tokens over `s` sequences
lasts `base + per_token * t + per_seq * s` simulated seconds. A step's KV events reach the index
`event_lag` seconds after the step ends, with the replica's load beside them (a heartbeat). The
routers are kvpage/fleet/routing.py's objects, called exactly as the Ray Serve router calls them.

The workload is the issue's: `num_prompts` system prompts x `users` users, each a multi-turn chat
(`turns` turns: system prompt + the history so far + a new user message; the answer's tokens are
scripted, so the next turn's prompt carries exactly them), first turns arriving as a Poisson
process, later ones a think time after the previous answer ended. Reported per router:

    hit      prompt tokens the replicas' prefix caches served (what usage.cached_tokens says)
    ideal    the most possible: the leading blocks of each prompt that some earlier request had
             already computed anywhere in the fleet (one cache of unbounded size would hit them)
    ttft     p50 / p90 of arrival -> first token, in simulated seconds
    route    p99 of the router's own time per request (wall clock, this process)

    python -m kvpage.tools.fleet_sim --replicas 64 --prompts 64 --users 8
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from kvpage.core.cache_key import block_digests
from kvpage.core.kv_cache_manager import KVCacheManager
from kvpage.core.request import Request
from kvpage.core.scheduler import Scheduler
from kvpage.core.step_update import RequestUpdate, SeqUpdate
from kvpage.fleet.index import KVIndex, Load
from kvpage.fleet.latency import quantile
from kvpage.fleet.routing import KVAware, PowerOfTwo, PrefixHistory, RoundRobin, RouteRequest

ROUTERS = ("round_robin", "pow2", "prefix_history", "kv")


@dataclass(slots=True)
class FleetConfig:
    replicas: int = 8
    num_blocks: int = 256  # per replica (16-token blocks: 4k tokens)
    num_cpu_blocks: int = 0
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    num_prompts: int = 16
    users: int = 8
    turns: int = 3
    system_tokens: int = 512
    user_tokens: int = 32
    answer_tokens: int = 32
    arrival_rate: float = 20.0  # first turns per simulated second
    think_time: float = 1.0  # mean, between an answer and the next turn
    base: float = 0.004  # the compute-time model, seconds
    per_token: float = 0.0002
    per_seq: float = 0.0005
    event_lag: float = 0.005
    seed: int = 0


@dataclass(slots=True)
class _Replica:
    name: str
    kv: KVCacheManager
    sched: Scheduler
    busy: bool = False
    sent_seq: int = 0
    received: int = 0


@dataclass(slots=True)
class _Turn:
    conv: int
    turn: int
    prompt: list[int]
    answer: list[int]
    arrival: float
    replica: str = ""
    first_token: float | None = None
    ideal_tokens: int = 0
    hit_tokens: int = 0


@dataclass(slots=True)
class FleetResult:
    router: str
    replicas: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    ideal_tokens: int
    ttft_p50: float
    ttft_p90: float
    route_p99_ms: float
    makespan: float
    fallbacks: int
    hit_rate: float = field(init=False)
    of_ideal: float = field(init=False)

    def __post_init__(self) -> None:
        self.hit_rate = self.hit_tokens / max(1, self.prompt_tokens)
        self.of_ideal = self.hit_tokens / max(1, self.ideal_tokens)


class FleetSimulation:
    def __init__(self, cfg: FleetConfig, router: str) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.replicas = {}
        for i in range(cfg.replicas):
            kv = KVCacheManager(cfg.num_blocks, cfg.block_size, num_cpu_blocks=cfg.num_cpu_blocks,
                                enable_prefix_caching=True, watermark=0.0)  # fmt: skip
            sched = Scheduler(kv, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                              max_model_len=cfg.num_blocks * cfg.block_size)  # fmt: skip
            self.replicas[f"r{i}"] = _Replica(f"r{i}", kv, sched)
        self.index = KVIndex(stale_after=10.0, pending_ttl=1.0)
        for name in self.replicas:
            self.index.apply(name, 0, [], now=0.0)
        self.router = self._make_router(router)
        self.names = list(self.replicas)
        self._events: list = []  # (time, order, kind, payload)
        self._order = 0
        self.turns: dict[str, _Turn] = {}
        self._seen: set[bytes] = set()  # every block some request computed (the ideal cache)
        self.route_times: list[float] = []
        self.now = 0.0

    def _make_router(self, name: str):
        true_load = lambda r: len(self.replicas[r].sched.requests)  # noqa: E731 - what pow2 probes
        seed = self.cfg.seed
        if name == "round_robin":
            return RoundRobin()
        if name == "pow2":
            return PowerOfTwo(true_load, seed)
        if name == "prefix_history":
            return PrefixHistory(true_load, seed=seed)
        if name == "kv":
            return KVAware(self.index, seed=seed)
        raise ValueError(f"router must be one of {ROUTERS}, not {name!r}")

    # ------------------------------------------------------------------ the workload
    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(2, 49000) for _ in range(n)]

    def _conversations(self) -> tuple[list[list[tuple[list[int], list[int]]]], list[list[int]]]:
        """Each conversation's turns (user tokens, answer tokens), and the system prompts' tokens."""
        cfg = self.cfg
        systems = [self._tokens(cfg.system_tokens) for _ in range(cfg.num_prompts)]
        return [[(self._tokens(cfg.user_tokens), self._tokens(cfg.answer_tokens)) for _ in range(cfg.turns)]
                for _ in range(cfg.users) for _ in systems], systems  # fmt: skip

    def _push(self, at: float, kind: str, payload) -> None:
        self._order += 1
        heapq.heappush(self._events, (at, self._order, kind, payload))

    # ------------------------------------------------------------------ the run
    def run(self) -> FleetResult:
        cfg = self.cfg
        convs, systems = self._conversations()
        self._convs, self._systems = convs, systems
        order = list(range(len(convs)))
        self.rng.shuffle(order)
        t = 0.0
        for c in order:
            t += self.rng.expovariate(cfg.arrival_rate)
            self._push(t, "arrive", (c, 0, []))
        while self._events:
            self.now, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrive":
                self._arrive(*payload)
            elif kind == "step":
                self._end_step(payload)
            elif kind == "events":
                self._deliver(*payload)
        for rep in self.replicas.values():
            st = rep.kv.stats()
            assert not st.used_blocks and not rep.sched.has_unfinished(), f"{rep.name} did not drain"
            rep.kv.check_invariants()
        self.index.check_invariants()
        done = list(self.turns.values())
        return FleetResult(
            router=self.router.name,
            replicas=cfg.replicas,
            requests=len(done),
            prompt_tokens=sum(len(t.prompt) for t in done),
            hit_tokens=sum(t.hit_tokens for t in done),
            ideal_tokens=sum(t.ideal_tokens for t in done),
            ttft_p50=quantile([t.first_token - t.arrival for t in done], 0.5),
            ttft_p90=quantile([t.first_token - t.arrival for t in done], 0.9),
            route_p99_ms=1000 * quantile(self.route_times, 0.99),
            makespan=self.now,
            fallbacks=getattr(self.router, "fallbacks", 0),
        )

    def _arrive(self, conv: int, turn: int, history: list[int]) -> None:
        cfg = self.cfg
        user, answer = self._convs[conv][turn]
        system = self._systems[conv % cfg.num_prompts]
        prompt = (history or system) + user
        rid = f"c{conv}t{turn}"
        tt = _Turn(conv, turn, prompt, answer, self.now)
        servable = prompt[: (len(prompt) - 1) // cfg.block_size * cfg.block_size]
        for d in block_digests(servable, cfg.block_size):
            if d not in self._seen:
                break
            tt.ideal_tokens += cfg.block_size
        self.turns[rid] = tt
        t0 = time.perf_counter()
        req = RouteRequest.of(prompt, cfg.block_size)
        chosen = self.router.rank(req, self.names, self.now)[0]
        self.router.routed(req, chosen, self.now)
        self.route_times.append(time.perf_counter() - t0)
        tt.replica = chosen
        rep = self.replicas[chosen]
        rep.received += 1
        rep.sched.add_request(Request(rid, list(prompt), self._order))
        if not rep.busy:
            self._start_step(rep)

    def _start_step(self, rep: _Replica) -> None:
        cfg = self.cfg
        out = rep.sched.schedule()
        rep.busy = True
        duration = cfg.base + cfg.per_token * out.num_tokens + cfg.per_seq * len(out.sequences)
        self._push(self.now + duration, "step", (rep.name, out))

    def _end_step(self, payload) -> None:
        name, out = payload
        rep = self.replicas[name]
        updates = {}
        for s in out.sequences:
            if not s.return_logits:
                continue
            rid = s.seq_id.request_id
            req, tt = rep.sched.requests[rid], self.turns[rid]
            n = len(req.sequences[0].output_token_ids)
            if tt.first_token is None:
                tt.first_token = self.now
                tt.hit_tokens = req.num_cached_tokens or 0
                for d in block_digests(tt.prompt, self.cfg.block_size):
                    self._seen.add(d)
            done = "length" if n + 1 >= len(tt.answer) else None
            updates[rid] = RequestUpdate(rid, [SeqUpdate(0, tt.answer[n], None, done)])
        result = rep.sched.update_from_output(out, updates)
        assert not result.failed, result.failed
        for rid in result.finished:
            tt = self.turns[rid]
            full = tt.prompt + tt.answer
            for d in block_digests(full[:-1], self.cfg.block_size):  # the last answer token's KV is never computed
                self._seen.add(d)
            if tt.turn + 1 < self.cfg.turns:
                self._push(self.now + self.rng.expovariate(1 / self.cfg.think_time), "arrive",
                           (tt.conv, tt.turn + 1, full))  # fmt: skip
        batches, gap = rep.kv.events.since(rep.sent_seq)
        assert not gap
        if batches:
            rep.sent_seq = batches[-1].seq
        load = Load(len(rep.sched.requests), rep.sched.num_backlog_tokens() / self.cfg.block_size, rep.received)
        self._push(self.now + self.cfg.event_lag, "events", (name, batches, load))
        rep.busy = False
        if rep.sched.has_unfinished():
            self._start_step(rep)

    def _deliver(self, name: str, batches, load: Load) -> None:
        for b in batches:
            ok = self.index.apply(name, b.seq, [asdict(e) for e in b.events], self.now, load)
            assert ok, "the simulation delivers every batch in order"
        if not batches:
            self.index.heartbeat(name, self.index.replicas[name].seq, self.now, load)
        self.index.expire(self.now)


def compare(cfg: FleetConfig, routers=ROUTERS) -> list[FleetResult]:
    return [FleetSimulation(cfg, r).run() for r in routers]


def table(results: list[FleetResult]) -> str:
    rr = next((r for r in results if r.router == "round_robin"), results[0])
    lines = ["| router | requests | hit rate | of the most possible | × round-robin | TTFT p50 | TTFT p90 | "
             "route p99 |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        lines.append(f"| {r.router} | {r.requests} | {r.hit_rate:.1%} | {r.of_ideal:.1%} | "
                     f"{r.hit_rate / max(rr.hit_rate, 1e-9):.2f}× | {r.ttft_p50:.3f} s | {r.ttft_p90:.3f} s | "
                     f"{r.route_p99_ms:.2f} ms |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f, default in asdict(FleetConfig()).items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(default), default=default)
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--json", help="write the results here")
    args = vars(ap.parse_args(argv))
    routers, out = args.pop("routers").split(","), args.pop("json")
    results = compare(FleetConfig(**args), routers)
    print(table(results))
    if out:
        with open(out, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
