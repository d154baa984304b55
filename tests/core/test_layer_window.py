"""A KV-cache manager whose layers read a sliding window or chunks (kv_spec.py, layer_window.py):
exact block ids on a tiny pool of 16-token blocks."""

from __future__ import annotations

import pytest

from kvpage.core import KVCacheManager
from kvpage.core.eviction import StreamingLLM
from kvpage.core.invariants import InvariantError
from kvpage.core.kv_spec import ChunkedLocal, SlidingWindow
from tests.core.test_kv_cache_manager import BS, Seqs, finish, toks

W32 = SlidingWindow(32)


def window_seqs(num_blocks=8, spec=W32, **kw):
    kw.setdefault("watermark", 0.0)
    return Seqs(KVCacheManager(num_blocks, BS, layer_spec=spec, **kw))


def step(s: Seqs, seq_id, token):
    """One decode step that ran: a slot for `token`, its full blocks registered, the window applied."""
    assert s.grow(seq_id, [token]) is not None
    s.cache(seq_id)
    s.mgr.finish_step([(seq_id, len(s.tokens[seq_id]), None)])
    s.check()
    s.mgr.check_window(seq_id, len(s.tokens[seq_id]))


def test_a_window_holds_at_most_its_bound_whatever_the_length_and_released_blocks_stay_cached():
    s = window_seqs()
    mgr = s.mgr
    s.add("a", toks(40))  # blocks 0, 1, 2
    mgr.finish_step([("a", 40, None)])  # the query at 40 reads keys 9..40: nothing released
    assert mgr.block_table("a") == [0, 1, 2]
    for t in range(40, 48):
        step(s, "a", t)
    assert mgr.block_table("a") == [None, 1, 2]  # 48 computed: keys from 17 on, block 0 released
    assert mgr.pool.blocks[0].ref_count == 0 and mgr.pool.blocks[0].cache_key is not None  # a free hit
    for t in range(48, 130):
        step(s, "a", t)
        assert len(mgr._table("a").resident) <= 3  # ceil(32 / 16) + 1
    # released in order 0..5, each at the end of the free queue: token 128's block reused block 0
    assert mgr.block_table("a") == [None] * 6 + [6, 7, 0]
    assert mgr.stats().free_blocks == 5
    # a prompt of the same 130 tokens resumes after 128: it needs only blocks 6 and 7 (keys 97..127)
    prefix = mgr.find_cached_prefix(s.tokens["a"][:130])
    assert (prefix.num_tokens, prefix.released, prefix.block_ids) == (128, 6, [None] * 6 + [6, 7])
    adm = mgr.check_admission([s.tokens["a"][:130]])
    assert adm.blocks_needed == 1  # 9 blocks, 6 of them holes, 2 hits
    s.admit(["b"], [s.tokens["a"][:130]], adm)
    assert mgr.block_table("b") == [None] * 6 + [6, 7, 1]  # the oldest free block
    assert mgr._table("b").released == 6
    s.check()
    mgr.check_window("b", 128)
    finish(s)


def test_full_attention_would_find_nothing_where_the_window_resumes():
    s = window_seqs(spec=SlidingWindow(32))
    for t in range(130):
        step(s, "a", t)
    full = KVCacheManager(8, BS, watermark=0.0)
    assert full.find_cached_prefix(toks(130)).num_tokens == 0  # (an empty cache, for the shape)
    assert s.mgr.find_cached_prefix(toks(130)).num_tokens == 128
    assert s.mgr.find_cached_prefix(toks(130) + [7]).num_tokens == 128  # a block it never held: no further
    finish(s)


def test_a_prompt_admitted_whole_releases_after_its_step_and_the_next_hit_needs_only_the_window():
    s = window_seqs(num_blocks=12)
    mgr = s.mgr
    s.add("a", toks(100))  # 7 blocks: 0..6 for the whole prompt's step
    assert mgr.block_table("a") == list(range(7))
    mgr.finish_step([("a", 100, None)])  # keys from 69 on: blocks 0..3 released
    assert mgr.block_table("a") == [None] * 4 + [4, 5, 6]
    s.check()
    mgr.check_window("a", 100)
    finish(s)


def test_chunked_layers_release_each_finished_chunk():
    s = window_seqs(spec=ChunkedLocal(32))
    mgr = s.mgr
    for t in range(63):
        step(s, "a", t)
    assert mgr.block_table("a") == [None, None, 2, 3]  # 63 computed: chunk 32..63, blocks 0, 1 released
    step(s, "a", 63)  # 64 computed: the next query starts a chunk, no block is read any more
    assert mgr.block_table("a") == [None] * 4 and mgr.stats().free_blocks == 8
    step(s, "a", 64)
    assert mgr.block_table("a") == [None] * 4 + [4]
    finish(s)


def test_samples_share_the_holes_and_each_releases_its_own():
    s = window_seqs(num_blocks=10)
    mgr = s.mgr
    for t in range(50):
        step(s, "a", t)
    assert mgr.block_table("a") == [None, 1, 2, 3]
    s.fork("a", "b")
    assert mgr.block_table("b") == [None, 1, 2, 3] and mgr._table("b").released == 1
    step(s, "a", 50)  # a writes into the shared last block first: copy-on-write
    step(s, "b", 999)  # then b holds it alone
    assert mgr.block_table("a") == [None, 1, 2, 4] and mgr.block_table("b") == [None, 1, 2, 3]
    for t in range(51, 65):
        step(s, "a", t)
    assert mgr.block_table("a") == [None, None, 2, 4, 5]
    assert mgr.pool.blocks[1].ref_count == 1  # still b's
    finish(s)


def test_swap_moves_the_resident_blocks_only():
    mgr = KVCacheManager(8, BS, layer_spec=W32, watermark=0.0, num_cpu_blocks=4)
    s = Seqs(mgr)
    for t in range(70):
        step(s, "a", t)
    assert mgr.block_table("a") == [None, None, 2, 3, 4]
    moves = mgr.swap_out(["a"])
    assert len(moves) == 3 and mgr.block_table("a") == [None, None, 0, 1, 2] and mgr.is_swapped("a")
    back = mgr.swap_in(["a"])
    assert len(back) == 3 and mgr._table("a").released == 2
    step(s, "a", 70)
    finish(s)


def test_an_eviction_policy_is_refused_on_a_window_and_the_check_sees_a_table_over_its_bound():
    s = window_seqs()
    with pytest.raises(ValueError, match="kv_eviction='streaming.*sliding window of 32"):
        s.mgr.allocate_slots("x", 20, policy=StreamingLLM(16, 32))
    for t in range(60):
        assert s.grow("a", [t]) is not None  # slots, but no step ran: nothing released
    s.cache("a")
    with pytest.raises(InvariantError, match="no longer reads"):
        s.mgr.check_window("a", 60)
    s.mgr.finish_step([("a", 60, None)])
    s.mgr.check_window("a", 60)
    finish(s)
