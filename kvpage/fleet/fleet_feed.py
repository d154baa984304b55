"""The fleet ingress's /dashboard feed (server/dashboard.py draws it): the replicas as the KV index sees
them (trust, blocks held, load), each with its KV-cache usage from its latest metric families, polled
from the index actor's `stats()` while somebody watches.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from kvpage.fleet.metric_families import value


class FleetFeed:
    """`pictures()`: one picture of the fleet every `interval` seconds (`stats()`: an awaitable of
    KVIndexActor.stats())."""

    def __init__(self, stats: Callable[[], object], interval: float = 0.5) -> None:
        self.stats, self.interval = stats, interval

    async def pictures(self, timeout: float = 1.0) -> AsyncIterator[str | None]:
        step = 0
        while True:
            try:
                st = await asyncio.wait_for(self.stats(), 5.0)
                fleet = fleet_view(st)
            except Exception as e:  # noqa: BLE001 - the index is away: say so, try again
                fleet = {"error": repr(e), "replicas": []}
            step += 1
            yield json.dumps({"step": step, "time": time.time(), "stats": None, "memory": None, "requests": [],
                              "scheduler": None, "fleet": fleet}, separators=(",", ":"))  # fmt: skip
            await asyncio.sleep(self.interval)


def fleet_view(st: dict) -> dict:
    """The index's stats as the page shows them: one entry per replica, usage from its metric families."""
    replicas = []
    for name, v in sorted(st["replicas"].items()):
        families = st.get("metrics", {}).get(name, {})
        replicas.append({"replica": name, "trusted": v["trusted"], "synced": v["synced"], "indexed_blocks": v["blocks"],
                         "heard_ago": v["heard_ago"], "load": v["load"],
                         "usage": value(families, "kvpage:kv_cache_usage_perc"),
                         "used_blocks": value(families, "kvpage:kv_cache_blocks", state="used")})  # fmt: skip
    for name in st.get("events_off", ()):
        replicas.append({"replica": name, "trusted": False, "events_off": True})
    keys = ("routed", "fallbacks", "gaps", "resyncs", "remote_blocks", "lag_p50", "lag_p99")
    return {"replicas": replicas, **{k: st.get(k) for k in keys}}
