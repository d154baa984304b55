"""A fleet of kvpage replicas on Ray Serve, behind a router that knows every replica's KV blocks:
how to run one (`FleetSpec`, `Fleet`: `kvpage serve --replicas N`).

    client --HTTP--> FleetIngress (ingress.py: the OpenAI API: tokenizes once, applies the chat template,
                     computes the prompt's chain digests with the core's hash and cache_salt)
                 --DeploymentHandle, routed by the request router (ray_routing.py)--> KVReplica x N
                     (replica.py: an LLMEngine each)
    KVReplica --KV events + load + metric families, every ~20 ms from its engine thread (publisher.py)-->
                     KVIndexActor (index_actor.py)
    KVRouter (in the ingress process) --one call per request--> KVIndexActor.route

Routers (`router=`): "kv" (KVRouter: the index's KVAware policy, routing.py/index.py), "round_robin",
"pow2" (Ray Serve's default power-of-two choices) and "ray_prefix" (Ray Serve LLM's
PrefixCacheAffinityRouter: a character-level tree of past routing), the last two Ray's own.

A replica that dies is dropped from the index (Ray tells the router; the index also stops trusting
a replica it has not heard from in `stale_after` seconds); only its in-flight requests fail. A
replica whose events were lost (a gap) or are switched off is not trusted until it resyncs; when no
candidate can be trusted the kv router falls back to power-of-two, and says so in /metrics
(fleet_metrics.py) and the log. The index actor gone: the router falls back the same way; replicas
keep serving.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import ray
from ray import serve

from kvpage.fleet.index_actor import INDEX_NAMESPACE, KVIndexActor, index_actor
from kvpage.fleet.ingress import FleetIngress
from kvpage.fleet.ray_routing import ROUTERS, router_config
from kvpage.fleet.replica import KVReplica

APP_NAME = "kvpage"


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
