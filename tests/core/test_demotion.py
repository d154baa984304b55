"""Blocks demoted instead of dropped (core/eviction: Demote), with exact block ids: where each block
goes by its attention mass, the pools per precision, the tagged holes, the moves queued for the
worker (in an order that is safe to run one after another), forks, swap, and the scheduler's steps."""

from __future__ import annotations

import pytest

from kvpage.core import KVCacheManager, Request, Scheduler
from kvpage.core.block_table import HOLE
from kvpage.core.eviction import H2O, Demote, parse_eviction
from kvpage.core.step_update import RequestUpdate, SeqUpdate

BS = 16


def test_the_policy_places_blocks_down_its_ladder_by_score_and_never_up():
    p = Demote(hot_tokens=16, int8_tokens=16, int4_tokens=32, recent_tokens=32)
    assert p.quotas(BS) == (1, 1, 2, 0) and p.budget_tokens(BS) == 48 and p.chunk_tokens(BS) == 32
    scores = [5.0, 0.1, 3.0, 0.2, 9.0, 1.0, 9.0, 9.0]
    # 128 tokens: blocks 0..5 are outside the recent window (tokens 96..127); by score 0 stays hot,
    # 2 goes to int8, 5 and 3 to int4, 1 and 4... 4 is the heaviest: it stays hot, 0 goes to int8
    moves = p.place([0, 1, 2, 3, 4, 5, 6, 7], {}, 128, BS, scores)
    assert moves == {0: 1, 2: 2, 5: 2, 3: None, 1: None}
    # a block already in int4 never comes back up, whatever its score: it keeps its int4 room
    moves = p.place([0, 2, 4, 5], {0: 1, 2: 2, 5: 2}, 128, BS, [0.0, 0, 99.0, 0, 9.0, 1.0])
    assert moves == {}
    moves = p.place([0, 2, 4, 5], {0: 1, 2: 2, 5: 2}, 128, BS, [50.0, 0, 99.0, 0, 9.0, 1.0])
    assert moves == {}  # 0 (int8) outranks 4 (hot), but cannot go up: each keeps its place
    # no room below at all: H2O's answer, the lowest-scored older block dropped first on ties
    assert Demote(16, 0, 0, 32).place([0, 1, 2], {}, 80, BS, [1.0, 1.0, 1.0]) == {0: None, 1: None}
    assert H2O(16, 32).evict([0, 1, 2], 80, BS, [1.0, 1.0, 1.0]) == [0, 1]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("demote", Demote()),
        ("demote:hot_tokens=32,int8_tokens=64,int4_tokens=0,recent_tokens=16", Demote(32, 64, 0, 16)),
        ({"policy": "demote", "int4_tokens": 128}, Demote(int4_tokens=128)),
    ],
)
def test_demote_parses_like_the_other_policies(spec, expected):
    assert parse_eviction(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("demote:int8_tokens=-1", "kv_eviction.int8_tokens must be an integer >= 0"),
        ("demote:recent_tokens=0", "kv_eviction.recent_tokens must be an integer >= 1"),
        ("demote:heavy_tokens=16", "unknown field"),
    ],
)
def test_bad_demote_specs_name_the_field(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_eviction(spec)


def _manager(num_blocks=16, int8=4, int4=4) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, watermark=0.0, cold_blocks={"int8": int8, "int4": int4})


def test_a_demoted_block_leaves_a_tagged_hole_and_its_move_is_queued():
    kv = _manager()
    policy = Demote(hot_tokens=16, int8_tokens=16, int4_tokens=16, recent_tokens=16)
    kv.allocate_slots("a", 80, policy=policy)
    assert kv.block_table("a") == [0, 1, 2, 3, 4]
    # 80 tokens: blocks 0..3 are old; mass per resident entry: 2 is the heaviest, then 0, 3, 1
    assert kv.evict("a", 80, [2.0, 0.1, 9.0, 0.5, 1.0]) == 1  # block 1 dropped
    assert kv.block_table("a") == [HOLE, HOLE, 2, HOLE, 4] and kv.num_evicted("a") == 48
    table = kv._table("a")
    assert table.demoted == {0: ("int8", 0), 3: ("int4", 0)}
    assert kv.take_demotions() == [("hot", 0, "int8", 0), ("hot", 3, "int4", 0)]
    assert kv.take_demotions() == []
    step = kv.prepare_step("a", list(range(80)), 80, 80)
    assert step.block_table == [2, 4] and step.num_evicted == 48
    assert step.cold_blocks == [("int8", 0), ("int4", 0)]  # after the resident ones, in logical order
    assert [kv.pool.blocks[b].ref_count for b in range(5)] == [0, 0, 1, 0, 1]
    kv.check_invariants()
    # the next step: mass per entry read (resident 2, 4, then demoted 0, 3); block 4 is old now
    kv.allocate_slots("a", 16)
    assert kv.evict("a", 96, [0.0, 0.0, 0.0, 0.0]) == 1
    # by score: 2 (9.0) stays hot, 0 (2.0) stays int8, 4 (1.0) takes the int4 room and 3 (0.5) is
    # dropped; the drop runs first, then 4 gets the int4 pool's longest-free block
    assert kv.block_table("a") == [HOLE, HOLE, 2, HOLE, HOLE, 5]
    assert kv._table("a").demoted == {0: ("int8", 0), 4: ("int4", 1)}
    assert kv.take_demotions() == [("hot", 4, "int4", 1)]
    kv.check_invariants()
    kv.free("a")
    kv.check_invariants()
    assert kv.stats().used_blocks == 0
    assert all(pool.num_free == pool.num_total for pool in kv.eviction.cold.values())


def test_the_cpu_tier_rung_is_the_last_before_dropping():
    kv = KVCacheManager(16, BS, watermark=0.0, cold_blocks={"int4": 1, "cpu": 2})
    policy = Demote(hot_tokens=0, int8_tokens=0, int4_tokens=16, recent_tokens=16, cpu_tokens=32)
    assert policy.ladder == ("int8", "int4", "cpu") and "cpu_tokens=32" in policy.describe()
    kv.allocate_slots("a", 80, policy=policy)
    assert kv.evict("a", 80, [4.0, 3.0, 2.0, 1.0, 0.0]) == 1  # 4 old blocks: int4, cpu, cpu, dropped
    assert kv._table("a").demoted == {0: ("int4", 0), 1: ("cpu", 0), 2: ("cpu", 1)}
    assert kv.take_demotions() == [("hot", 0, "int4", 0), ("hot", 1, "cpu", 0), ("hot", 2, "cpu", 1)]
    kv.check_invariants()
    kv.free("a")
    kv.check_invariants()
    assert parse_eviction("demote:cpu_tokens=64") == Demote(cpu_tokens=64)


def test_moves_run_lowest_first_so_a_freed_block_is_read_before_it_is_reused():
    kv = _manager(int8=1, int4=2)
    policy = Demote(hot_tokens=0, int8_tokens=16, int4_tokens=32, recent_tokens=16)
    kv.allocate_slots("a", 48, policy=policy)
    kv.evict("a", 48, [1.0, 2.0, 0.0])  # blocks 0, 1 are old: 1 to int8, 0 to int4
    assert kv.take_demotions() == [("hot", 0, "int4", 0), ("hot", 1, "int8", 0)]
    kv.allocate_slots("a", 16)
    # block 2 is old now and the heaviest: it takes int8 block 0, whose block 1 goes to int4 first
    kv.evict("a", 64, [9.0, 0.0, 0.0, 0.0])  # entries: resident 2, 3, then demoted 0, 1
    assert kv.take_demotions() == [("int8", 0, "int4", 1), ("hot", 2, "int8", 0)]
    assert kv._table("a").demoted == {0: ("int4", 0), 1: ("int4", 1), 2: ("int8", 0)}
    kv.check_invariants()


def test_a_full_pool_sends_a_block_one_rung_lower_and_past_the_last_it_is_dropped():
    kv = _manager(int8=1, int4=1)
    policy = Demote(hot_tokens=0, int8_tokens=64, int4_tokens=64, recent_tokens=16)
    kv.allocate_slots("a", 64, policy=policy)
    # 3 old blocks all want int8 (quota 4), but its pool holds one: the next goes to int4, the last goes
    assert kv.evict("a", 64, [3.0, 2.0, 1.0, 0.0]) == 1
    assert kv._table("a").demoted == {0: ("int8", 0), 1: ("int4", 0)} and kv.block_table("a")[2] is HOLE
    assert kv.eviction.num_demoted == {"int8": 1, "int4": 1}
    kv.check_invariants()


def test_forks_share_demoted_blocks_by_reference_and_each_releases_its_own():
    kv = _manager()
    policy = Demote(hot_tokens=0, int8_tokens=32, int4_tokens=0, recent_tokens=16)
    kv.allocate_slots("a", 48, policy=policy)
    kv.evict("a", 48, [1.0, 2.0, 0.0])
    kv.fork("a", "b")  # a sample (or beam) after the demotion shares the int8 blocks
    int8 = kv.eviction.cold["int8"]
    assert kv._table("b").demoted == {0: ("int8", 0), 1: ("int8", 1)}
    assert [int8.blocks[b].ref_count for b in (0, 1)] == [2, 2]
    kv.check_invariants()
    kv.free("a")
    assert [int8.blocks[b].ref_count for b in (0, 1)] == [1, 1]
    kv.check_invariants()
    kv.free("b")
    assert int8.num_free == int8.num_total
    kv.check_invariants()


def test_swap_moves_the_resident_blocks_and_leaves_demoted_ones_in_their_pool():
    kv = KVCacheManager(16, BS, watermark=0.0, num_cpu_blocks=8, cold_blocks={"int8": 4})
    policy = Demote(hot_tokens=0, int8_tokens=32, int4_tokens=0, recent_tokens=16)
    kv.allocate_slots("a", 48, policy=policy)
    kv.evict("a", 48, [1.0, 2.0, 0.0])
    assert kv.swap_out(["a"]) == [(2, 0)]
    assert kv._table("a").demoted == {0: ("int8", 0), 1: ("int8", 1)}
    kv.check_invariants()
    assert kv.swap_in(["a"]) == [(0, 3)] and kv.block_table("a") == [HOLE, HOLE, 3]
    kv.check_invariants()
    kv.free("a")
    assert kv.eviction.cold["int8"].num_free == 4
    kv.check_invariants()


def test_a_scheduled_demoting_request_hands_its_moves_to_the_next_step_and_ends_with_pools_free():
    kv = _manager(num_blocks=12, int8=4, int4=8)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
    policy = Demote(hot_tokens=16, int8_tokens=32, int4_tokens=64, recent_tokens=32)
    sched.add_request(Request("r", list(range(100)), 0, eviction=policy))
    moves, cold_seen, peaks = [], [], []
    for _ in range(200):
        out = sched.schedule()
        moves += out.demotions
        if not out.sequences:
            break
        updates, mass = {}, {}
        for s in out.sequences:
            seq = sched.requests["r"].sequences[s.seq_id.index]
            cold_seen.append(len(s.cold_blocks))
            # the step reads the table's blocks, then the demoted ones: a mass for each, in that order
            mass[s.seq_id] = [float(i % 3) for i in range(len(s.block_table) + len(s.cold_blocks))]
            if s.return_logits:
                done = len(seq.output_token_ids) + 1 >= 40
                updates.setdefault("r", RequestUpdate("r")).sequences.append(
                    SeqUpdate(seq.index, 7, None, "length" if done else None))  # fmt: skip
        sched.update_from_output(out, updates, mass)
        sched.check_invariants()
        peaks.append(kv.pool.num_used)
    assert not sched.has_unfinished()
    assert moves and all(m[0] in ("hot", "int8") and m[2] in ("int8", "int4") for m in moves)
    # hot memory stays within the policy's own budget: window, heavy block, the block being filled
    assert 0 < max(cold_seen) <= 2 + 4 and max(peaks) <= 2 + 1 + 1 + 1  # int8 and int4 quotas
    assert kv.stats().used_blocks == 0
    assert all(pool.num_free == pool.num_total for pool in kv.eviction.cold.values())
