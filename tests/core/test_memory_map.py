"""The manager's memory map (core/memory_map.py) with exact block ids: what the dashboard draws."""

from kvpage.core import KVCacheManager
from kvpage.core.eviction import StreamingLLM
from kvpage.core.memory_map import CACHED, FREE
from kvpage.core.scheduler_output import SeqKey
from tests.core.test_kv_cache_manager import BS, Seqs, finish, toks


def test_shared_blocks_copy_on_write_and_cached_blocks_block_by_block():
    s = Seqs(KVCacheManager(6, BS, watermark=0.0))
    a, b = SeqKey("r1", 0), SeqKey("r1", 1)
    s.add(a, toks(20))  # blocks 0 (full, registered) and 1
    s.fork(a, b)
    m = s.mgr.memory_map()
    assert m.gpu == (2, 2, FREE, FREE, FREE, FREE) and m.cpu == () and m.tier == ()
    assert [(t.request_id, t.index, t.block_ids, t.num_tokens) for t in m.tables] == [
        ("r1", 0, (0, 1), 20), ("r1", 1, (0, 1), 20)]  # fmt: skip
    s.grow(b, [7])  # b writes into the shared partial block: its own copy, block 2
    m = s.mgr.memory_map()
    assert m.gpu == (2, 1, 1, FREE, FREE, FREE)
    assert [t.block_ids for t in m.tables] == [(0, 1), (0, 2)]  # the two rows split at their second block
    s.free(a)
    s.free(b)  # block 0 stays registered: cached
    m = s.mgr.memory_map()
    assert m.gpu == (CACHED, FREE, FREE, FREE, FREE, FREE) and m.tables == ()
    st = s.mgr.stats()
    assert (st.cached_blocks, st.used_blocks) == (1, 0)
    assert m.as_dict()["gpu"] == [CACHED, 0, 0, 0, 0, 0]
    finish(s)


def test_swapped_tables_point_into_the_cpu_pool_and_the_tier_shows_its_copies():
    s = Seqs(KVCacheManager(4, BS, watermark=0.0, num_cpu_blocks=3, num_tier_blocks=2))
    s.add("x", toks(40))
    s.mgr.swap_out(["x"])
    m = s.mgr.memory_map()
    assert m.cpu == (1, 1, 1) and m.tables[0].on_cpu and m.tables[0].block_ids == (0, 1, 2)
    assert (m.tables[0].request_id, m.tables[0].index) == ("x", 0)  # a name that is no SeqKey
    assert m.gpu == (CACHED, CACHED, FREE, FREE)  # x's two full blocks stay registered on the GPU
    s.add("y", toks(4 * BS - 1, 1000))  # takes every GPU block: the two cached ones go to the tier
    m = s.mgr.memory_map()
    assert m.gpu == (1, 1, 1, 1) and m.tier == (CACHED, CACHED)
    s.mgr.take_tier_transfers()
    s.free("y")
    s.mgr.swap_in(["x"])
    finish(s)


def test_holes_an_eviction_policy_left():
    kv = KVCacheManager(8, BS, watermark=0.0)
    kv.allocate_slots("a", 80, policy=StreamingLLM(sink_tokens=16, window_tokens=32))
    kv.evict("a", 80)
    m = kv.memory_map()
    assert m.tables[0].block_ids == (0, None, None, 3, 4)
    assert m.gpu == (1, FREE, FREE, 1, 1, FREE, FREE, FREE)
    assert m.as_dict()["tables"][0]["block_ids"] == [0, None, None, 3, 4]
    kv.free("a")
    kv.check_invariants()
