"""The CPU tier of the prefix cache, with exact block ids: a registered block that the pool hands out
again is first copied to the tier; a later hit on it takes a fresh block and a copy back."""

from kvpage.core import KVCacheManager
from tests.core.test_kv_cache_manager import BS, Seqs, finish, toks


def copies(mgr) -> tuple[list, list]:
    """The step's (pool, tier) offloads and (tier, pool) restores."""
    t = mgr.take_tier_transfers()
    return t.offload, t.restore


def tiered(num_blocks=4, num_tier_blocks=2):
    return Seqs(KVCacheManager(num_blocks, BS, watermark=0.0, num_tier_blocks=num_tier_blocks))


def test_evicted_blocks_go_to_the_tier_and_come_back_on_a_hit():
    s = tiered()
    mgr = s.mgr
    prompt = toks(2 * BS + 1)  # two full blocks and one token
    s.add("a", prompt)
    assert mgr.block_table("a") == [0, 1, 2]
    assert copies(mgr) == ([], [])
    s.free("a")  # free, still registered: queue 3, 2, 1, 0
    s.add("b", toks(4 * BS - 1, 1000))  # takes all four blocks: 1 and 0 are evicted, so offloaded
    assert mgr.block_table("b") == [3, 2, 1, 0]
    assert copies(mgr) == ([(1, 0), (0, 1)], [])  # (pool, tier): a's block 1, then block 0
    st = mgr.stats()
    assert st.tier_cached_blocks == 2 and st.tier_total_blocks == 2 and st.cached_blocks == 0
    s.check()
    s.free("b")  # queue 0, 1, 2, 3 (b registered its 3 full blocks: they are the pool's hits now)
    prefix = mgr.find_cached_prefix(prompt)
    assert prefix.block_ids == [None, None] and prefix.tier_block_ids == {0: 1, 1: 0} and prefix.num_tokens == 2 * BS
    s.add("a2", prompt, computed=False)
    # two fresh blocks (0 and 1: b's first two, offloaded in turn) for the restores, then one to grow
    assert mgr.block_table("a2") == [0, 1, 2]
    offload, restore = copies(mgr)
    assert restore == [(1, 0), (0, 1)]  # (tier, pool)
    assert offload == []  # the tier's two blocks are being read: b's evicted blocks find no room
    s.check()  # the two tier blocks are pinned while the step runs
    assert [b.ref_count for b in mgr.tier.blocks] == [1, 1]
    s.cache("a2")
    assert [b.ref_count for b in mgr.tier.blocks] == [0, 0]
    st = mgr.stats()
    assert st.prefix_hit_tokens == 2 * BS and st.tier_hit_tokens == 2 * BS
    finish(s)


def test_the_tier_keeps_the_most_recent_copies():
    s = tiered(num_blocks=2, num_tier_blocks=2)
    mgr = s.mgr
    for i in range(4):  # four one-block prompts, each evicting the previous one's block into the tier
        s.add(f"p{i}", toks(BS + 1, 100 * i))
        s.free(f"p{i}")
    mgr.take_tier_transfers()
    assert mgr.find_cached_prefix(toks(BS + 1, 0)).num_tokens == 0  # the oldest copy was dropped
    for i in (1, 2):
        p = mgr.find_cached_prefix(toks(BS + 1, 100 * i))
        assert p.num_tokens == BS and 0 in p.tier_block_ids
    p = mgr.find_cached_prefix(toks(BS + 1, 300))
    assert p.num_tokens == BS and not p.tier_block_ids  # still in the pool
    finish(s)


def test_a_block_whose_kv_was_never_written_is_not_offloaded():
    s = tiered(num_blocks=2, num_tier_blocks=2)
    mgr = s.mgr
    s.add("a", toks(BS + 1), computed=False)
    s.cache("a", commit=False)  # registered by a step that then fails
    mgr.discard_uncommitted()
    s.free("a")
    s.add("b", toks(2 * BS - 1, 500))
    assert copies(mgr) == ([], [])
    assert mgr.stats().tier_cached_blocks == 0
    finish(s)


def test_without_a_tier_or_prefix_caching_nothing_changes():
    for mgr in (
        KVCacheManager(4, BS, watermark=0.0),
        KVCacheManager(4, BS, num_tier_blocks=2, enable_prefix_caching=False),
    ):
        s = Seqs(mgr)
        s.add("a", toks(2 * BS + 1))
        s.free("a")
        s.add("b", toks(4 * BS - 1, 1000))
        assert copies(mgr) == ([], []) and mgr.stats().tier_total_blocks == 0
        finish(s)


def test_reset_prefix_cache_forgets_the_pool_and_the_tier_but_only_when_idle():
    s = tiered()
    mgr = s.mgr
    prompt = toks(2 * BS + 1)
    s.add("a", prompt)
    assert mgr.reset_prefix_cache() is False  # "a" holds blocks: nothing changes
    assert mgr.find_cached_prefix(prompt).num_tokens == 2 * BS  # a's blocks still serve hits
    s.free("a")
    s.add("b", toks(4 * BS - 1, 1000))  # a's blocks 1 and 0 go to the tier
    s.free("b")
    mgr.take_tier_transfers()
    assert mgr.find_cached_prefix(prompt).num_tokens == 2 * BS  # from the tier
    assert mgr.find_cached_prefix(toks(4 * BS - 1, 1000)).num_tokens == 3 * BS  # from the pool
    hits = mgr.stats().prefix_hit_tokens
    assert mgr.reset_prefix_cache() is True
    st = mgr.stats()
    assert st.cached_blocks == 0 and st.tier_cached_blocks == 0 and st.free_blocks == 4
    assert st.prefix_hit_tokens == hits  # totals keep counting
    assert mgr.find_cached_prefix(prompt).num_tokens == 0
    assert mgr.find_cached_prefix(toks(4 * BS - 1, 1000)).num_tokens == 0
    s.add("c", prompt)  # and the pool works as before: the free queue is unchanged
    assert mgr.block_table("c") == [0, 1, 2]
    finish(s)


def test_a_tier_restore_never_takes_the_block_a_partial_hit_copies_from():
    """The partial hit's source is pinned before the tier hits are restored: a free, cached source
    must not be the block a restore is handed (it would copy the restored KV instead of its own)."""
    from kvpage.core.eviction import H2O

    kv = KVCacheManager(7, 2, watermark=0.0, num_tier_blocks=1)
    kv.allocate_slots("c", 3)  # blocks 0, 1
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9]
    kv.allocate_slots("a", 10, policy=H2O(heavy_tokens=0, recent_tokens=2))  # blocks 2..6
    kv.cache_blocks("a", a, 10)
    kv.commit()
    assert kv.evict("a", 10) == 4  # 2..5 released, still registered: free queue 2, 3, 4, 5
    kv.free("c")  # ... 2, 3, 4, 5, 1, 0
    kv.allocate_slots("a", 2)  # takes block 2: its (1, 2) goes to the CPU tier
    kv.take_tier_transfers()
    b = [1, 2, 3, 4, 5, 6, 7, 0]
    hit = kv.find_cached_prefix(b)  # the tier's block, 3 and 4, and a partial hit on block 5
    assert hit.tier_block_ids and hit.partial is not None and hit.partial.block_id == 5
    alloc = kv.allocate_slots("b", len(b) - hit.num_tokens, hit)
    t = kv.take_tier_transfers()
    assert [s for s, _ in alloc.copies] == [5]
    assert not {d for _, d in t.restore} & {s for s, _ in alloc.copies}
    kv.commit()
    kv.check_invariants()
