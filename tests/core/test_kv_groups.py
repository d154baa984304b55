"""A KV-cache manager of several groups (kv_spec.py: a full-attention group beside a sliding-window
one, as Gemma's or Qwen2's layers): one block table per group over one pool, exact block ids on a
tiny pool of 16-token blocks."""

from __future__ import annotations

import pytest

from kvpage.core import AdmissionStatus, InvariantError, KVCacheManager
from kvpage.core.kv_spec import FULL, RecurrentState, SlidingWindow
from tests.core.test_kv_cache_manager import BS, Seqs, finish, toks
from tests.core.test_layer_window import step  # (one decode step that ran: every group's window applied)

W32 = SlidingWindow(32)


def group_seqs(num_blocks=16, specs=(FULL, W32), **kw):
    kw.setdefault("watermark", 0.0)
    return Seqs(KVCacheManager(num_blocks, BS, group_specs=specs, **kw))


def admit(s: Seqs, seq_id, prompt, computed=True):
    adm = s.mgr.check_admission([prompt])
    assert adm.status is AdmissionStatus.NOW
    s.admit([seq_id], [prompt], adm)
    if computed:  # the prompt's step ran
        s.cache(seq_id)
        s.mgr.finish_step([(seq_id, len(prompt), None)])
    return adm


def tables(s: Seqs, seq_id):
    return [s.mgr.block_table(seq_id, g) for g in range(s.mgr.num_groups)]


def test_each_group_has_its_table_over_one_pool_and_only_the_window_group_releases():
    s = group_seqs()
    mgr = s.mgr
    admit(s, "a", toks(40))  # 3 blocks a group, group after group; the query at 40 reads keys 9..40
    assert tables(s, "a") == [[0, 1, 2], [3, 4, 5]]
    for t in range(40, 48):
        step(s, "a", t)
    assert tables(s, "a") == [[0, 1, 2], [None, 4, 5]]  # 48 computed: keys from 17 on
    assert mgr.pool.blocks[3].ref_count == 0 and mgr.pool.blocks[3].cache_key is not None  # a free hit
    for t in range(48, 100):
        step(s, "a", t)
        assert len(mgr._tables["a"][1].resident) <= 3  # ceil(32 / 16) + 1, whatever the length
    # at each block boundary both groups take a block of the one pool, full attention first
    assert tables(s, "a") == [[0, 1, 2, 6, 8, 10, 12], [None] * 4 + [9, 11, 13]]
    assert list(mgr.pool.free_queue.block_ids()) == [14, 15, 3, 4, 5, 7]  # released oldest first
    st = mgr.stats()
    assert st.used_blocks == 10 and st.free_blocks == 6  # 7 + 3: full attention alone would hold 14
    assert st.group_kinds == ["full attention", "sliding window of 32 tokens"] and st.group_blocks == [7, 3]
    finish(s)


def test_a_hit_is_the_longest_prefix_every_group_can_resume_after():
    s = group_seqs(num_blocks=16)
    mgr = s.mgr
    admit(s, "a", toks(100))  # full: 0..6; window: 7..13, then 7..10 released (keys from 69 on)
    assert tables(s, "a") == [list(range(7)), [None] * 4 + [11, 12, 13]]
    s.free("a")
    prompt = toks(100)
    hits = mgr._look_up(prompt, None)
    # 96 servable tokens: all 6 full blocks; the window's group needs keys from 65 on: blocks 4 and 5
    assert [(p.num_tokens, p.released, p.block_ids) for p in hits] == [
        (96, 0, [0, 1, 2, 3, 4, 5]),
        (96, 4, [None, None, None, None, 11, 12]),
    ]
    adm = admit(s, "b", prompt, computed=False)
    assert adm.blocks_needed == 2  # one new block a group: 7 - 6 hits, 7 - 4 holes - 2 hits
    assert adm.prefix.num_tokens == 96 and [p.group for p in adm.groups] == [0, 1]
    # the freed block 13 (the window's partial last one) and 6 (full's) went to the queue's tail
    assert tables(s, "b") == [[0, 1, 2, 3, 4, 5, 14], [None] * 4 + [11, 12, 15]]
    s.cache("b")
    mgr.finish_step([("b", 100, None)])
    s.check()
    finish(s)


def test_a_window_group_missing_the_blocks_it_reads_lowers_every_groups_hit():
    s = group_seqs(num_blocks=16)
    mgr = s.mgr
    admit(s, "a", toks(100))  # the window's 7..10 released at its step: free before the rest
    s.free("a")
    assert list(mgr.pool.free_queue.block_ids()) == [14, 15, 7, 8, 9, 10, 6, 5, 4, 3, 2, 1, 0, 13, 12, 11]
    prompt = toks(60) + toks(40, start=500)  # "a"'s first 3 blocks, then other tokens
    hits = mgr._look_up(prompt, None)
    assert [(p.num_tokens, p.released, p.block_ids) for p in hits] == [(48, 0, [0, 1, 2]), (48, 1, [None, 8, 9])]
    admit(s, "x", toks(48, start=1000))  # 3 blocks a group: 14, 15, 7 and 8, 9, 10
    assert tables(s, "x") == [[14, 15, 7], [None, 9, 10]]  # (its step released its window's first)
    # the full group still holds all 3 blocks, but the window's group can resume after none of them
    assert [mgr.pool.blocks[b].cache_key is not None for b in (0, 1, 2)] == [True] * 3
    hits = mgr._look_up(prompt, None)
    assert [(p.num_tokens, p.block_ids) for p in hits] == [(0, []), (0, [])]
    finish(s)


def test_forks_share_every_group_and_swap_moves_every_group():
    s = group_seqs(num_blocks=16, num_cpu_blocks=8)
    mgr = s.mgr
    admit(s, "a", toks(40))
    assert tables(s, "a") == [[0, 1, 2], [3, 4, 5]]
    s.fork("a", "b")
    assert [mgr.pool.blocks[b].ref_count for b in range(6)] == [2] * 6
    step(s, "b", 7)  # copy-on-write of each group's shared last block
    assert tables(s, "b") == [[0, 1, 6], [3, 4, 7]]
    assert mgr.num_blocks_to_grow([("a", 1)]) == 0  # "a" alone holds 2 and 5 now
    pairs = mgr.swap_out(["a", "b"])
    assert sorted(pairs) == [(b, c) for b, c in zip([0, 1, 2, 3, 4, 5, 6, 7], range(8))]
    assert mgr.is_swapped("a") and mgr.pool.num_free == 16
    s.check()
    assert mgr.num_blocks_to_swap_in(["a", "b"]) == 8
    back = mgr.swap_in(["a", "b"])
    assert len(back) == 8 and not mgr.is_swapped("b")
    s.check()
    finish(s)


def test_siblings_share_with_the_lead_in_every_group_or_in_none():
    s = group_seqs(num_blocks=16)
    prompt = toks(40)
    adm = s.mgr.check_admission([prompt, prompt + [5, 6]])
    assert adm.shared_blocks == [0, 2] and adm.status is AdmissionStatus.NOW
    s.admit(["a", "b"], [prompt, prompt + [5, 6]], adm)
    assert tables(s, "a") == [[0, 1, 2], [3, 4, 5]] and tables(s, "b") == [[0, 1, 6], [3, 4, 7]]
    s.check()
    finish(s)


def test_invariants_see_a_table_of_one_group_holding_another_groups_block():
    s = group_seqs()
    admit(s, "a", toks(40))
    s.check()
    table = s.mgr._tables["a"][1]
    table.block_ids[1] = 1  # group 1 points at group 0's block (ref counts no longer add up)
    with pytest.raises(InvariantError):
        s.check()
    table.block_ids[1] = 4
    s.mgr._tables["a"][1].group = 0  # a table that names another group
    with pytest.raises(InvariantError):
        s.check()
    s.mgr._tables["a"][1].group = 1
    finish(s)


def test_features_of_one_group_are_refused_by_name():
    for kw in ({"num_tier_blocks": 4}, {"cold_blocks": {"int8": 2}}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            KVCacheManager(8, BS, group_specs=(FULL, W32), **kw)
    s = group_seqs()
    with pytest.raises(ValueError, match="admit"):
        s.mgr.allocate_slots("a", 4, s.mgr.find_cached_prefix(toks(40)))


def test_kv_events_name_each_blocks_group_and_its_digests_differ_by_group():
    s = group_seqs()
    admit(s, "a", toks(40))  # 2 full blocks a group registered (the third is partial)
    batches, gap = s.mgr.events.since(0)
    stored = [e for b in batches for e in b.events if e.type == "BlockStored"]
    assert not gap and [(e.group, e.token_ids) for e in stored] == [(0, toks(16)), (0, toks(16, 16)),
                                                                     (1, toks(16)), (1, toks(16, 16))]  # fmt: skip
    assert {e.block_hashes[0] for e in stored[:2]}.isdisjoint(e.block_hashes[0] for e in stored[2:])
    finish(s)


def test_the_memory_map_lists_every_groups_table():
    s = group_seqs()
    admit(s, "a", toks(100))
    m = s.mgr.memory_map()
    assert [(t.request_id, t.group, t.block_ids) for t in m.tables] == [
        ("a", 0, tuple(range(7))),
        ("a", 1, (None,) * 4 + (11, 12, 13)),  # the window released its first four (free, cached)
    ]
    assert m.as_dict()["tables"][1]["group"] == 1 and [m.gpu[b] for b in (7, 11)] == [-1, 1]
    finish(s)


STATE = RecurrentState()


def test_a_state_group_holds_the_running_state_and_keeps_each_blocks_end_as_a_hit():
    """A state-space group (kv_spec.RecurrentState: block i holds the state after block i's last token)
    holds the block of the state a step reads and the one it writes, at most 2 between steps; each full
    block's state stays in the prefix cache, and a hit of k blocks needs only block k - 1."""
    s = group_seqs(specs=(FULL, STATE))
    mgr = s.mgr
    admit(s, "a", toks(40))  # the next token reads the state after token 39: block 2's
    assert tables(s, "a") == [[0, 1, 2], [None, None, 5]]
    assert mgr.pool.blocks[3].ref_count == 0 and mgr.pool.blocks[3].cache_key is not None  # the state at 16
    for t in range(40, 49):
        step(s, "a", t)
        assert len(mgr._tables["a"][1].resident) <= 2
    # token 48 began block 3 in each group; the state group then let block 2 (the state at 48) go
    assert tables(s, "a") == [[0, 1, 2, 6], [None, None, None, 7]]
    assert mgr.stats().group_blocks == [4, 1]
    s.free("a")
    hits = mgr._look_up(toks(40) + toks(20, start=900), None)  # the first 40 tokens again: 2 full blocks
    assert [(p.num_tokens, p.released, p.block_ids) for p in hits] == [(32, 0, [0, 1]), (32, 1, [None, 4])]
    finish(s)
