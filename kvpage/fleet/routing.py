"""Which replica takes a request: policies as objects, each `rank(request, candidates, now)` -> the
candidates best first. Torch-free and Ray-free; the Ray Serve request router (ray_routing.py) and the
fleet simulation (tools/fleet_sim.py) call the same objects.

    RoundRobin      the load balancer in front of most fleets: blind to the cache
    PowerOfTwo      two random candidates, the less loaded first (Ray Serve's default)
    PrefixHistory   an approximate tree of the prompts routed so far (SGLang's router, Ray's
                    PrefixCacheAffinityRouter): the longest routed prefix wins while loads are close
    KVAware         the index of what each replica really holds (index.py, fed by KV events): the
                    fewest blocks left to compute, weighed with load; power-of-two when the index
                    cannot be trusted, and it says so (`fallbacks`)

A request is plain data: its prompt's chain digests (the core's own hash, with its cache_salt) and
token ids.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpage.core.cache_key import block_digests
from kvpage.fleet.index import KVIndex

log = logging.getLogger("kvpage.fleet")


@dataclass(frozen=True, slots=True)
class RouteRequest:
    token_ids: tuple[int, ...]
    digests: tuple[str, ...]  # hex chain digests of the prompt's full blocks (those a cache can serve)

    @staticmethod
    def of(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> RouteRequest:
        """The digests a replica's prefix cache would look up for this prompt (never its last token)."""
        servable = max(0, len(token_ids) - 1)
        digests = [d.hex() for d in block_digests(token_ids[:servable], block_size, cache_salt)]
        return RouteRequest(tuple(token_ids), tuple(digests))


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def rank(self, req: RouteRequest, candidates: Sequence[str], now: float) -> list[str]:
        i = self._next % len(candidates)
        self._next += 1
        return [*candidates[i:], *candidates[:i]]

    def routed(self, req: RouteRequest, replica: str, now: float) -> None:
        pass


class PowerOfTwo:
    """Two random candidates, the less loaded first; `load(replica)` is what the caller knows."""

    name = "pow2"

    def __init__(self, load, seed: int | None = None) -> None:
        self.load = load
        self.rng = random.Random(seed)

    def rank(self, req: RouteRequest, candidates: Sequence[str], now: float) -> list[str]:
        if len(candidates) <= 2:
            pair = list(candidates)
            self.rng.shuffle(pair)
        else:
            pair = self.rng.sample(list(candidates), 2)
        return sorted(pair, key=self.load)  # stable: a tie keeps the random order

    def routed(self, req: RouteRequest, replica: str, now: float) -> None:
        pass


class PrefixHistory:
    """What a router guesses from its own routing history (no events): a token-level prefix tree of
    the prompts it routed, each node naming the replicas it sent them to. While the loads are within
    `imbalance` requests of each other, the replica with the longest routed prefix wins (at least
    `min_match` of the prompt); otherwise, or below it, power-of-two. It never hears of evictions."""

    name = "prefix_history"

    def __init__(self, load, imbalance: int = 4, min_match: float = 0.1, seed: int | None = None) -> None:
        self.load = load
        self.imbalance = imbalance
        self.min_match = min_match
        self.fallback = PowerOfTwo(load, seed)
        self._root: dict = {}

    def rank(self, req: RouteRequest, candidates: Sequence[str], now: float) -> list[str]:
        loads = [self.load(c) for c in candidates]
        if max(loads) - min(loads) <= self.imbalance:
            best, depth, node = set(), 0, self._root
            for tok in req.token_ids:
                node = node.get(tok)
                if node is None or not (node["@"] & set(candidates)):
                    break
                best, depth = node["@"] & set(candidates), depth + 1
                node = node["children"]
            if best and depth >= self.min_match * len(req.token_ids):
                chosen = min(best, key=lambda c: (self.load(c), c))
                return [chosen, *(c for c in candidates if c != chosen)]
        return self.fallback.rank(req, candidates, now)

    def routed(self, req: RouteRequest, replica: str, now: float) -> None:
        children = self._root
        for tok in req.token_ids:
            node = children.setdefault(tok, {"@": set(), "children": {}})
            node["@"].add(replica)
            children = node["children"]


@dataclass(slots=True)
class KVAware:
    """Cost of a replica, in blocks of prefill: the prompt's blocks it must compute (one in its CPU
    tier costs `cpu_cost` of one, in the shared tier `remote_cost`), plus the blocks queued ahead
    of it there (`backlog_weight` each: prompts received and not yet computed; less than one, as
    a block computed here also takes the fleet's capacity) and `load_weight`
    per unfinished request (each running decode slows every step). The cheapest first. Candidates
    the index cannot vouch for (unsynced, stale, never heard of) are priced as holding nothing; when
    none can be vouched for, power-of-two, counted in `fallbacks` and logged once per episode."""

    index: KVIndex
    load_weight: float = 1.0
    backlog_weight: float = 0.25
    cpu_cost: float = 0.25
    remote_cost: float = 0.4
    seed: int | None = None
    name: str = "kv"
    fallbacks: int = 0
    _falling_back: bool = False
    _pow2: PowerOfTwo = field(init=False)

    def __post_init__(self) -> None:
        self._pow2 = PowerOfTwo(lambda r: self.index.load(r).requests, self.seed)

    def compute_blocks(self, req: RouteRequest, replica: str, now: float) -> tuple[float, int]:
        """The prompt's blocks `replica` would compute (priced by where the rest are held), and how
        many of the held ones are only pending there (being computed by requests queued ahead)."""
        blocks = len(req.digests) + 1  # the partial last block always runs
        if not self.index.trusted(replica, now):
            return blocks, 0
        m = self.index.match(req.digests, replica, now)
        return blocks - m.blocks + self.cpu_cost * m.cpu + self.remote_cost * m.remote, m.pending

    def cost(self, req: RouteRequest, replica: str, now: float) -> float:
        load = self.index.load(replica)
        compute, pending = self.compute_blocks(req, replica, now)
        waits = max(0.0, load.backlog - pending)  # the queue ahead, but the prefix it computes for us too
        return compute + self.backlog_weight * waits + self.load_weight * load.requests

    def rank(self, req: RouteRequest, candidates: Sequence[str], now: float) -> list[str]:
        if not any(self.index.trusted(c, now) for c in candidates):
            self.fallbacks += 1
            if not self._falling_back:
                log.warning("kv router: no replica's KV events can be trusted (none heard, or all unsynced or "
                            "stale); routing by power-of-two choices until they are")  # fmt: skip
            self._falling_back = True
            return self._pow2.rank(req, candidates, now)
        if self._falling_back:
            log.warning("kv router: replicas' KV events are back; routing by cached blocks again")
        self._falling_back = False
        order = {c: i for i, c in enumerate(candidates)}
        # ties (a prefix nobody holds): the less loaded, then the one holding fewest blocks, so new
        # prefixes spread over the fleet's caches instead of piling into the first replica's
        return sorted(candidates, key=lambda c: (self.cost(req, c, now), self.index.load(c).requests,
                                                 self.index.num_blocks(c), order[c]))  # fmt: skip

    def routed(self, req: RouteRequest, replica: str, now: float) -> None:
        self.index.routed(replica, req.digests, now, self.compute_blocks(req, replica, now)[0])
