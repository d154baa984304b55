"""Eviction policies (StreamingLLM, H2O) in the core, with exact block ids: which blocks a policy
releases, the holes it leaves, the rotated sink copies, sharers, swap, and the scheduler's bounds."""

from __future__ import annotations

import pytest

from kvpage.core import KVCacheManager, Request, Scheduler
from kvpage.core.block_table import HOLE
from kvpage.core.eviction import H2O, StreamingLLM, parse_eviction
from kvpage.core.step_update import RequestUpdate, SeqUpdate

BS = 16


def test_streaming_releases_what_left_the_window_but_never_the_sinks():
    p = StreamingLLM(sink_tokens=4, window_tokens=32)
    assert p.sink_blocks(BS) == 1 and p.budget_tokens(BS) == 48 and p.chunk_tokens(BS) == 32
    # 100 tokens: the window is tokens 68..99, so blocks 1-3 (tokens 16..63) are wholly older
    assert p.evict([0, 1, 2, 3, 4, 5], 100, BS, []) == [1, 2, 3]
    assert p.evict([0, 1, 2], 48, BS, []) == []  # exactly sinks + window: nothing to drop
    assert StreamingLLM(sink_tokens=0, window_tokens=16).evict([0, 1, 2], 48, BS, []) == [0, 1]


def test_h2o_keeps_the_heaviest_old_blocks_and_the_recent_ones():
    p = H2O(heavy_tokens=32, recent_tokens=32)
    scores = [5.0, 0.1, 3.0, 0.2, 9.0, 9.0]
    # 100 tokens: blocks 0..3 are outside the recent window; keep the 2 heaviest of them (0 and 2)
    assert p.evict([0, 1, 2, 3, 4, 5], 100, BS, scores) == [1, 3]
    assert p.evict([0, 2, 4, 5], 100, BS, scores) == []
    assert H2O(heavy_tokens=0, recent_tokens=16).evict([0, 1], 40, BS, [1.0, 1.0]) == [0]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, None),
        ("none", None),
        ("streaming", StreamingLLM()),
        ("streaming:sink_tokens=8,window_tokens=256", StreamingLLM(8, 256)),
        ({"policy": "h2o", "heavy_tokens": 64, "recent_tokens": 64}, H2O(64, 64)),
        (H2O(1, 2), H2O(1, 2)),
    ],
)
def test_policies_parse_from_names_strings_and_mappings(spec, expected):
    assert parse_eviction(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("lru", "kv_eviction.policy must be"),
        ("streaming:window_tokens=0", "kv_eviction.window_tokens must be an integer >= 1"),
        ("streaming:sink_tokens=-1", "kv_eviction.sink_tokens must be"),
        ("streaming:window=5", "unknown field"),
        ("h2o:heavy_tokens=x", "expected name=integer"),
        ({"policy": "h2o", "recent_tokens": 1.5}, "kv_eviction.recent_tokens"),
        (42, "kv_eviction must be"),
    ],
)
def test_bad_policies_name_the_field(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_eviction(spec)


def _manager(num_blocks=16, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, watermark=0.0, **kw)


def test_evicting_leaves_holes_and_attention_reads_the_rest_with_rotated_sinks():
    kv = _manager()
    kv.allocate_slots("a", 80, policy=StreamingLLM(sink_tokens=16, window_tokens=32))
    assert kv.block_table("a") == [0, 1, 2, 3, 4]
    assert kv.evict("a", 80) == 2  # window = tokens 48..79: blocks 1, 2 go; block 0 is the sink
    assert kv.block_table("a") == [0, HOLE, HOLE, 3, 4] and kv.num_evicted("a") == 32
    assert kv.pool.blocks[1].ref_count == 0 and kv.pool.blocks[2].ref_count == 0
    with pytest.raises(RuntimeError, match="sink copies are stale"):
        kv.attention_table("a")
    assert kv.num_blocks_for_sinks(["a"]) == 1
    assert kv.prepare_sinks("a") == [(0, 5, 32)]  # a private copy of the sink, rotated by 32 positions
    assert kv.attention_table("a") == ([5, 3, 4], 32)
    assert kv.prepare_sinks("a") == []  # up to date
    kv.check_invariants()
    kv.allocate_slots("a", 16)  # 96 tokens: block 3 leaves the window
    assert kv.block_table("a")[-1] == 6 and kv.evict("a", 96) == 1
    assert kv.num_blocks_for_sinks(["a"]) == 0  # the copy is private: rotated again in place
    assert kv.prepare_sinks("a") == [(0, 5, 48)]  # always from the original, never copy of a copy
    assert kv.attention_table("a") == ([5, 4, 6], 48)
    assert kv.stats().evicted_tokens == 48 and kv.stats().logical_blocks == 3
    kv.check_invariants()
    kv.free("a")
    kv.check_invariants()
    assert kv.stats().used_blocks == 0


def test_only_computed_full_blocks_are_released():
    kv = _manager()
    kv.allocate_slots("a", 80, policy=StreamingLLM(sink_tokens=0, window_tokens=16))
    assert kv.evict("a", 20) == 0  # slots for 80, but 20 computed: the window ends at token 20
    assert kv.evict("a", 40) == 1 and kv.block_table("a") == [HOLE, 1, 2, 3, 4]


def test_a_block_other_sequences_share_stays_theirs():
    kv = _manager()
    policy = StreamingLLM(sink_tokens=0, window_tokens=16)
    kv.allocate_slots("a", 48, policy=policy)
    kv.fork("a", "b")  # a sample (or a beam): shares all three blocks
    assert kv.evict("a", 48) == 2
    assert kv.block_table("a") == [HOLE, HOLE, 2] and kv.block_table("b") == [0, 1, 2]
    assert [kv.pool.blocks[b].ref_count for b in (0, 1, 2)] == [1, 1, 2]
    kv.check_invariants()
    kv.fork("a", "c")  # a fork after eviction shares the holes too
    assert kv.block_table("c") == [HOLE, HOLE, 2] and kv.num_evicted("c") == 32
    for s in "abc":
        kv.free(s)
    kv.check_invariants()
    assert kv.stats().used_blocks == 0


def test_a_registered_block_stays_in_the_prefix_cache_and_nothing_is_registered_after_evicting():
    kv = _manager()
    tokens = list(range(64))
    kv.allocate_slots("a", 64, policy=StreamingLLM(sink_tokens=0, window_tokens=16))
    kv.cache_blocks("a", tokens, 40)  # blocks 0, 1 are full and registered
    kv.commit()
    assert kv.evict("a", 40) == 1  # block 0 leaves "a" but stays hittable
    kv.cache_blocks("a", tokens, 64)  # blocks 2, 3 attended to a partial context: not registered
    assert kv.find_cached_prefix(tokens + [99]).block_ids == [0, 1]
    kv.check_invariants()


def test_siblings_sharing_stale_sink_copies_take_exactly_one_new_copy():
    kv = _manager()
    kv.allocate_slots("a", 64, policy=StreamingLLM(sink_tokens=16, window_tokens=16))
    kv.evict("a", 64)  # blocks 1, 2 go
    assert kv.prepare_sinks("a") == [(0, 4, 32)]
    kv.fork("a", "b")  # shares the copy (both have evicted 32)
    assert kv.attention_table("b") == ([4, 3], 32)
    for s in "ab":
        kv.allocate_slots(s, 16)
        kv.evict(s, 80)  # block 3 goes for both: the copy is stale for both
    assert kv.num_blocks_for_sinks(["a", "b"]) == 1  # the first takes a new copy, the second rotates in place
    free = kv.pool.num_free
    rotations = kv.prepare_sinks("a") + kv.prepare_sinks("b")
    assert free - kv.pool.num_free == 1 and [r[2] for r in rotations] == [48, 48]
    assert {r[0] for r in rotations} == {0}
    kv.check_invariants()


def test_swap_moves_resident_blocks_only_and_sink_copies_are_made_again():
    kv = _manager(num_cpu_blocks=8)
    kv.allocate_slots("a", 64, policy=StreamingLLM(sink_tokens=16, window_tokens=16))
    kv.evict("a", 64)
    kv.prepare_sinks("a")
    assert kv.stats().used_blocks == 3  # sink, its copy, block 3
    pairs = kv.swap_out(["a"])
    assert len(pairs) == 2 and kv.block_table("a")[1:3] == [HOLE, HOLE]
    assert kv.stats().used_blocks == 0 and kv.num_blocks_to_swap_in(["a"]) == 2
    kv.check_invariants()
    kv.swap_in(["a"])
    assert kv.num_blocks_for_sinks(["a"]) == 1 and len(kv.prepare_sinks("a")) == 1
    kv.check_invariants()


def _run(sched: Scheduler, mass_of=None, steps: int = 10_000):
    """Drive the scheduler with a fake model that appends token 7 to every sequence that returns logits."""
    peaks = []
    for _ in range(steps):
        out = sched.schedule()
        if not out.sequences:
            break
        updates = {}
        for s in out.sequences:
            req = sched.requests[s.seq_id.request_id]
            seq = req.sequences[s.seq_id.index]
            if s.return_logits:
                done = len(seq.output_token_ids) + 1 >= 40
                updates.setdefault(req.request_id, RequestUpdate(req.request_id)).sequences.append(
                    SeqUpdate(seq.index, 7, None, "length" if done else None)
                )
            assert s.kv_len <= len(s.block_table) * BS
        mass = {s.seq_id: mass_of(s) for s in out.sequences} if mass_of else None
        sched.update_from_output(out, updates, mass)
        sched.check_invariants()
        peaks.append(sched.kv.pool.num_used)
    return peaks


def test_a_streaming_request_runs_past_max_model_len_in_bounded_memory():
    kv = _manager(num_blocks=12)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=64)
    policy = StreamingLLM(sink_tokens=4, window_tokens=32)
    sched.add_request(Request("r", list(range(500)), 0, eviction=policy))  # a prompt 8x max_model_len
    first = sched.schedule()
    (s,) = first.sequences
    assert len(s.token_ids) == 32 and kv.num_tokens(s.seq_id) == 48  # a window-long chunk; slots for the budget
    sched.update_from_output(first, {})
    peaks = _run(sched)
    # sink + its copy + the window's 2 blocks + a chunk's 2 blocks (+ a partial one), never more
    assert max(peaks) <= 1 + 1 + 2 + 2 + 1 and not sched.has_unfinished()
    assert kv.stats().used_blocks == 0 and kv.stats().evicted_tokens > 400
    kv.check_invariants()


def test_an_h2o_request_releases_the_blocks_with_the_least_attention():
    kv = _manager(num_blocks=12)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
    sched.add_request(Request("r", list(range(100)), 0, eviction=H2O(heavy_tokens=16, recent_tokens=32)))
    heavy = {}

    def mass_of(s):  # the block holding tokens 32..47 gets all the attention
        table = kv.block_table(s.seq_id)
        resident = [i for i, b in enumerate(table) if b != HOLE]
        heavy.setdefault("kept", set()).update(resident)
        return [1.0 if i == 2 else 0.0 for i in resident]

    peaks = _run(sched, mass_of, steps=3)
    assert max(peaks) <= 1 + 2 + 2 + 1
    table = kv.block_table(("r", 0)) if kv.has_sequence(("r", 0)) else None
    assert table is not None and table[2] != HOLE and table[0] == table[1] == HOLE


def test_a_request_without_a_policy_keeps_everything():
    from kvpage.core.eviction import NO_EVICTION

    for req in (Request("r", [1, 2, 3], 0), Request("s", [1, 2, 3], 0, eviction=None)):
        assert req.eviction is NO_EVICTION and not req.unbounded
        assert req.eviction.chunk_tokens(BS) is None and req.eviction.admission_cap(BS) is None
        assert req.eviction.slots_upto(5, 40) == 40  # slots for every token at once
    assert StreamingLLM(sink_tokens=16, window_tokens=32).slots_upto(5, 40) == 5  # only for what it computes now


def test_every_policy_answers_the_whole_protocol():
    """What the builder, the engine and the config ask a policy, answered by every one of them (no
    `getattr` with a default, no attribute only some have)."""
    from kvpage.core.eviction.policies import NO_EVICTION, Demote, EvictionPolicy

    asked = [n for n in vars(EvictionPolicy) if not n.startswith("_")] + list(EvictionPolicy.__annotations__)
    policies = [NO_EVICTION, StreamingLLM(4, 60), H2O(32, 48), Demote(32, 64, 0, 40, cpu_tokens=16)]
    for policy in policies:
        assert all(hasattr(policy, n) for n in asked), [n for n in asked if not hasattr(policy, n)]
    assert [p.window_blocks(16) for p in policies] == [0, 4, 3, 3]
    assert [p.quotas(16) for p in policies] == [(), (), (), (2, 4, 0, 1)]
    assert [p.demotes_to() for p in policies] == [(), (), (), ("int8", "cpu")]
    assert [p.budget_tokens(16) for p in policies] == [None, 80, 80, 80]
