"""Exact-expectation tests of the KV-cache manager on a tiny pool: 11 blocks of 16 token slots."""

import dataclasses

import pytest

from kvpage.core import AdmissionStatus, InvariantError, KVCacheManager
from tests.core.kv_memory import KVMemory

BS = 16


def toks(n, start=0):
    return list(range(start, start + n))


def new_mgr(num_blocks=11, **kw):
    kw.setdefault("watermark", 0.0)
    return KVCacheManager(num_blocks, BS, **kw)


def add(mgr, seq_id, prompt, salt=None, computed=True):
    prefix = mgr.find_cached_prefix(prompt, salt)
    alloc = mgr.allocate_slots(seq_id, prompt[prefix.num_tokens :], prefix)
    assert alloc is not None
    if computed:
        mgr.mark_computed(seq_id, len(prompt))
    return prefix, alloc


def refs(mgr, ids):
    return [mgr.pool.blocks[b].ref_count for b in ids]


def finish(mgr):
    for s in mgr.seq_ids():
        mgr.free(s)
    mgr.check_invariants()
    st = mgr.stats()
    assert st.used_blocks == 0 and st.cpu_used_blocks == 0 and st.free_blocks == st.total_blocks


# ----------------------------------------------------------------------------- block tables


def test_block_table_grows_one_block_at_a_time():
    mgr = new_mgr()
    _, alloc = add(mgr, "a", toks(20))
    assert alloc.new_block_ids == [0, 1] and alloc.copies == []
    assert mgr.block_table("a") == [0, 1]
    assert mgr.slot_mapping("a", 15, 18) == [15, 16, 17]
    # appending inside the partly filled block allocates nothing
    for i in range(12):
        alloc = mgr.allocate_slots("a", [100 + i])
        assert alloc.new_block_ids == [] and alloc.copies == []
    assert mgr.num_tokens("a") == 32 and mgr.stats().free_blocks == 9
    # crossing the boundary allocates exactly one block
    alloc = mgr.allocate_slots("a", [200])
    assert alloc.new_block_ids == [2]
    assert mgr.slot_mapping("a", 32, 33) == [2 * BS + 0]
    assert mgr.stats().free_blocks == 8
    mgr.check_invariants()
    finish(mgr)


def test_failed_allocation_changes_nothing():
    mgr = new_mgr(enable_prefix_caching=True)
    add(mgr, "a", toks(150))  # 10 blocks: 0..9
    before = (mgr.stats(), mgr.pool.free_queue.block_ids(), mgr.block_table("a"))
    assert mgr.allocate_slots("b", toks(40, 1000)) is None  # needs 3, 1 free
    assert mgr.allocate_slots("a", toks(30, 500)) is None  # 180 tokens need 12 blocks: 2 more, 1 free
    assert not mgr.has_sequence("b")
    assert (mgr.stats(), mgr.pool.free_queue.block_ids(), mgr.block_table("a")) == before
    mgr.check_invariants()
    finish(mgr)


def test_failed_allocation_with_a_prefix_hit_takes_no_reference():
    mgr = new_mgr()
    add(mgr, "a", toks(40))  # blocks 0, 1 full and registered, 2 partial
    mgr.free("a")  # queue: 3..10, 2, 1, 0 ; 0 and 1 cached
    add(mgr, "filler", toks(7 * BS, 5000))  # takes 3..9
    assert mgr.pool.free_queue.block_ids() == [10, 2, 1, 0]
    prefix = mgr.find_cached_prefix(toks(40) + toks(60, 9000))
    assert prefix.block_ids == [0, 1] and prefix.num_tokens == 32
    before = (mgr.stats(), mgr.pool.free_queue.block_ids())
    # 100 tokens -> 7 blocks, 2 hit, 5 needed; only 4 free and 2 of them are the hits themselves
    assert mgr.allocate_slots("b", toks(40) + toks(60, 9000), prefix) is None
    assert (mgr.stats(), mgr.pool.free_queue.block_ids()) == before
    assert refs(mgr, [0, 1]) == [0, 0]
    mgr.check_invariants()
    finish(mgr)


# ----------------------------------------------------------------------------- prefix caching


def test_hit_while_owner_runs_and_after_it_finished():
    mgr = new_mgr()
    system = toks(32)
    add(mgr, "a", system + toks(8, 1000))  # blocks 0, 1, 2
    prefix, alloc = add(mgr, "b", system + toks(5, 2000))
    assert prefix.block_ids == [0, 1] and prefix.num_tokens == 32
    assert mgr.block_table("b") == [0, 1, 3] and alloc.new_block_ids == [3]
    assert refs(mgr, [0, 1, 2, 3]) == [2, 2, 1, 1]
    st = mgr.stats()
    assert (st.used_blocks, st.shared_blocks, st.logical_blocks) == (4, 2, 6)
    assert (st.prefix_query_tokens, st.prefix_hit_tokens) == (40 + 37, 32)
    assert st.sharing_ratio == pytest.approx(0.5)

    mgr.free("a")
    assert refs(mgr, [0, 1, 2, 3]) == [1, 1, 0, 1]
    assert mgr.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10, 2]
    mgr.free("b")
    # b's tail (3) goes first, then its shared head, which a's release already made the oldest holders of
    assert mgr.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10, 2, 3, 1, 0]
    st = mgr.stats()
    assert (st.used_blocks, st.cached_blocks) == (0, 2)

    prefix, _ = add(mgr, "c", system + toks(3, 3000))  # hits blocks that are free but cached
    assert prefix.block_ids == [0, 1]
    assert refs(mgr, [0, 1]) == [1, 1] and mgr.block_table("c") == [0, 1, 4]
    mgr.check_invariants()
    finish(mgr)


def test_eviction_order_is_lru_with_tails_first():
    mgr = new_mgr()
    add(mgr, "a", toks(48))  # 0, 1, 2 all full and registered
    mgr.free("a")
    assert mgr.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1, 0]
    assert mgr.stats().cached_blocks == 3
    add(mgr, "x", toks(8 * BS, 5000), computed=False)  # 3..10, nothing evicted yet
    assert mgr.find_cached_prefix(toks(48) + [1]).block_ids == [0, 1, 2]
    mgr.allocate_slots("x", [1])  # evicts block 2 (a's tail) first
    assert mgr.block_table("x")[-1] == 2
    assert mgr.find_cached_prefix(toks(48) + [1]).block_ids == [0, 1]
    mgr.allocate_slots("x", toks(BS, 7000))  # then block 1
    assert mgr.find_cached_prefix(toks(48) + [1]).block_ids == [0]
    assert mgr.stats().cached_blocks == 1
    mgr.check_invariants()
    finish(mgr)


def test_hash_registered_only_after_kv_is_written():
    mgr = new_mgr()
    add(mgr, "a", toks(40), computed=False)
    assert mgr.find_cached_prefix(toks(40)).block_ids == []
    mgr.mark_computed("a", 20)  # one full block written
    assert mgr.find_cached_prefix(toks(40)).block_ids == [0]
    mgr.mark_computed("a", 40)
    assert mgr.find_cached_prefix(toks(40)).block_ids == [0, 1]
    finish(mgr)


def test_last_prompt_token_is_never_served_from_cache():
    mgr = new_mgr()
    add(mgr, "a", toks(48))
    # all three blocks are cached, but a 48-token prompt must compute its last token
    p = mgr.find_cached_prefix(toks(48))
    assert p.block_ids == [0, 1] and p.num_tokens == 32
    assert mgr.find_cached_prefix(toks(49)).block_ids == [0, 1, 2]
    assert mgr.find_cached_prefix(toks(32)).block_ids == [0]
    assert mgr.find_cached_prefix(toks(1)).block_ids == []
    assert mgr.find_cached_prefix([]).block_ids == []
    finish(mgr)


def test_identical_tokens_at_another_position_do_not_hit():
    mgr = new_mgr()
    chunk = toks(BS, 500)
    add(mgr, "a", chunk + chunk + [1])  # block 0 and block 1 hold the same tokens
    st = mgr.stats()
    assert st.used_blocks == 3  # stored twice: different positions are different KV
    # the chunk preceded by something else is a different chain: no hit
    assert mgr.find_cached_prefix(toks(BS, 900) + chunk + [1]).block_ids == []
    assert mgr.find_cached_prefix(chunk + [1]).block_ids == [0]
    finish(mgr)


def test_identical_content_computed_twice_registers_once():
    mgr = new_mgr()
    add(mgr, "a", toks(33), computed=False)  # both miss: neither is written yet
    add(mgr, "b", toks(33), computed=False)
    assert mgr.block_table("a") == [0, 1, 2] and mgr.block_table("b") == [3, 4, 5]
    mgr.mark_computed("a", 33)
    mgr.mark_computed("b", 33)
    assert len(mgr.prefix_cache) == 2
    assert mgr.find_cached_prefix(toks(33)).block_ids == [0, 1]  # a's copy, the first registered
    mgr.check_invariants()
    mgr.free("a")
    mgr.free("b")
    assert mgr.stats().cached_blocks == 2  # b's duplicates are plain free blocks
    finish(mgr)


def test_cache_salt_isolates_tenants():
    mgr = new_mgr()
    add(mgr, "a", toks(40), salt="tenant-a")
    assert mgr.find_cached_prefix(toks(40)).block_ids == []
    assert mgr.find_cached_prefix(toks(40), "tenant-b").block_ids == []
    assert mgr.find_cached_prefix(toks(40), "tenant-a").block_ids == [0, 1]
    finish(mgr)


def test_prefix_caching_off_never_hits():
    mgr = new_mgr(enable_prefix_caching=False)
    add(mgr, "a", toks(40))
    p, _ = add(mgr, "b", toks(40))
    assert p.block_ids == [] and mgr.block_table("b") == [3, 4, 5]
    assert mgr.stats().prefix_query_tokens == 0
    finish(mgr)


# ----------------------------------------------------------------------------- fork / copy-on-write


def test_fork_then_exactly_one_copy_on_a_shared_partial_block():
    mgr = new_mgr()
    mem = KVMemory(mgr)
    _, alloc = add(mgr, "a", toks(20))
    mem.apply("a", alloc, 20)
    mgr.fork("a", "b")
    assert mgr.block_table("b") == [0, 1] and refs(mgr, [0, 1]) == [2, 2]
    assert mgr.stats().shared_blocks == 2

    alloc = mgr.allocate_slots("b", [777])  # b writes into shared block 1 -> b gets a copy
    assert alloc.copies == [(1, 2)] and alloc.new_block_ids == []
    mem.apply("b", alloc, 1)
    assert mgr.block_table("b") == [0, 2] and refs(mgr, [0, 1, 2]) == [2, 1, 1]

    alloc = mgr.allocate_slots("a", [555])  # a now owns block 1 alone: written in place
    assert alloc.copies == [] and alloc.new_block_ids == []
    mem.apply("a", alloc, 1)
    mem.check()
    assert mem.read("a")[-1] == 555 and mem.read("b")[-1] == 777
    mgr.check_invariants()
    finish(mgr)


def test_fork_at_a_block_boundary_copies_nothing():
    mgr = new_mgr()
    add(mgr, "a", toks(32))
    mgr.fork("a", "b")
    alloc_a = mgr.allocate_slots("a", [1])
    alloc_b = mgr.allocate_slots("b", [2])
    assert (alloc_a.copies, alloc_a.new_block_ids) == ([], [2])
    assert (alloc_b.copies, alloc_b.new_block_ids) == ([], [3])
    assert refs(mgr, [0, 1, 2, 3]) == [2, 2, 1, 1]
    mgr.check_invariants()
    finish(mgr)


def test_copy_on_write_that_cannot_get_a_block_fails_cleanly():
    mgr = new_mgr(num_blocks=3)
    add(mgr, "a", toks(20))  # 0, 1
    mgr.fork("a", "b")
    mgr.allocate_slots("c", [1])  # block 2: pool full
    before = mgr.stats()
    assert mgr.allocate_slots("b", [9]) is None
    assert mgr.stats() == before and mgr.block_table("b") == [0, 1] and mgr.num_tokens("b") == 20
    finish(mgr)


# ----------------------------------------------------------------------------- swap


def test_swap_out_and_back_in_restores_the_same_tokens():
    mgr = new_mgr(num_cpu_blocks=4)
    mem = KVMemory(mgr)
    prompt = toks(40, 300)
    _, alloc = add(mgr, "a", prompt)
    mem.apply("a", alloc, 40)
    pairs = mgr.swap_out(["a"])
    assert pairs == [(0, 0), (1, 1), (2, 2)]
    mem.swap(pairs, to_cpu=True)
    assert mgr.is_swapped("a") and mgr.block_table("a") == [0, 1, 2]
    st = mgr.stats()
    assert (st.used_blocks, st.cpu_used_blocks, st.num_swapped_seqs, st.cached_blocks) == (0, 3, 1, 2)
    mgr.check_invariants()

    _, alloc = add(mgr, "other", toks(3 * BS, 9000))  # evicts nothing useful: 3, 4, 5
    mem.apply("other", alloc, 3 * BS)
    for slot in range(3 * BS):
        mem.gpu[slot] = -1  # GPU blocks 0..2 get overwritten while a is away
    pairs = mgr.swap_in(["a"])
    assert pairs == [(0, 6), (1, 7), (2, 8)]
    mem.swap(pairs, to_cpu=False)
    assert not mgr.is_swapped("a") and mgr.block_table("a") == [6, 7, 8]
    assert mem.read("a") == prompt
    assert mgr.stats().cpu_used_blocks == 0
    # the sequence keeps decoding after it came back
    alloc = mgr.allocate_slots("a", [41])
    mem.apply("a", alloc, 1)
    mgr.mark_computed("a", 41)
    mem.check()
    mgr.check_invariants()
    finish(mgr)


def test_swap_keeps_sharing_inside_a_group_and_fails_cleanly_when_cpu_is_full():
    mgr = new_mgr(num_cpu_blocks=3)
    add(mgr, "a", toks(40))
    mgr.fork("a", "b")
    add(mgr, "c", toks(40, 800))
    assert mgr.swap_out(["c", "a"]) is None  # 6 distinct blocks, 3 CPU blocks
    assert mgr.stats().cpu_used_blocks == 0 and not mgr.is_swapped("a")
    pairs = mgr.swap_out(["a", "b"])  # 3 distinct blocks, each held twice
    assert pairs == [(0, 0), (1, 1), (2, 2)]
    assert [b.ref_count for b in mgr.cpu_pool.blocks] == [2, 2, 2]
    with pytest.raises(RuntimeError):
        mgr.allocate_slots("a", [1])
    mgr.check_invariants()
    pairs = mgr.swap_in(["a", "b"])
    assert mgr.block_table("a") == mgr.block_table("b") == [b for _, b in pairs]
    assert refs(mgr, mgr.block_table("a")) == [2, 2, 2]
    mgr.check_invariants()
    finish(mgr)


# ----------------------------------------------------------------------------- admission and stats


def test_admission_now_later_never_with_watermark():
    mgr = KVCacheManager(11, BS, watermark=0.2)  # 2 blocks held back
    assert mgr.watermark_blocks == 2
    a = mgr.check_admission(9 * BS)
    assert (a.status, a.blocks_needed, a.blocks_available) == (AdmissionStatus.NOW, 9, 9)
    # 10 blocks fit the empty pool, but only by using the watermark: later, not never
    assert mgr.check_admission(9 * BS + 1).status is AdmissionStatus.LATER
    never = mgr.check_admission(11 * BS + 1)  # 12 blocks > 11
    assert never.status is AdmissionStatus.NEVER and "12 blocks" in never.reason
    add(mgr, "a", toks(5 * BS))
    assert mgr.check_admission(4 * BS).status is AdmissionStatus.NOW
    later = mgr.check_admission(5 * BS)
    assert later.status is AdmissionStatus.LATER and later.reason is None
    # prefix hits need no new block
    p = mgr.find_cached_prefix(toks(5 * BS) + toks(4 * BS, 1000))
    assert mgr.check_admission(9 * BS, p).status is AdmissionStatus.NOW
    finish(mgr)


def test_blocks_needed_counts_boundaries_and_copy_on_write():
    mgr = new_mgr(num_cpu_blocks=4)
    add(mgr, "a", toks(20))  # blocks 0, 1 (4 tokens in block 1)
    assert mgr.num_blocks_needed("a", 12) == 0
    assert mgr.num_blocks_needed("a", 13) == 1
    mgr.fork("a", "b")
    assert mgr.num_blocks_needed("a", 1) == 1  # the shared partial block must be copied
    assert mgr.num_blocks_needed("a", 13) == 2
    assert mgr.num_blocks_needed("a", 0) == 0
    before = mgr.stats().free_blocks
    assert len(mgr.allocate_slots("a", toks(13)).new_block_ids) + 1 == 2 == before - mgr.stats().free_blocks
    mgr.swap_out(["b"])
    assert mgr.num_blocks_to_swap_in(["b"]) == 2
    finish(mgr)


def test_stats_fields_exact():
    mgr = new_mgr()
    add(mgr, "a", toks(20))
    mgr.fork("a", "b")
    st = mgr.stats()
    expected = dict(
        block_size=16,
        total_blocks=11,
        used_blocks=2,
        free_blocks=9,
        cached_blocks=0,
        shared_blocks=2,
        logical_blocks=4,
        stored_tokens=20,
        allocated_slots=32,
        waste=12 / 32,
        prefix_query_tokens=20,
        prefix_hit_tokens=0,
        sharing_ratio=1.0,
        num_seqs=2,
        num_swapped_seqs=0,
        cpu_total_blocks=0,
        cpu_used_blocks=0,
    )
    assert dataclasses.asdict(st) == expected
    assert st.usage == pytest.approx(2 / 11)
    finish(mgr)


def test_check_invariants_catches_corruption():
    mgr = new_mgr()
    add(mgr, "a", toks(20))
    mgr.check_invariants()
    mgr.pool.blocks[0].ref_count += 1
    with pytest.raises(InvariantError, match="ref_count"):
        mgr.check_invariants()
    mgr.pool.blocks[0].ref_count -= 1
    mgr.pool.blocks[1].num_tokens = 3
    with pytest.raises(InvariantError):
        mgr.check_invariants()


def test_misuse_raises_clear_errors():
    mgr = new_mgr()
    with pytest.raises(KeyError, match="unknown sequence 'nope'"):
        mgr.free("nope")
    add(mgr, "a", toks(4))
    with pytest.raises(ValueError, match="exists already"):
        mgr.fork("a", "a")
    with pytest.raises(ValueError, match="watermark"):
        KVCacheManager(4, 16, watermark=1.5)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
    finish(mgr)
