"""The fleet's KV index and routing policies, on exact digests (torch-free, Ray-free)."""

from __future__ import annotations

import logging
from dataclasses import asdict

from kvpage.core.cache_key import block_digests
from kvpage.core.kv_cache_manager import KVCacheManager
from kvpage.fleet.index import KVIndex, Load, Match
from kvpage.fleet.routing import KVAware, PowerOfTwo, PrefixHistory, RoundRobin, RouteRequest
from tests.core.test_kv_cache_manager import BS, Seqs


def stored(digests, medium="gpu"):
    return {"type": "BlockStored", "block_hashes": list(digests), "parent_block_hash": None, "token_ids": [],
            "block_size": 4, "medium": medium}  # fmt: skip


def removed(digests, medium="gpu"):
    return {"type": "BlockRemoved", "block_hashes": list(digests), "medium": medium}


def test_route_request_digests_are_what_a_replica_announces():
    """The router hashes a prompt exactly as a replica's prefix cache registers and looks it up (salt
    included, the last token never): a replica's own events, fed to the index, match the request."""
    prompt = list(range(1, 3 * BS + 2))  # 3 full blocks servable, and one token more
    for salt in (None, "tenant-a"):
        s = Seqs(KVCacheManager(num_blocks=8, block_size=BS, watermark=0.0))
        s.add("a", prompt, salt)  # the step ran: its full blocks are announced
        ix = KVIndex()
        for batch in s.mgr.events.since(0)[0]:
            assert ix.apply("r", batch.seq, [asdict(e) for e in batch.events], now=0.0)
        req = RouteRequest.of(prompt, BS, salt)
        assert req.digests == tuple(d.hex() for d in block_digests(prompt[: 3 * BS], BS, salt))
        assert ix.match(req.digests, "r", 0.0) == Match(gpu=3)
        assert ix.match(RouteRequest.of(prompt, BS, "other").digests, "r", 0.0) == Match()
        assert s.mgr.find_cached_prefix(prompt, salt).block_hashes == [bytes.fromhex(d) for d in req.digests]
    assert RouteRequest.of(prompt[:BS], BS).digests == ()  # a 4-token prompt's only block holds its last token


def test_events_build_the_map_and_a_match_counts_leading_blocks_by_medium():
    ix = KVIndex()
    assert ix.apply("a", 1, [stored(["d0", "d1"]), stored(["d2"], "cpu")], now=0.0)
    assert ix.apply("b", 1, [stored(["d0"])], now=0.0)
    assert ix.match(["d0", "d1", "d2", "d3"], "a", 0.0) == Match(gpu=2, cpu=1)
    assert ix.match(["d0", "d1", "d2", "d3"], "b", 0.0) == Match(gpu=1)
    assert ix.match(["d1", "d0"], "b", 0.0) == Match()  # consecutive from the first block only
    assert ix.apply("a", 2, [removed(["d1"]), stored(["d1"], "cpu")], now=0.1)
    assert ix.match(["d0", "d1", "d2"], "a", 0.1) == Match(gpu=1, cpu=2)
    assert ix.match(["d2", "d0"], "a", 0.1) == Match(cpu=1)  # a GPU block after a CPU one is not counted
    assert ix.apply("a", 3, [{"type": "AllBlocksCleared"}], now=0.2)
    assert ix.match(["d0"], "a", 0.2) == Match() and ix.num_blocks("a") == 0
    ix.check_invariants()


def test_a_lost_batch_unsyncs_the_replica_until_a_snapshot_replaces_its_view():
    ix = KVIndex()
    assert ix.apply("a", 1, [stored(["d0"])], now=0.0)
    assert not ix.apply("a", 3, [stored(["d1"])], now=0.1)  # batch 2 was lost
    assert ix.num_gaps == 1 and not ix.trusted("a", 0.1) and ix.num_blocks("a") == 0
    assert not ix.apply("a", 4, [stored(["d2"])], now=0.2)  # still unsynced: later batches are not applied
    assert ix.num_gaps == 1
    ix.resync("a", 4, [stored(["d0", "d1"]), stored(["d2"], "cpu")], now=0.3)
    assert ix.trusted("a", 0.3) and ix.match(["d0", "d1", "d2"], "a", 0.3) == Match(gpu=2, cpu=1)
    assert ix.apply("a", 5, [removed(["d0"])], now=0.4)
    assert ix.match(["d0", "d1"], "a", 0.4) == Match()
    # a heartbeat ahead of what was applied is a gap too (the batches in between never arrived)
    assert not ix.heartbeat("a", 7, now=0.5) and ix.num_gaps == 2
    ix.check_invariants()


def test_stale_and_dead_replicas_are_not_trusted_and_a_dead_one_is_forgotten():
    ix = KVIndex(stale_after=2.0)
    ix.apply("a", 1, [stored(["d0"])], now=0.0)
    ix.apply("b", 1, [stored(["d0"])], now=0.0)
    assert ix.trusted("a", 1.9) and not ix.trusted("a", 2.1)
    assert ix.heartbeat("a", 1, now=2.5) and ix.trusted("a", 2.6)
    ix.drop("b")
    assert "b" not in ix.replicas and not ix.trusted("b", 2.6)
    assert ix.num_digests == 1
    ix.drop("a")
    assert ix.num_digests == 0
    ix.check_invariants()


def test_pending_entries_make_a_burst_on_a_new_prefix_land_together_and_lapse():
    ix = KVIndex(pending_ttl=1.0)
    for r in ("a", "b"):
        ix.apply(r, 1, [], now=0.0)
    router = KVAware(ix, load_weight=1.0)
    req = RouteRequest(tuple(range(40)), tuple(f"p{i}" for i in range(10)))
    first = router.rank(req, ["a", "b"], 0.0)[0]
    router.routed(req, first, 0.0)
    for _ in range(3):  # the same prefix again, before any event: the pending entry wins over load
        nxt = router.rank(req, ["a", "b"], 0.1)[0]
        assert nxt == first
        router.routed(req, nxt, 0.1)
    load = ix.load(first)
    # routed, not yet reported received: the first computes all 11 blocks, the others their partial last one
    assert load.requests == 4 and load.backlog == 11 + 3
    ix.apply(first, 2, [], now=0.2, load=Load(requests=4, backlog=14, received=4))
    assert ix.load(first) == Load(4, 14, 4)  # now as reported, nothing counted twice
    assert ix.match(req.digests, first, 1.05) == Match(gpu=10, pending=10)
    assert ix.match(req.digests, first, 1.2) == Match()  # lapsed: the events never confirmed it
    ix.expire(1.2)
    assert not ix._pending


def test_kv_aware_prices_blocks_to_compute_against_load():
    ix = KVIndex()
    digests = [f"d{i}" for i in range(8)]
    ix.apply("hot", 1, [stored(digests)], now=0.0, load=Load(requests=1))
    ix.apply("cold", 1, [], now=0.0)
    ix.apply("tier", 1, [stored(digests, "cpu")], now=0.0)
    router = KVAware(ix, load_weight=1.0, backlog_weight=0.5, cpu_cost=0.25)
    req = RouteRequest(tuple(range(33)), tuple(digests))
    assert router.cost(req, "hot", 0.0) == 1 + 1.0 * 1  # the last, partial block always runs
    assert router.cost(req, "cold", 0.0) == 9
    assert router.cost(req, "tier", 0.0) == 1 + 8 * 0.25
    assert router.rank(req, ["cold", "hot", "tier"], 0.0) == ["hot", "tier", "cold"]
    ix.apply("hot", 2, [], now=0.0, load=Load(requests=2, backlog=8))  # its queue: worth more than its prefix
    assert router.cost(req, "hot", 0.0) == 1 + 0.5 * 8 + 1.0 * 2
    assert router.rank(req, ["cold", "hot", "tier"], 0.0) == ["tier", "hot", "cold"]
    ix.apply("hot", 3, [], now=0.0, load=Load(requests=9))
    assert router.rank(req, ["cold", "hot", "tier"], 0.0) == ["tier", "cold", "hot"]
    # an unsynced replica is priced as holding nothing: the others' affinity is untouched
    ix.apply("tier", 3, [], now=0.0)
    assert not ix.trusted("tier", 0.0)
    assert router.rank(req, ["cold", "hot", "tier"], 0.0) == ["cold", "tier", "hot"]


def test_blocks_in_the_shared_tier_are_priced_at_fetch_cost_for_every_replica():
    ix = KVIndex(max_remote=6)
    digests = [f"d{i}" for i in range(8)]
    ix.apply("a", 1, [stored(digests[:2]), stored(digests[:6], "remote")], now=0.0, load=Load(requests=3))
    ix.apply("b", 1, [], now=0.0)  # it never saw the prompt: the shared tier serves it the same blocks
    assert ix.match(digests, "a", 0.0) == Match(gpu=2, remote=4) and ix.match(digests, "b", 0.0) == Match(remote=6)
    router = KVAware(ix, load_weight=1.0, remote_cost=0.4)
    req = RouteRequest(tuple(range(33)), tuple(digests))
    assert router.cost(req, "a", 0.0) == 1 + 2 + 4 * 0.4 + 3  # the last partial block, d6 d7, d2-d5 fetched
    assert router.cost(req, "b", 0.0) == 1 + 2 + 6 * 0.4
    assert router.rank(req, ["a", "b"], 0.0) == ["b", "a"]  # the busy holder no longer wins by default
    ix.apply("a", 2, [stored(["e0", "e1"], "remote")], now=0.1)  # the index keeps the 6 newest only
    assert ix.num_remote == 6 and ix.match(digests, "b", 0.1) == Match()
    ix.check_invariants()


def test_kv_aware_falls_back_to_power_of_two_and_says_so(caplog):
    ix = KVIndex(stale_after=1.0)
    ix.apply("a", 1, [stored(["d0"])], now=0.0)
    ix.apply("b", 1, [], now=0.0)
    router = KVAware(ix, seed=0)
    req = RouteRequest(tuple(range(8)), ("d0",))
    with caplog.at_level(logging.WARNING, logger="kvpage.fleet"):
        assert router.rank(req, ["a", "b"], 0.5)[0] == "a" and router.fallbacks == 0
        for _ in range(3):  # nobody heard for 5 s: the events are off or lost
            assert set(router.rank(req, ["a", "b"], 5.0)) == {"a", "b"}
        assert router.fallbacks == 3
        ix.heartbeat("a", 1, now=5.0)
        assert router.rank(req, ["a", "b"], 5.1)[0] == "a"
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("power-of-two" in m for m in msgs) == 1 and sum("back" in m for m in msgs) == 1


def test_baselines_round_robin_pow2_and_prefix_history():
    rr = RoundRobin()
    req = RouteRequest((1, 2, 3), ())
    assert [rr.rank(req, ["a", "b", "c"], 0)[0] for _ in range(4)] == ["a", "b", "c", "a"]
    loads = {"a": 3, "b": 0, "c": 1}
    p2 = PowerOfTwo(loads.get, seed=1)
    for _ in range(20):
        pair = p2.rank(req, ["a", "b", "c"], 0)
        assert len(pair) == 2 and loads[pair[0]] <= loads[pair[1]]
    hist = PrefixHistory(lambda r: 0, seed=0)
    long = RouteRequest(tuple(range(100)), ())
    hist.routed(long, "c", 0)
    assert hist.rank(RouteRequest(tuple(range(50)) + (7,) * 10, ()), ["a", "b", "c"], 0)[0] == "c"
    busy = PrefixHistory({"a": 0, "b": 0, "c": 9}.get, imbalance=4, seed=0)
    busy.routed(long, "c", 0)
    for _ in range(10):  # loads too far apart: power-of-two, which never puts the busy one first
        assert busy.rank(long, ["a", "b", "c"], 0)[0] != "c"


def test_a_replica_known_only_from_routing_is_not_trusted():
    ix = KVIndex()
    router = KVAware(ix, seed=0)
    req = RouteRequest(tuple(range(8)), ("d0",))
    router.routed(req, "a", 0.0)  # routed there, never heard from
    assert not ix.trusted("a", 0.0) and ix.load("a").requests == 1
    ix.apply("a", 1, [stored(["d0"])], now=0.1)
    assert ix.trusted("a", 0.1)
