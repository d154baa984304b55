"""A fleet's /metrics and ORCA load report, from the KV index actor's stats (index_actor.py).

/metrics: the fleet's own kvpage:fleet_* (the router, the index, event lag), then every replica's
metrics from its latest report to the index (at most a second old), each sample labelled replica="ID":
plain families (metric_families.py) until here, rendered to text once.
"""

from __future__ import annotations

import asyncio
import time

from kvpage.fleet.index_actor import index_actor
from kvpage.fleet.metric_families import fleet_load, merged_text


class FleetMetrics:
    """/metrics of a fleet (`render()`), and its ORCA load report (`load_report()`)."""

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
        for name, doc, v in (
            ("fleet_routed_total", "requests the kv index ranked", st["routed"]),
            ("fleet_router_fallbacks_total", "requests routed by power-of-two: no replica's KV events trusted",
             st["fallbacks"]),
            ("fleet_kv_event_gaps_total", "reports that did not follow on from the last (events lost)", st["gaps"]),
            ("fleet_kv_resyncs_total", "replica views replaced by a snapshot (at start, after a gap or a restart)",
             st["resyncs"]),
            ("fleet_kv_events_total", "KV events applied to the index", st["events"]),
        ):  # fmt: skip
            lines += [f"# HELP kvpage:{name} {doc}", f"# TYPE kvpage:{name} counter", f"kvpage:{name} {v}"]
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
        lines.append(merged_text(st["metrics"]))
        return ("\n".join(lines) + "\n").encode()
