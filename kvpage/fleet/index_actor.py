"""The KV index actor: the fleet's one KVIndex (index.py) and kv policy (routing.KVAware) on Ray.

Replicas report to it (publisher.py), the kv router asks it (ray_routing.py), the ingress reads its
`stats()` for /metrics and the dashboard. It also keeps each replica's latest metrics, as plain
metric families (metric_families.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict

import ray

from kvpage.fleet.index import KVIndex, Load
from kvpage.fleet.latency import quantile
from kvpage.fleet.metric_families import Families
from kvpage.fleet.routing import KVAware, RouteRequest

INDEX_NAMESPACE = "kvpage"


@ray.remote(num_cpus=0)
class KVIndexActor:
    """The fleet's KV index and the kv policy, one per fleet: replicas report to it, the kv router
    asks it. Also keeps each replica's latest metric families."""

    def __init__(self, stale_after: float = 5.0, pending_ttl: float = 2.0, **policy) -> None:
        self.index = KVIndex(stale_after=stale_after, pending_ttl=pending_ttl)
        self.policy = KVAware(self.index, **policy)
        self.metrics: dict[str, Families] = {}
        self.events_off: set[str] = set()
        self.route_seconds: deque[float] = deque(maxlen=4096)
        self.lag_seconds: deque[float] = deque(maxlen=4096)
        self.num_routed = 0

    def report(self, replica: str, batches: list, load: tuple, sent_at: float, metrics: Families | None,
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
    """The running KVIndexActor named `name`."""
    return ray.get_actor(name, namespace=INDEX_NAMESPACE)
