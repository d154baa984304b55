"""The fleet's KV index: which replica holds which block, fed by the replicas' KV events.

    digest -> {replica: media}        media: GPU | CPU (a replica's own tiers), REMOTE is fleet-wide

Each replica's events (core/kv_events.py) arrive as numbered batches. A batch that is not the next
one (events were lost) makes the replica *unsynced*: its entries are dropped and it counts as
holding nothing until a snapshot (`resync`) replaces its view. A replica not heard from for
`stale_after` seconds (its events are switched off, or it hangs) is *stale*: the router does not
trust its entries either. `drop` forgets a replica that died.

Two estimates cover what the events have not told yet: a *pending* entry, written when a request is
routed (the replica will hold its prompt's blocks once it has run it; the entry lapses after
`pending_ttl` seconds), so a burst on a new prefix lands together; and the requests routed to a
replica that its last report had not yet received, added to its reported load.

Plain data only (hex digests, replica names as strings); no clock of its own: every call that needs
the time takes `now`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvpage.core.invariants import check

GPU, CPU, REMOTE = 1, 2, 4
MEDIA = {"gpu": GPU, "cpu": CPU, "remote": REMOTE}


@dataclass(frozen=True, slots=True)
class Load:
    """What a replica reports beside its events: its unfinished requests, the blocks of their
    prompts still to compute, and how many requests it has received in all."""

    requests: int = 0
    backlog: float = 0.0  # blocks
    received: int = 0


@dataclass(slots=True)
class ReplicaView:
    seq: int = 0  # the last batch applied
    synced: bool = True  # a replica starts empty: batch 1 is the next
    heard: bool = False  # it reported at least once (a view made by routing alone vouches for nothing)
    last_heard: float = 0.0
    reported: Load = Load()
    routed: int = 0  # requests routed to it (by this index's users)
    unreported: deque = field(default_factory=deque)  # (routed number, blocks to compute) not yet received
    held: dict[str, int] = field(default_factory=dict)  # digest -> media

    def report(self, load: Load) -> None:
        self.reported = load
        while self.unreported and self.unreported[0][0] <= load.received:
            self.unreported.popleft()

    @property
    def load(self) -> Load:
        """The report, plus the requests routed here that it had not received when it reported."""
        r = self.reported
        return Load(r.requests + len(self.unreported), r.backlog + sum(b for _, b in self.unreported), r.received)


@dataclass(frozen=True, slots=True)
class Match:
    """What one replica holds of a prompt's blocks, from the first on: `gpu` leading blocks in its
    GPU pool (`pending` of them only pending there), then `cpu` in its CPU tier, then `remote` in
    the shared tier."""

    gpu: int = 0
    cpu: int = 0
    remote: int = 0
    pending: int = 0

    @property
    def blocks(self) -> int:
        return self.gpu + self.cpu + self.remote


class KVIndex:
    def __init__(self, stale_after: float = 5.0, pending_ttl: float = 2.0, max_remote: int = 1 << 18) -> None:
        self.stale_after = stale_after
        self.pending_ttl = pending_ttl
        self.replicas: dict[str, ReplicaView] = {}
        self._where: dict[str, dict[str, int]] = {}  # digest -> {replica: media}
        # in the shared tier, oldest first: its server evicts without telling anyone, so the index keeps the
        # `max_remote` newest (a stale entry only makes the router price a block as cheaper than it is)
        self._remote: dict[str, None] = {}
        self.max_remote = max_remote
        self._pending: dict[str, dict[str, float]] = {}  # digest -> {replica: expiry}
        self.num_gaps = 0
        self.num_resyncs = 0
        self.num_events = 0

    # ------------------------------------------------------------------ feeding
    def apply(self, replica: str, seq: int, events: Iterable[dict], now: float, load: Load | None = None) -> bool:
        """Batch `seq` of `replica` (events as dicts, core/kv_events.py's shape). False: batches were
        lost in between, the replica is unsynced until `resync`."""
        view = self._view(replica, now, load)
        if seq <= view.seq:
            return view.synced  # a repeat (or a heartbeat that carries no batch)
        if not view.synced or seq != view.seq + 1:
            if view.synced:
                self.num_gaps += 1
            self._forget(replica, view)
            view.synced = False
            return False
        for event in events:
            self.num_events += 1
            kind = event["type"]
            if kind == "AllBlocksCleared":
                self._forget(replica, view)
                continue
            media = MEDIA[event["medium"]]
            for digest in event["block_hashes"]:
                if kind == "BlockStored":
                    self._add(replica, view, digest, media)
                else:
                    self._remove(replica, view, digest, media)
        view.seq = seq
        return True

    def heartbeat(self, replica: str, seq: int, now: float, load: Load | None = None) -> bool:
        """A report with no new batch: the replica is alive, at batch `seq`. False: it is past what
        was applied (batches were lost), resync."""
        view = self._view(replica, now, load)
        if seq != view.seq and view.synced:
            self.num_gaps += 1
            self._forget(replica, view)
            view.synced = False
        return view.synced

    def resync(self, replica: str, seq: int, blocks: Iterable[dict], now: float, load: Load | None = None) -> None:
        """`replica`'s whole view as of batch `seq` (its snapshot's BlockStored events)."""
        view = self._view(replica, now, load)
        self._forget(replica, view)
        self.num_resyncs += 1
        for event in blocks:
            for digest in event["block_hashes"]:
                self._add(replica, view, digest, MEDIA[event["medium"]])
        view.seq, view.synced = seq, True

    def drop(self, replica: str) -> None:
        """`replica` died or left: it holds nothing and is no candidate."""
        view = self.replicas.pop(replica, None)
        if view is not None:
            self._forget(replica, view)
        for holders in self._pending.values():
            holders.pop(replica, None)

    # ------------------------------------------------------------------ routing
    def trusted(self, replica: str, now: float) -> bool:
        """Whether `replica`'s entries describe it now: synced and heard from recently."""
        view = self.replicas.get(replica)
        return view is not None and view.heard and view.synced and now - view.last_heard <= self.stale_after

    def load(self, replica: str) -> Load:
        view = self.replicas.get(replica)
        return view.load if view is not None else Load()

    def match(self, digests: Sequence[str], replica: str, now: float) -> Match:
        """The leading blocks of a prompt (its chain digests, in order) `replica` holds."""
        gpu = cpu = remote = pending = 0
        for digest in digests:
            media = self._where.get(digest, {}).get(replica, 0)
            if media & GPU or self._pending.get(digest, {}).get(replica, 0.0) > now:
                if cpu or remote:
                    break
                gpu += 1
                pending += not media & GPU
            elif media & CPU:
                if remote:
                    break
                cpu += 1
            elif digest in self._remote:
                remote += 1
            else:
                break
        return Match(gpu, cpu, remote, pending)

    def routed(self, replica: str, digests: Sequence[str], now: float, blocks: float = 0.0) -> None:
        """A request with these digests went to `replica`, where `blocks` of its prompt are to be
        computed: pending there until its events (and load report) say."""
        view = self.replicas.setdefault(replica, ReplicaView(last_heard=now))
        view.routed += 1
        view.unreported.append((view.routed, blocks))
        until = now + self.pending_ttl
        for digest in digests:
            self._pending.setdefault(digest, {})[replica] = until

    def expire(self, now: float) -> None:
        """Drop lapsed pending entries (the index stays bounded by what replicas hold)."""
        for digest in [d for d, holders in self._pending.items() if all(t <= now for t in holders.values())]:
            del self._pending[digest]

    # ------------------------------------------------------------------ queries
    def num_blocks(self, replica: str) -> int:
        view = self.replicas.get(replica)
        return len(view.held) if view is not None else 0

    @property
    def num_remote(self) -> int:
        """Blocks known to be in the shared tier (written there by some replica)."""
        return len(self._remote)

    @property
    def num_digests(self) -> int:
        return len(self._where)

    def check_invariants(self) -> None:
        """The digest map and the replicas' own views say the same."""
        from_views = {(d, r, m) for r, v in self.replicas.items() for d, m in v.held.items()}
        from_map = {(d, r, m) for d, holders in self._where.items() for r, m in holders.items()}
        check(from_views == from_map, "the index's digest map and its replica views disagree")
        check(all(self._where.values()), "a digest with no holder is kept")
        check(all(m for v in self.replicas.values() for m in v.held.values()), "a held digest with no medium")
        check(len(self._remote) <= self.max_remote, "the shared tier's entries outgrew max_remote")

    # ------------------------------------------------------------------ internals
    def _view(self, replica: str, now: float, load: Load | None) -> ReplicaView:
        view = self.replicas.setdefault(replica, ReplicaView())
        view.last_heard, view.heard = now, True
        if load is not None:
            view.report(load)
        return view

    def _add(self, replica: str, view: ReplicaView, digest: str, media: int) -> None:
        if media == REMOTE:
            self._remote.pop(digest, None)
            self._remote[digest] = None
            if len(self._remote) > self.max_remote:
                del self._remote[next(iter(self._remote))]
            return
        view.held[digest] = view.held.get(digest, 0) | media
        self._where.setdefault(digest, {})[replica] = view.held[digest]

    def _remove(self, replica: str, view: ReplicaView, digest: str, media: int) -> None:
        if media == REMOTE:
            self._remote.pop(digest, None)
            return
        left = view.held.get(digest, 0) & ~media
        holders = self._where.get(digest)
        if left:
            view.held[digest] = left
            holders[replica] = left  # type: ignore[index]
            return
        view.held.pop(digest, None)
        if holders is not None:
            holders.pop(replica, None)
            if not holders:
                del self._where[digest]

    def _forget(self, replica: str, view: ReplicaView) -> None:
        for digest in view.held:
            holders = self._where.get(digest)
            if holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del self._where[digest]
        view.held = {}
