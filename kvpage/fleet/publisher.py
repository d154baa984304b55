"""A replica's reports to the KV index actor: its KV events, its load and its metrics.

engine thread, between steps --every `interval` s (a heartbeat every `heartbeat` s)-->
    KVIndexActor.report(replica, batches since the last sent, load, sent_at, metric families)
a report refused (a gap) or a log that dropped batches --> KVIndexActor.resync(snapshot)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict

import ray

from kvpage.fleet.index_actor import index_actor
from kvpage.fleet.metric_families import Families

log = logging.getLogger("kvpage.fleet")


class EventPublisher:
    """Runs in a replica's engine thread between steps: every `interval` seconds (at least every
    `heartbeat` when nothing changed) it sends the index the batches since the last sent, the load
    and the replica's metric families (`families()`: server/metrics.py's Metrics.families). One report
    in flight at a time (non-blocking); a report refused (a gap), or a log that dropped batches, is
    followed by a snapshot."""

    def __init__(self, replica: str, engine, families: Callable[[], Families], index_name: str,
                 events: bool = True, interval: float = 0.02, heartbeat: float = 1.0) -> None:  # fmt: skip
        self.replica, self.engine, self.families = replica, engine, families
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
        counted again when the requests change, else at most every 0.1 s."""
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
            metrics = self.families()
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
