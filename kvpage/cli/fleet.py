"""`kvpage serve --replicas N`: N engines on Ray Serve behind --router (kvpage/fleet/ray_app.py), and its
options, declared as fields as ServeOptions' are."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvpage.cli.engine import engine_kwargs
from kvpage.cli.options import add_options
from kvpage.cli.serve_options import app_kwargs
from kvpage.config import option


@dataclass(slots=True)
class FleetOptions:
    """Declared, never built: `kvpage serve`'s "fleet (Ray Serve)" options."""

    replicas: int | None = option(
        None,
        "serve from N engine replicas on Ray Serve (a local Ray cluster, unless --ray-address)",
        type=int,
        metavar="N",
    )
    router: str = option(
        "kv",
        "how the fleet routes: kv (by the blocks each replica holds, from its KV events; the "
        "default), round_robin, pow2 (Ray Serve's default) or ray_prefix (Ray Serve LLM's "
        "PrefixCacheAffinityRouter)",
        choices=["kv", "round_robin", "pow2", "ray_prefix"],  # ray_routing.ROUTERS, whose module imports ray
    )
    ray_address: str | None = option(
        None, "join this Ray cluster (e.g. auto, or HOST:6379) instead of starting one", metavar="ADDR"
    )
    no_kv_events: bool = option(False, "replicas publish no KV events (the kv router then trusts none and falls back)")


def add_fleet_options(p: argparse.ArgumentParser) -> None:
    add_options(p.add_argument_group("fleet (Ray Serve)"), FleetOptions)


def serve_fleet(args: argparse.Namespace, keys: list[str]) -> int:
    import signal
    import threading

    from kvpage.fleet.ray_app import Fleet, FleetSpec

    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    spec = FleetSpec(engine_kwargs(args), args.replicas, args.router, args.host, args.port,
                     events=not args.no_kv_events, app_kwargs=app_kwargs(args, keys),
                     root_path=args.root_path)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fleet = Fleet(spec, ray_address=args.ray_address)
    try:
        where = args.ray_address or "a local Ray cluster"
        print(f"kvpage serve: {args.model} x {args.replicas} replicas on {where}, router {args.router}, "
              f"on http://{args.host}:{args.port}", flush=True)  # fmt: skip
        stop.wait()
    finally:
        fleet.stop()
    return 0
