"""Ray Serve's request routers for a fleet, and the config that picks one (`router=`).

    kv           KVRouter: the index actor's KVAware ranking (routing.py), one actor call per request
    round_robin  RoundRobinRouter: each replica in turn
    pow2         Ray Serve's default, power-of-two choices
    ray_prefix   Ray Serve LLM's PrefixCacheAffinityRouter: a character-level tree of past routing

A router runs in the ingress's process, beside the replicas' deployment handle; Serve pickles its
module by value to get it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvpage.fleet.index_actor import index_actor

log = logging.getLogger("kvpage.fleet")

ROUTERS = ("kv", "round_robin", "pow2", "ray_prefix")


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
    # by shape, not class: Serve ships deployment classes (and a router's module) by value, so the
    # ingress's FleetRequest may be a copy of replica.py's
    return next((a for a in pending.args if hasattr(a, "digests") and hasattr(a, "token_ids")), None)


def router_config(router: str, index_name: str) -> RequestRouterConfig:
    """The deployment's router config for `router` (one of ROUTERS); `index_name`: the kv router's index actor."""
    if router == "pow2":
        return RequestRouterConfig()  # Ray Serve's default: power-of-two choices
    if router == "kv":
        # by import path (Serve imports it here and pickles its module by value)
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
