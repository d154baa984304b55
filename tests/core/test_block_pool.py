from kvpage.core.block_pool import BlockPool
from kvpage.core.cache_key import CacheKey, hash_block
from kvpage.core.prefix_cache import PrefixCache


def test_fresh_pool_hands_out_ids_in_order():
    pool = BlockPool(11, 16)
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    assert [b.block_id for b in pool.allocate(2)] == [3, 4]
    assert pool.num_free == 6 and pool.num_used == 5
    assert pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 10]


def test_free_goes_tail_first_to_the_end_of_the_queue():
    pool = BlockPool(11, 16)
    seq = pool.allocate(3)
    pool.free(seq)
    # the sequence's last block was freed first, so it is handed out before its head
    assert pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1, 0]
    assert [b.block_id for b in pool.allocate(9)] == [3, 4, 5, 6, 7, 8, 9, 10, 2]


def test_allocating_more_than_free_returns_none_and_changes_nothing():
    pool = BlockPool(11, 16)
    pool.allocate(8)
    before = pool.free_queue.block_ids()
    assert pool.allocate(4) is None
    assert pool.free_queue.block_ids() == before and pool.num_free == 3


def test_incref_decref_track_sharing_and_used_tokens():
    pool = BlockPool(4, 16)
    (b,) = pool.allocate(1)
    pool.add_tokens(b, 5)
    assert (pool.num_shared, pool.num_used_tokens) == (0, 5)
    pool.incref(b)
    assert (b.ref_count, pool.num_shared) == (2, 1)
    pool.decref(b)
    assert (b.ref_count, pool.num_shared, pool.num_free) == (1, 0, 3)
    pool.decref(b)
    assert (b.ref_count, pool.num_used_tokens, pool.num_free) == (0, 0, 4)


def test_remove_from_the_middle_of_the_free_queue():
    pool = BlockPool(5, 16)
    pool.free_queue.remove(pool.blocks[2])
    assert pool.free_queue.block_ids() == [0, 1, 3, 4]
    pool.free_queue.append(pool.blocks[2])
    assert pool.free_queue.block_ids() == [0, 1, 3, 4, 2]


def test_reusing_a_cached_free_block_evicts_its_hash():
    cache = PrefixCache()
    pool = BlockPool(2, 2, cache)
    (b,) = pool.allocate(1)
    pool.add_tokens(b, 2)
    key = CacheKey(hash_block(None, (7, 8)), None, (7, 8))
    assert cache.register(b, key)
    pool.free([b])
    assert pool.num_cached_free == 1 and cache.lookup(key.digest, (7, 8)) is b
    pool.allocate(2)  # block 1, then block 0: the cached one is overwritten
    assert cache.lookup(key.digest, (7, 8)) is None and b.cache_key is None and len(cache) == 0
    assert pool.num_cached_free == 0


def test_lookup_verifies_stored_tokens_not_only_the_hash():
    cache = PrefixCache()
    pool = BlockPool(1, 2, cache)
    (b,) = pool.allocate(1)
    digest = hash_block(None, (1, 2))
    cache.register(b, CacheKey(digest, None, (1, 2)))
    assert cache.lookup(digest, (1, 2)) is b
    assert cache.lookup(digest, (1, 3)) is None  # same digest presented with other tokens: no hit


def test_hash_chain_depends_on_parent_salt_and_tokens():
    h0 = hash_block(None, [1, 2, 3])
    assert h0 == hash_block(None, (1, 2, 3))
    assert h0 != hash_block(None, [1, 2, 4])
    assert h0 != hash_block(h0, [1, 2, 3])
    assert h0 != hash_block(None, [1, 2, 3], ("salt", "tenant-a"))
    assert len(h0) == 32
