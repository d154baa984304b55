"""A fleet of kvpage replicas on Ray Serve, behind a router that knows every replica's KV blocks.

    client --HTTP--> FleetIngress (the OpenAI API: tokenizes once, applies the chat template,
                     computes the prompt's chain digests with the core's hash and cache_salt)
                 --DeploymentHandle, routed by the RequestRouter--> KVReplica x N (an LLMEngine each)
    KVReplica --KV events + load + metrics, every ~20 ms from its engine thread--> KVIndexActor
    RequestRouter (in the ingress process) --one call per request--> KVIndexActor.route

Routers (`router=`): "kv" (KVRouter: the index's KVAware policy, routing/index.py), "round_robin",
"pow2" (Ray Serve's default power-of-two choices) and "ray_prefix" (Ray Serve LLM's
PrefixCacheAffinityRouter: a character-level tree of past routing), the last two Ray's own.

A replica that dies is dropped from the index (Ray tells the router; the index also stops trusting
a replica it has not heard from in `stale_after` seconds); only its in-flight requests fail. A
replica whose events were lost (a gap) or are switched off is not trusted until it resyncs; when no
candidate can be trusted the kv router falls back to power-of-two, and says so in /metrics and the
log. The index actor gone: the router falls back the same way; replicas keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvpage.fleet.index import KVIndex, Load
from kvpage.fleet.latency import quantile
from kvpage.fleet.routing import KVAware, RouteRequest
from kvpage.sampling_params import BeamSearchParams, SamplingParams

log = logging.getLogger("kvpage.fleet")

ROUTERS = ("kv", "round_robin", "pow2", "ray_prefix")
INDEX_NAMESPACE = "kvpage"
APP_NAME = "kvpage"


@dataclass(slots=True)
class FleetRequest:
    """One engine request as it crosses from the ingress to a replica: plain data."""

    request_id: str
    prompt: str  # the prompt's text (Ray's prefix router reads `.prompt`)
    token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    cache_salt: str | None
    digests: tuple[str, ...]  # the prompt's chain digests (routing.RouteRequest.of)


# ---------------------------------------------------------------------- the index
@ray.remote(num_cpus=0)
class KVIndexActor:
    """The fleet's KV index (index.py) and the kv policy (routing.KVAware), one per fleet: replicas
    report to it, the kv router asks it. Also keeps each replica's latest /metrics text."""

    def __init__(self, stale_after: float = 5.0, pending_ttl: float = 2.0, **policy) -> None:
        self.index = KVIndex(stale_after=stale_after, pending_ttl=pending_ttl)
        self.policy = KVAware(self.index, **policy)
        self.metrics: dict[str, str] = {}
        self.events_off: set[str] = set()
        self.route_seconds: deque[float] = deque(maxlen=4096)
        self.lag_seconds: deque[float] = deque(maxlen=4096)
        self.num_routed = 0

    def report(self, replica: str, batches: list, load: tuple, sent_at: float, metrics: str | None,
               events: bool = True) -> bool:  # fmt: skip
        """Batches [(seq, [event dicts])] since the last report (none: a heartbeat at `load`'s seq).
        False: a batch is missing, send a snapshot (`resync`)."""
        now = time.monotonic()
        if metrics is not None:
            self.metrics[replica] = metrics
        seq, rest = load[0], Load(*load[1:])
        if not events:  # the replica publishes no events: never trusted, and said so
            self.events_off.add(replica)
            self.index.drop(replica)
            return True
        self.events_off.discard(replica)
        ok = True
        for bseq, evs in batches:
            ok = self.index.apply(replica, bseq, evs, now, rest)
            if not ok:
                break
        if not batches:
            ok = self.index.heartbeat(replica, seq, now, rest)
        elif ok:
            self.lag_seconds.append(max(0.0, time.time() - sent_at))
        self.index.expire(now)
        return ok

    def resync(self, replica: str, seq: int, blocks: list, load: tuple) -> None:
        self.index.resync(replica, seq, blocks, time.monotonic(), Load(*load[1:]))

    def route(self, digests: tuple[str, ...], candidates: list[str]) -> list[str]:
        t0 = time.perf_counter()
        now = time.monotonic()
        req = RouteRequest((), tuple(digests))
        ranking = self.policy.rank(req, candidates, now)
        self.policy.routed(req, ranking[0], now)
        self.num_routed += 1
        self.route_seconds.append(time.perf_counter() - t0)
        return ranking

    def drop(self, replica: str) -> None:
        self.index.drop(replica)
        self.metrics.pop(replica, None)

    def keep_only(self, replicas: list[str]) -> None:
        for r in set(self.index.replicas) - set(replicas):
            self.drop(r)

    def stats(self) -> dict:
        now = time.monotonic()
        ix = self.index
        return {
            "replicas": {
                r: {
                    "trusted": ix.trusted(r, now),
                    "synced": v.synced,
                    "seq": v.seq,
                    "blocks": len(v.held),
                    "heard_ago": now - v.last_heard,
                    "load": asdict(v.load),
                }
                for r, v in ix.replicas.items()
            },  # fmt: skip
            "events_off": sorted(self.events_off),
            "gaps": ix.num_gaps,
            "resyncs": ix.num_resyncs,
            "events": ix.num_events,
            "remote_blocks": ix.num_remote,
            "fallbacks": self.policy.fallbacks,
            "routed": self.num_routed,
            "route_p50": quantile(self.route_seconds, 0.5),
            "route_p99": quantile(self.route_seconds, 0.99),
            "lag_p50": quantile(self.lag_seconds, 0.5),
            "lag_p99": quantile(self.lag_seconds, 0.99),
            "metrics": dict(self.metrics),
        }


def index_actor(name: str):
    return ray.get_actor(name, namespace=INDEX_NAMESPACE)


# ---------------------------------------------------------------------- routers
class KVRouter(RequestRouter):
    """Ray Serve's side of the kv policy: ranks the candidates by the index's cost (one actor call),
    best first, each in a rank of its own (Ray takes the first that accepts). The index unreachable:
    power-of-two choices (Ray probes the pair's queues), counted and logged."""

    def initialize_state(self, index_name: str = "", timeout_s: float = 1.0) -> None:
        self._index_name = index_name
        self._timeout = timeout_s
        self._index = None
        self.fallbacks = 0
        self._warned = False

    def _actor(self):
        if self._index is None:
            self._index = index_actor(self._index_name)
        return self._index

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        freq = _fleet_request(pending_request)
        if freq is None or len(by_id) < 2:
            return [candidate_replicas]
        try:
            ranking = await asyncio.wait_for(self._actor().route.remote(freq.digests, sorted(by_id)), self._timeout)
            self._warned = False
            return [[by_id[r]] for r in ranking if r in by_id]
        except Exception as e:  # noqa: BLE001 - the index is down or slow: route anyway, and say so
            self._index = None
            self.fallbacks += 1
            if not self._warned:
                log.warning("kv router: the KV index is unreachable (%r); routing by power-of-two choices", e)
                self._warned = True
            return [random.sample(candidate_replicas, 2)]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with contextlib.suppress(Exception):  # (the index also forgets it when it goes stale)
            self._actor().drop.remote(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        with contextlib.suppress(Exception):
            self._actor().keep_only.remote([r.replica_id.unique_id for r in replicas])


class RoundRobinRouter(RequestRouter):
    """Each replica in turn, blind to the cache: what a plain load balancer does."""

    def initialize_state(self) -> None:
        self._next = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        i = self._next % len(ordered)
        self._next += 1
        return [[r] for r in ordered[i:] + ordered[:i]]


def _fleet_request(pending: PendingRequest | None):
    if pending is None:
        return None
    # by shape, not class: Serve ships deployment classes by value, so the ingress's FleetRequest may
    # be a copy of this module's
    return next((a for a in pending.args if hasattr(a, "digests") and hasattr(a, "token_ids")), None)


def router_config(router: str, index_name: str) -> RequestRouterConfig:
    if router == "pow2":
        return RequestRouterConfig()  # Ray Serve's default: power-of-two choices
    if router == "kv":
        # by import path: a class object would travel by value, with a copy of FleetRequest beside it
        return RequestRouterConfig(request_router_class=f"{__name__}.KVRouter",
                                   request_router_kwargs={"index_name": index_name})  # fmt: skip
    if router == "round_robin":
        return RequestRouterConfig(request_router_class=f"{__name__}.RoundRobinRouter")
    if router == "ray_prefix":
        # Ray Serve LLM's own (ray.serve.llm.request_router re-exports it, but that package needs
        # pyarrow and the rest of ray[llm]; the router itself does not)
        path = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
        return RequestRouterConfig(request_router_class=path)
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {router!r}")


# ---------------------------------------------------------------------- a replica
class EventPublisher:
    """Runs in a replica's engine thread between steps: every `interval` seconds (at least every
    `heartbeat` when nothing changed) it sends the index the batches since the last sent, the load
    and the replica's metrics text. One report in flight at a time (non-blocking); a report refused
    (a gap), or a log that dropped batches, is followed by a snapshot."""

    def __init__(self, replica: str, engine, metrics, index_name: str, events: bool = True,
                 interval: float = 0.02, heartbeat: float = 1.0) -> None:  # fmt: skip
        self.replica, self.engine, self.metrics = replica, engine, metrics
        self.index_name, self.events = index_name, events
        self.interval, self.heartbeat = interval, heartbeat
        self.received = 0  # requests this replica accepted (the index compares it with what it routed)
        self._sent = 0
        self._resync = True
        self._inflight = None
        self._last = 0.0
        self._index = None
        self._warned = False
        self._backlog, self._backlog_key, self._backlog_at = 0.0, (), 0.0

    def _load(self, now: float) -> tuple:
        """(batch, requests, backlog blocks, received). The backlog hashes every waiting prompt: it is
        counted again when the requests change, else at most every `backlog_every` seconds."""
        sched, bs = self.engine.scheduler, self.engine.kv_events.block_size
        key = (len(sched.requests), self.received, self.engine.num_steps)
        if key[:2] != self._backlog_key[:2] or (key != self._backlog_key and now - self._backlog_at >= 0.1):
            self._backlog, self._backlog_key, self._backlog_at = sched.num_backlog_tokens() / bs, key, now
        return (self._sent, len(sched.requests), self._backlog, self.received)

    def __call__(self) -> None:
        now = time.monotonic()
        log_ = self.engine.kv_events
        if self._inflight is not None:
            ready, _ = ray.wait([self._inflight], timeout=0)
            if not ready:
                return
            try:
                if ray.get(ready[0]) is False:
                    self._resync = True
            except Exception as e:  # noqa: BLE001 - the index died or restarted: find it again, resync
                self._index, self._resync = None, True
                if not self._warned:
                    log.warning("replica %s: the KV index is unreachable (%r); will resync", self.replica, e)
                    self._warned = True
            self._inflight = None
        if now - self._last < self.interval or (log_.seq == self._sent and now - self._last < self.heartbeat):
            return
        self._last = now
        try:
            if self._index is None:
                self._index = index_actor(self.index_name)
            metrics = self.metrics.render().decode()
            if self.events and self._resync:
                seq, blocks = log_.snapshot()
                self._sent, self._resync = seq, False
                self._index.resync.remote(self.replica, seq, [asdict(b) for b in blocks], self._load(now))
            batches, gap = log_.since(self._sent)
            if gap:
                self._resync = True
                return
            if batches:
                self._sent = batches[-1].seq
            payload = [(b.seq, [asdict(e) for e in b.events]) for b in batches] if self.events else []
            self._inflight = self._index.report.remote(self.replica, payload, self._load(now), time.time(), metrics,
                                                       self.events)  # fmt: skip
            self._warned = False
        except Exception as e:  # noqa: BLE001 - no index (yet): serve on, try again next time
            self._index = None
            if not self._warned:
                log.warning("replica %s: cannot reach the KV index (%r)", self.replica, e)
                self._warned = True


class KVReplica:
    """One engine: an LLMEngine in its own AsyncEngine loop, publishing its KV events to the index."""

    def __init__(self, engine_kwargs: dict, index_name: str, threads: int | None = None, events: bool = True) -> None:
        import torch

        from kvpage.config import EngineConfig
        from kvpage.engine.llm_engine import LLMEngine
        from kvpage.server.async_engine import AsyncEngine
        from kvpage.server.metrics import Metrics

        if threads:
            torch.set_num_threads(threads)
        self.engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs))
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.metrics = Metrics(self.engine, engine_kwargs.get("model", "kvpage"))
        self.aengine = AsyncEngine(self.engine, on_output=self.metrics.observe, on_abort=self.metrics.aborted)
        self.publisher = EventPublisher(self.replica, self.engine, self.metrics, index_name, events)
        self.aengine.between_steps.append(self.publisher)
        self.aengine.start()

    def describe(self):
        from kvpage.server.engine_client import EngineDescription

        return EngineDescription.of(self.engine)

    def replica_id(self) -> str:
        return self.replica

    async def generate(self, freq: FleetRequest):
        self.publisher.received += 1
        async for out in self.aengine.generate(freq.request_id, freq.token_ids, freq.params, freq.cache_salt):
            yield out

    def check_health(self) -> None:  # Ray Serve's health check: a dead engine thread restarts the replica
        if not self.aengine.alive:
            raise RuntimeError(f"the engine stopped: {self.aengine.error!r}")

    def __del__(self) -> None:
        aengine = getattr(self, "aengine", None)
        if aengine is not None:
            aengine.begin_shutdown()
            aengine.shutdown()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()  # a tensor-parallel replica's other ranks, by pid


# ---------------------------------------------------------------------- the ingress
class FleetClient:
    """The engine client (server/engine_client.py) of a fleet: requests go through the replicas'
    DeploymentHandle (routed by the deployment's router), outputs stream back."""

    def __init__(self, handle, description, index_name: str | None) -> None:
        self.engine = description
        self._handle = handle.options(stream=True)
        self.index_name = index_name
        self.closing = False
        self.error = None
        self.on_death = None
        self.alive = True

    def start(self) -> None:
        pass

    def begin_shutdown(self) -> None:
        self.closing = True

    def shutdown(self) -> None:
        pass

    async def generate(self, request_id: str, prompt, params, cache_salt: str | None = None):
        tok = self.engine.tokenizer
        ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        text = prompt if isinstance(prompt, str) else tok.decode(ids, skip_special_tokens=False)
        digests = RouteRequest.of(ids, self.engine.block_size, cache_salt).digests
        gen = self._handle.generate.remote(FleetRequest(request_id, text, ids, params, cache_salt, digests))
        finished = False
        try:
            async for out in gen:
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                gen.cancel()


class FleetMetrics:
    """/metrics of a fleet: every replica's own metrics, each sample labelled replica="ID" (their
    latest report to the index, at most a second old), and the fleet's: kvpage:fleet_* (the router,
    the index, event lag)."""

    def __init__(self, index_name: str | None, router: str, report_every: float = 0.5) -> None:
        self.index_name, self.router = index_name, router
        self.report_every = report_every
        self._report, self._report_at = None, -1e9

    async def load_report(self) -> dict | None:
        """The fleet's ORCA load report (app.py): the replicas' mean KV-cache usage and their waiting requests,
        from their latest metrics reports to the index (asked at most every `report_every` seconds)."""
        if self.index_name is None:
            return None
        now = time.monotonic()
        if now - self._report_at >= self.report_every:
            self._report_at = now
            try:
                st = await asyncio.wait_for(index_actor(self.index_name).stats.remote(), 2.0)
                self._report = fleet_load(st["metrics"])
            except Exception:  # noqa: BLE001 - the index is away: no report rather than a stale one
                self._report = None
        return self._report

    async def render(self) -> bytes:
        lines = [f'# TYPE kvpage:fleet_router_info gauge\nkvpage:fleet_router_info{{router="{self.router}"}} 1']
        if self.index_name is None:
            return ("\n".join(lines) + "\n").encode()
        try:
            st = await asyncio.wait_for(index_actor(self.index_name).stats.remote(), 2.0)
        except Exception as e:  # noqa: BLE001
            lines.append(f"# TYPE kvpage:fleet_index_up gauge\nkvpage:fleet_index_up 0\n# {e!r}".replace("\n#", "\n# "))
            return ("\n".join(lines) + "\n").encode()
        lines += ["# TYPE kvpage:fleet_index_up gauge", "kvpage:fleet_index_up 1"]
        for name, doc, value in (
            ("fleet_routed_total", "requests the kv index ranked", st["routed"]),
            ("fleet_router_fallbacks_total", "requests routed by power-of-two: no replica's KV events trusted",
             st["fallbacks"]),
            ("fleet_kv_event_gaps_total", "reports that did not follow on from the last (events lost)", st["gaps"]),
            ("fleet_kv_resyncs_total", "replica views replaced by a snapshot (at start, after a gap or a restart)",
             st["resyncs"]),
            ("fleet_kv_events_total", "KV events applied to the index", st["events"]),
        ):  # fmt: skip
            lines += [f"# HELP kvpage:{name} {doc}", f"# TYPE kvpage:{name} counter", f"kvpage:{name} {value}"]
        for name, key in (("fleet_route_seconds", "route"), ("fleet_kv_event_lag_seconds", "lag")):
            lines.append(f"# TYPE kvpage:{name} gauge")
            for q in ("p50", "p99"):
                lines.append(f'kvpage:{name}{{quantile="{q}"}} {st[f"{key}_{q}"]}')
        lines.append("# TYPE kvpage:fleet_replica_trusted gauge")
        for r, v in sorted(st["replicas"].items()):
            lines.append(f'kvpage:fleet_replica_trusted{{replica="{r}"}} {int(v["trusted"])}')
        for r in st["events_off"]:
            lines.append(f'kvpage:fleet_replica_trusted{{replica="{r}"}} 0')
        lines += [
            "# HELP kvpage:fleet_remote_blocks blocks the index knows in the shared KV tier (--remote-kv)",
            "# TYPE kvpage:fleet_remote_blocks gauge",
            f"kvpage:fleet_remote_blocks {st['remote_blocks']}",
        ]
        lines.append("# TYPE kvpage:fleet_replica_blocks gauge")
        for r, v in sorted(st["replicas"].items()):
            lines.append(f'kvpage:fleet_replica_blocks{{replica="{r}"}} {v["blocks"]}')
        lines.append(relabel(st["metrics"]))
        return ("\n".join(lines) + "\n").encode()


def fleet_load(texts: dict[str, str]) -> dict | None:
    """Mean kv_cache_usage_perc and summed num_requests_waiting over replicas' metrics texts."""
    from kvpage.server.metrics import samples_of

    usage, waiting = "kvpage:kv_cache_usage_perc", "kvpage:num_requests_waiting"
    found = [samples_of(text, usage, waiting) for text in texts.values()]
    found = [f for f in found if usage in f]
    if not found:
        return None
    return {usage.split(":")[1]: sum(f[usage] for f in found) / len(found),
            waiting.split(":")[1]: int(sum(f.get(waiting, 0) for f in found))}  # fmt: skip


def relabel(texts: dict[str, str]) -> str:
    """Several replicas' Prometheus texts as one, each sample labelled with its replica."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            entry = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            for s in fam.samples:
                entry[2].append((s.name, {**s.labels, "replica": replica}, s.value))
    out = []
    for name, (kind, doc, samples) in families.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for sname, labels, value in samples:
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            out.append(f"{sname}{{{body}}} {value}")
    return "\n".join(out)


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class FleetIngress:
    """The OpenAI API of the fleet (server/app.py over a FleetClient)."""

    async def __init__(self, replicas, index_name: str | None, router: str, app_kwargs: dict) -> None:
        description = await replicas.describe.remote()
        self.client = FleetClient(replicas, description, index_name)
        self.metrics = FleetMetrics(index_name, router)
        self.app_kwargs = app_kwargs

    def __serve_build_asgi_app__(self):
        from kvpage.server.app import build_app
        from kvpage.server.dashboard import FleetFeed

        name = self.client.index_name
        feed = None if name is None else FleetFeed(lambda: index_actor(name).stats.remote())
        return build_app(client=self.client, metrics=self.metrics, dashboard=feed, **self.app_kwargs)


@dataclass(slots=True)
class FleetSpec:
    """How to run a fleet: `replicas` engines built from `engine_kwargs` (EngineConfig's fields),
    routed by `router`, served at host:port."""

    engine_kwargs: dict = field(default_factory=dict)
    replicas: int = 2
    router: str = "kv"
    host: str = "127.0.0.1"
    port: int = 8000
    events: bool = True  # replicas publish KV events (off: the kv router can trust none, and says so)
    threads_per_replica: int | None = None
    cpus_per_replica: float | None = None
    app_kwargs: dict = field(default_factory=dict)  # build_app's: served_model_name, api_key, ...
    root_path: str = ""  # behind a proxy serving the fleet under this path prefix (and stripping it)

    def check(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {self.router!r}")


def _deployment_errors() -> str:
    """The last line of each failed deployment's message (a replica's exception, e.g. a bad engine option)."""
    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception as e:  # noqa: BLE001 - the controller may be gone too
        return f"(no deployment status: {e!r})"
    lines = []
    for name, d in app.deployments.items() if app is not None else ():
        tail = [ln for ln in (d.message or "").splitlines() if ln.strip()]
        if tail:
            lines.append(f"{name}: {tail[-1].strip()}")
    return "\n".join(lines)


def build_application(spec: FleetSpec, index_name: str | None):
    spec.check()
    cores = os.cpu_count() or 1
    cpus = spec.cpus_per_replica if spec.cpus_per_replica is not None else max(0.01, cores / spec.replicas * 0.9)
    threads = spec.threads_per_replica or max(1, cores // spec.replicas)
    # a tensor-parallel replica (kvpage/distributed) is a group of N processes: Ray reserves a bundle of
    # CPUs for each rank, all on one node (STRICT_PACK), the replica's actor in the first; the replica
    # spawns its other ranks there and gives each 1/N of its threads
    tp = int(spec.engine_kwargs.get("tensor_parallel_size", 1) or 1)
    placement = {}
    if tp > 1:
        cpus = cpus / tp
        placement = {"placement_group_bundles": [{"CPU": cpus}] * tp, "placement_group_strategy": "STRICT_PACK"}
    replica = serve.deployment(
        KVReplica,
        name="KVReplica",
        num_replicas=spec.replicas,
        max_ongoing_requests=1024,
        ray_actor_options={"num_cpus": cpus},
        **placement,
        request_router_config=router_config(spec.router, index_name or ""),
        health_check_period_s=2,
        health_check_timeout_s=30,
    )
    ingress = serve.deployment(serve.ingress()(FleetIngress), name="FleetIngress", max_ongoing_requests=4096,
                               ray_actor_options={"num_cpus": 0})  # fmt: skip
    replicas = replica.bind(spec.engine_kwargs, index_name or "", threads, spec.events)
    return ingress.bind(replicas, index_name, spec.router, spec.app_kwargs)


class Fleet:
    """A running fleet: starts a local Ray cluster (or joins `ray_address`), the KV index actor, and
    the Serve application; `url` is its OpenAI base. Use as a context manager, or call `stop()`."""

    def __init__(self, spec: FleetSpec, ray_address: str | None = None, num_cpus: int | None = None) -> None:
        spec.check()
        self.spec = spec
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            ray.init(address=ray_address, num_cpus=num_cpus if ray_address is None else None,
                     include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
                     namespace=INDEX_NAMESPACE)  # fmt: skip
        # under every router (the kv router ranks with it; for all it gathers the replicas' KV picture and
        # metrics); restarted if it dies, empty: the replicas' next reports find the gap and resync
        self.index_name = f"kvpage-kv-index-{os.getpid()}-{time.time_ns()}"
        self.index = KVIndexActor.options(name=self.index_name, namespace=INDEX_NAMESPACE,
                                          max_restarts=-1).remote()  # fmt: skip
        serve.start(http_options={"host": spec.host, "port": spec.port, "root_path": spec.root_path})
        try:
            serve.run(build_application(spec, self.index_name), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as e:  # Serve says which deployment failed; its replicas' own error says why
            raise RuntimeError(f"{e}\n{_deployment_errors()}") from None
        self.url = f"http://{spec.host}:{spec.port}/v1"

    def stats(self) -> dict | None:
        return ray.get(index_actor(self.index_name).stats.remote()) if self.index_name else None

    def replica_actor(self, replica: str):
        """The Ray actor of the replica named `replica` in the index (to kill one in a test)."""
        return ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#KVReplica#{replica}", namespace="serve")

    def stop(self) -> None:
        try:
            serve.shutdown()
        finally:
            if self._own_ray:
                ray.shutdown()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
