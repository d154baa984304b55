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


class Seqs:
    """The test's side of the manager: it owns each sequence's tokens (as a request does) and passes
    the manager counts to allocate and the tokens to hash. Every `cache` is a step that ran (commit)."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.tokens: dict[str, list[int]] = {}

    def add(self, seq_id, prompt, salt=None, computed=True):
        prefix = self.mgr.find_cached_prefix(prompt, salt)
        alloc = self.mgr.allocate_slots(seq_id, len(prompt) - prefix.num_tokens, prefix)
        assert alloc is not None
        self.tokens[seq_id] = list(prompt)
        if computed:
            self.cache(seq_id)
        return prefix, alloc

    def grow(self, seq_id, new_tokens):
        """Slots for `new_tokens` at the end of the sequence (created on first use); None if no room."""
        alloc = self.mgr.allocate_slots(seq_id, len(new_tokens))
        if alloc is not None:
            self.tokens.setdefault(seq_id, []).extend(new_tokens)
        return alloc

    def cache(self, seq_id, num_tokens=None, commit=True):
        n = len(self.tokens[seq_id]) if num_tokens is None else num_tokens
        self.mgr.cache_blocks(seq_id, self.tokens[seq_id], n)
        if commit:
            self.mgr.commit()

    def fork(self, parent, child, num_blocks=None):
        self.mgr.fork(parent, child, num_blocks)
        n = len(self.tokens[parent]) if num_blocks is None else num_blocks * BS
        self.tokens[child] = self.tokens[parent][:n]

    def admit(self, seq_ids, token_lists, adm):
        self.mgr.admit(seq_ids, token_lists, adm)
        self.tokens.update(zip(seq_ids, map(list, token_lists), strict=True))

    def free(self, seq_id):
        self.mgr.free(seq_id)
        del self.tokens[seq_id]

    def check(self):
        self.mgr.check_invariants(self.tokens)


def refs(mgr, ids):
    return [mgr.pool.blocks[b].ref_count for b in ids]


def finish(seqs):
    seqs.check()
    mgr = seqs.mgr
    for s in mgr.seq_ids():
        seqs.free(s)
    mgr.check_invariants()
    st = mgr.stats()
    assert st.used_blocks == 0 and st.cpu_used_blocks == 0 and st.free_blocks == st.total_blocks


def new_seqs(num_blocks=11, **kw):
    return Seqs(new_mgr(num_blocks, **kw))


NOW, LATER, NEVER = AdmissionStatus.NOW, AdmissionStatus.LATER, AdmissionStatus.NEVER


# ----------------------------------------------------------------------------- block tables


def test_block_table_grows_one_block_at_a_time():
    s = new_seqs()
    mgr = s.mgr
    _, alloc = s.add("a", toks(20))
    assert alloc.new_block_ids == [0, 1] and alloc.copies == []
    assert mgr.block_table("a") == [0, 1]
    assert mgr.slot_mapping("a", 15, 18) == [15, 16, 17]
    # appending inside the partly filled block allocates nothing
    for i in range(12):
        alloc = s.grow("a", [100 + i])
        assert alloc.new_block_ids == [] and alloc.copies == []
    assert mgr.num_tokens("a") == 32 and mgr.stats().free_blocks == 9
    # crossing the boundary allocates exactly one block
    alloc = s.grow("a", [200])
    assert alloc.new_block_ids == [2]
    assert mgr.slot_mapping("a", 32, 33) == [2 * BS + 0]
    assert mgr.stats().free_blocks == 8
    s.check()
    finish(s)


def test_failed_allocation_changes_nothing():
    s = new_seqs(enable_prefix_caching=True)
    mgr = s.mgr
    s.add("a", toks(150))  # 10 blocks: 0..9
    before = (mgr.stats(), mgr.pool.free_queue.block_ids(), mgr.block_table("a"))
    assert s.grow("b", toks(40, 1000)) is None  # needs 3, 1 free
    assert s.grow("a", toks(30, 500)) is None  # 180 tokens need 12 blocks: 2 more, 1 free
    assert not mgr.has_sequence("b") and mgr.num_tokens("a") == 150
    assert (mgr.stats(), mgr.pool.free_queue.block_ids(), mgr.block_table("a")) == before
    s.check()
    finish(s)


def test_failed_allocation_with_a_prefix_hit_takes_no_reference():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(40))  # blocks 0, 1 full and registered, 2 partial
    s.free("a")  # queue: 3..10, 2, 1, 0 ; 0 and 1 cached
    s.add("filler", toks(7 * BS, 5000))  # takes 3..9
    assert mgr.pool.free_queue.block_ids() == [10, 2, 1, 0]
    prompt = toks(40) + toks(60, 9000)
    prefix = mgr.find_cached_prefix(prompt)
    assert prefix.block_ids == [0, 1] and prefix.num_tokens == 32
    before = (mgr.stats(), mgr.pool.free_queue.block_ids())
    # 100 tokens -> 7 blocks, 2 hit, 5 needed; only 4 free and 2 of them are the hits themselves
    assert mgr.allocate_slots("b", len(prompt) - prefix.num_tokens, prefix) is None
    assert (mgr.stats(), mgr.pool.free_queue.block_ids()) == before
    assert refs(mgr, [0, 1]) == [0, 0]
    s.check()
    finish(s)


# ----------------------------------------------------------------------------- prefix caching


def test_hit_while_owner_runs_and_after_it_finished():
    s = new_seqs()
    mgr = s.mgr
    system = toks(32)
    s.add("a", system + toks(8, 1000))  # blocks 0, 1, 2
    prefix, alloc = s.add("b", system + toks(5, 2000))
    assert prefix.block_ids == [0, 1] and prefix.num_tokens == 32
    assert mgr.block_table("b") == [0, 1, 3] and alloc.new_block_ids == [3]
    assert refs(mgr, [0, 1, 2, 3]) == [2, 2, 1, 1]
    st = mgr.stats()
    assert (st.used_blocks, st.shared_blocks, st.logical_blocks) == (4, 2, 6)
    assert (st.prefix_query_tokens, st.prefix_hit_tokens) == (40 + 37, 32)
    assert st.shared_of_used == pytest.approx(0.5)
    assert st.shared_of_total == pytest.approx(st.shared_blocks / st.total_blocks)

    s.free("a")
    assert refs(mgr, [0, 1, 2, 3]) == [1, 1, 0, 1]
    assert mgr.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10, 2]
    s.free("b")
    # b's tail (3) goes first, then its shared head, which a's release already made the oldest holders of
    assert mgr.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10, 2, 3, 1, 0]
    st = mgr.stats()
    assert (st.used_blocks, st.cached_blocks) == (0, 2)

    prefix, _ = s.add("c", system + toks(3, 3000))  # hits blocks that are free but cached
    assert prefix.block_ids == [0, 1]
    assert refs(mgr, [0, 1]) == [1, 1] and mgr.block_table("c") == [0, 1, 4]
    s.check()
    finish(s)


def test_eviction_order_is_lru_with_tails_first():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(48))  # 0, 1, 2 all full and registered
    s.free("a")
    assert mgr.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1, 0]
    assert mgr.stats().cached_blocks == 3
    s.add("x", toks(8 * BS, 5000), computed=False)  # 3..10, nothing evicted yet
    assert mgr.find_cached_prefix(toks(48) + [1]).block_ids == [0, 1, 2]
    s.grow("x", [1])  # evicts block 2 (a's tail) first
    assert mgr.block_table("x")[-1] == 2
    assert mgr.find_cached_prefix(toks(48) + [1]).block_ids == [0, 1]
    s.grow("x", toks(BS, 7000))  # then block 1
    assert mgr.find_cached_prefix(toks(48) + [1]).block_ids == [0]
    assert mgr.stats().cached_blocks == 1
    s.check()
    finish(s)


def test_blocks_become_hits_only_through_cache_blocks():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(40), computed=False)  # slots for 40 tokens: allocation registers nothing
    assert mgr.find_cached_prefix(toks(40)).block_ids == []
    s.cache("a", 20)  # one full block computed
    assert mgr.find_cached_prefix(toks(40)).block_ids == [0]
    s.cache("a", 40)
    assert mgr.find_cached_prefix(toks(40)).block_ids == [0, 1]
    finish(s)


def test_last_prompt_token_is_never_served_from_cache():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(48))
    # all three blocks are cached, but a 48-token prompt must compute its last token
    p = mgr.find_cached_prefix(toks(48))
    assert p.block_ids == [0, 1] and p.num_tokens == 47  # the third block's first 15 tokens: a partial hit
    assert (p.partial.block_id, p.partial.num_tokens) == (2, 15)
    assert mgr.find_cached_prefix(toks(49)).block_ids == [0, 1, 2]
    assert mgr.find_cached_prefix(toks(49)).partial is None  # (nothing cached after block 2)
    p = mgr.find_cached_prefix(toks(32))
    assert p.block_ids == [0] and (p.partial.block_id, p.partial.num_tokens, p.num_tokens) == (1, 15, 31)
    assert mgr.find_cached_prefix(toks(1)).num_tokens == 0
    assert mgr.find_cached_prefix([]).block_ids == []
    finish(s)


# ----------------------------------------------------------------------------- partial hits


def test_a_prompt_that_ends_inside_a_cached_block_copies_its_leading_tokens():
    """A shared system prompt of 40 tokens, two different questions: the second request finds the
    first two blocks and, in block 2, the system prompt's last 8 tokens. It copies block 2 into a
    block of its own and computes only from token 40; the source is pinned until the step ends."""
    s = new_seqs()
    mgr = s.mgr
    system = toks(40)
    s.add("a", system + toks(9, 500))  # blocks 0, 1, 2 (full: 40 + 8 tokens), 3
    prompt = system + toks(5, 700)
    adm = mgr.check_admission([prompt])
    assert adm.prefix.block_ids == [0, 1] and (adm.prefix.partial.block_id, adm.prefix.partial.num_tokens) == (2, 8)
    assert adm.prefix.num_tokens == 40 and adm.blocks_needed == 1  # the copy; the source is a's
    copies = mgr.admit(["b"], [prompt], adm)
    s.tokens["b"] = list(prompt)
    assert copies == [(2, 4)] and mgr.block_table("b") == [0, 1, 4]
    assert refs(mgr, [0, 1, 2, 4]) == [2, 2, 2, 1]  # block 2: a's, and the pin for the step's copy
    s.check()  # (the pin counts as a holder)
    s.cache("b")  # the step ran: the pin goes
    assert refs(mgr, [0, 1, 2, 4]) == [2, 2, 1, 1]
    assert mgr.stats().prefix_hit_tokens == 40
    finish(s)


def test_a_free_cached_source_is_pinned_then_goes_back_to_the_free_queue_still_cached():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(48))
    s.free("a")  # blocks 0-2 free but cached
    free = mgr.num_free_blocks
    prompt = toks(40) + [999]
    adm = mgr.check_admission([prompt])
    assert (adm.prefix.partial.block_id, adm.prefix.num_tokens) == (2, 40)
    assert adm.blocks_available == free - 3  # the two hits and the source leave the free queue
    copies = mgr.admit(["b"], [prompt], adm)
    s.tokens["b"] = prompt
    assert copies == [(2, 3)] and mgr.num_free_blocks == free - 4
    s.cache("b")
    assert mgr.num_free_blocks == free - 3 and mgr.pool.blocks[2].cache_key is not None
    assert mgr.find_cached_prefix(toks(48)).partial.block_id == 2  # still hittable
    finish(s)


def test_a_block_the_step_being_scheduled_writes_is_never_a_partial_source():
    """Its KV is written by the forward, after the worker's copies: the copy would read nothing."""
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(48), computed=False)
    s.cache("a", commit=False)  # registered by the step being scheduled
    p = mgr.find_cached_prefix(toks(40) + [999])
    assert p.block_ids == [0, 1] and p.partial is None and p.num_tokens == 32  # full hits are fine in-batch
    mgr.commit()
    assert mgr.find_cached_prefix(toks(40) + [999]).partial.block_id == 2
    finish(s)


def test_partial_hits_follow_the_chain_and_the_salt():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(33))
    s.add("salted", toks(17, 100), salt="t")
    assert mgr.find_cached_prefix(toks(16, 100) + [5]).partial is None  # not unsalted
    p = mgr.find_cached_prefix(toks(16, 100) + [5], "t")
    assert p.block_ids == mgr.block_table("salted")[:1] and p.partial is None  # a full hit, nothing after it
    p = mgr.find_cached_prefix(toks(10, 100) + [5], "t")
    assert (p.partial.block_id, p.num_tokens) == (mgr.block_table("salted")[0], 10)
    p = mgr.find_cached_prefix([9] + toks(16, 1) + [5])  # the same tokens one position on: nothing
    assert p.num_tokens == 0
    p = mgr.find_cached_prefix(toks(16) + toks(8, 16) + [77, 78])  # after block 0: a's block 1, 8 of 16
    assert p.block_ids == [0] and (p.partial.block_id, p.partial.num_tokens) == (1, 8)
    finish(s)


def test_a_partial_hit_whose_pin_does_not_fit_is_dropped():
    """A 4-block pool, a 4-block prompt whose third block starts as a free cached one: pinning that
    block as well would need 5. The request is admitted without the partial hit."""
    s = Seqs(new_mgr(num_blocks=4))
    mgr = s.mgr
    s.add("a", toks(40))
    s.free("a")  # blocks 0, 1 cached; block 2 (8 tokens) not: nothing to copy yet
    s.add("a", toks(48))
    s.free("a")
    prompt = toks(40) + toks(20, 900)  # 60 tokens: 4 blocks, 2 of them hits
    adm = mgr.check_admission([prompt])
    assert adm.status is AdmissionStatus.NOW and adm.prefix.partial is None and adm.prefix.num_tokens == 32
    assert mgr.admit(["b"], [prompt], adm) == []
    s.tokens["b"] = prompt
    s.cache("b")
    finish(s)


def test_a_stale_partial_hit_is_refused():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(48))
    s.free("a")
    p = mgr.find_cached_prefix(toks(40) + [999])
    assert p.block_ids == [0, 1] and p.partial.block_id == 2
    s.grow("c", toks(9 * BS, 300))  # the 8 never-used blocks, then block 2 (a's blocks went back 2, 1, 0)
    assert mgr.block_table("c")[-1] == 2 and mgr.pool.blocks[0].cache_key is not None
    with pytest.raises(RuntimeError, match="partial hit's block was reused"):
        mgr.allocate_slots("b", 1, p)
    assert not mgr.has_sequence("b")
    finish(s)


def test_identical_tokens_at_another_position_do_not_hit():
    s = new_seqs()
    mgr = s.mgr
    chunk = toks(BS, 500)
    s.add("a", chunk + chunk + [1])  # block 0 and block 1 hold the same tokens
    st = mgr.stats()
    assert st.used_blocks == 3  # stored twice: different positions are different KV
    # the chunk preceded by something else is a different chain: no hit
    assert mgr.find_cached_prefix(toks(BS, 900) + chunk + [1]).block_ids == []
    assert mgr.find_cached_prefix(chunk + [1]).block_ids == [0]
    finish(s)


def test_identical_content_computed_twice_registers_once():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(33), computed=False)  # both miss: neither is written yet
    s.add("b", toks(33), computed=False)
    assert mgr.block_table("a") == [0, 1, 2] and mgr.block_table("b") == [3, 4, 5]
    s.cache("a")
    s.cache("b")
    assert len(mgr.prefix_cache) == 2
    assert mgr.find_cached_prefix(toks(33)).block_ids == [0, 1]  # a's copy, the first registered
    s.check()
    s.free("a")
    s.free("b")
    assert mgr.stats().cached_blocks == 2  # b's duplicates are plain free blocks
    finish(s)


def test_cache_salt_isolates_tenants():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(40), salt="tenant-a")
    assert mgr.find_cached_prefix(toks(40)).block_ids == []
    assert mgr.find_cached_prefix(toks(40), "tenant-b").block_ids == []
    assert mgr.find_cached_prefix(toks(40), "tenant-a").block_ids == [0, 1]
    finish(s)


def test_prefix_caching_off_never_hits():
    s = new_seqs(enable_prefix_caching=False)
    mgr = s.mgr
    s.add("a", toks(40))
    p, _ = s.add("b", toks(40))
    assert p.block_ids == [] and mgr.block_table("b") == [3, 4, 5]
    assert mgr.stats().prefix_query_tokens == 0
    finish(s)


# ----------------------------------------------------------------------------- in-batch sharing


def test_in_batch_hit_on_blocks_registered_this_step_then_a_failed_step_forgets_them():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(40), computed=False)  # blocks 0, 1, 2
    s.cache("a", commit=False)  # the step computing a's prompt is scheduled: 0 and 1 registered
    b = toks(32) + toks(10, 500)
    adm = mgr.check_admission([b])
    assert adm.prefix.block_ids == [0, 1] and adm.blocks_needed == 1
    # b is admitted later in the same step: it hits a's blocks before their KV is written
    prefix, alloc = s.add("b", b, computed=False)
    assert prefix.block_ids == [0, 1] and alloc.new_block_ids == [3]
    assert mgr.block_table("b") == [0, 1, 3] and refs(mgr, [0, 1, 2, 3]) == [2, 2, 1, 1]
    s.cache("b", commit=False)
    s.check()

    mgr.discard_uncommitted()  # the step failed: a's KV was never written
    assert mgr.find_cached_prefix(b).block_ids == [] and len(mgr.prefix_cache) == 0
    assert mgr.block_table("b") == [0, 1, 3] and refs(mgr, [0, 1, 2, 3]) == [2, 2, 1, 1]
    s.check()

    # the step is retried: the same blocks are registered again, and a commit keeps them
    s.cache("a", commit=False)
    s.cache("b", commit=False)
    mgr.commit()
    assert mgr.find_cached_prefix(b).block_ids == [0, 1] and len(mgr.prefix_cache) == 2
    mgr.discard_uncommitted()  # nothing uncommitted is left to forget
    assert mgr.find_cached_prefix(b).block_ids == [0, 1]
    s.check()
    s.free("a")
    s.free("b")
    assert mgr.stats().cached_blocks == 2
    finish(s)


def test_a_block_registered_by_one_holder_is_consistent_for_all_holders():
    # The lead computes (and registers) a block it shares with a sibling the step did not schedule:
    # the sibling's own tokens are that block's content, so the bookkeeping must hold for it too.
    s = new_seqs()
    mgr = s.mgr
    lists = [toks(40), toks(32) + toks(4, 900)]
    s.admit(["lead", "sib"], lists, mgr.check_admission(lists))
    assert mgr.block_table("sib")[:2] == mgr.block_table("lead")[:2] == [0, 1]
    s.cache("lead")
    assert mgr.find_cached_prefix(lists[1]).block_ids == [0, 1]
    s.check()
    s.cache("sib")  # finds both blocks registered already
    assert len(mgr.prefix_cache) == 2
    finish(s)


def test_blocks_of_a_failed_step_are_plain_free_blocks_once_freed():
    s = new_seqs()
    mgr = s.mgr
    s.add("old", toks(20))  # block 0 registered and committed
    s.add("a", toks(48), computed=False)  # hits block 0; blocks 2, 3 are its own
    assert mgr.block_table("a") == [0, 2, 3]
    s.cache("a", commit=False)  # registers 2 and 3 (its last token is full block 3's last)
    assert mgr.find_cached_prefix(toks(49)).block_ids == [0, 2, 3]
    mgr.discard_uncommitted()
    assert mgr.find_cached_prefix(toks(49)).block_ids == [0]  # the committed block stays a hit
    s.free("a")
    assert refs(mgr, [0, 2, 3]) == [1, 0, 0] and mgr.stats().cached_blocks == 0
    assert mgr.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 2]
    finish(s)


# ----------------------------------------------------------------------------- fork / copy-on-write


def test_fork_then_exactly_one_copy_on_a_shared_partial_block():
    s = new_seqs()
    mgr = s.mgr
    mem = KVMemory(mgr, s.tokens)
    _, alloc = s.add("a", toks(20))
    mem.apply("a", alloc, 20)
    s.fork("a", "b")
    assert mgr.block_table("b") == [0, 1] and refs(mgr, [0, 1]) == [2, 2]
    assert mgr.stats().shared_blocks == 2

    alloc = s.grow("b", [777])  # b writes into shared block 1 -> b gets a copy
    assert alloc.copies == [(1, 2)] and alloc.new_block_ids == []
    mem.apply("b", alloc, 1)
    assert mgr.block_table("b") == [0, 2] and refs(mgr, [0, 1, 2]) == [2, 1, 1]

    alloc = s.grow("a", [555])  # a now owns block 1 alone: written in place
    assert alloc.copies == [] and alloc.new_block_ids == []
    mem.apply("a", alloc, 1)
    mem.check()
    assert mem.read("a")[-1] == 555 and mem.read("b")[-1] == 777
    s.check()
    finish(s)


def test_fork_at_a_block_boundary_copies_nothing():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(32))
    s.fork("a", "b")
    alloc_a = s.grow("a", [1])
    alloc_b = s.grow("b", [2])
    assert (alloc_a.copies, alloc_a.new_block_ids) == ([], [2])
    assert (alloc_b.copies, alloc_b.new_block_ids) == ([], [3])
    assert refs(mgr, [0, 1, 2, 3]) == [2, 2, 1, 1]
    s.check()
    finish(s)


def test_fork_shares_only_the_first_full_blocks_when_asked():
    s = new_seqs()
    mgr = s.mgr
    mem = KVMemory(mgr, s.tokens)
    _, alloc = s.add("a", toks(40))  # 0, 1 full and registered, 2 partial
    mem.apply("a", alloc, 40)
    s.fork("a", "c", num_blocks=1)
    s.fork("a", "d", num_blocks=2)
    s.fork("a", "e", num_blocks=0)
    assert (mgr.block_table("c"), mgr.num_tokens("c")) == ([0], 16)
    assert (mgr.block_table("d"), mgr.num_tokens("d")) == ([0, 1], 32)
    assert (mgr.block_table("e"), mgr.num_tokens("e")) == ([], 0)
    assert refs(mgr, [0, 1, 2]) == [3, 2, 1]
    st = mgr.stats()
    assert (st.used_blocks, st.shared_blocks, st.logical_blocks) == (3, 2, 6)
    with pytest.raises(ValueError, match="cannot share 3 full blocks of a sequence of 40 tokens"):
        mgr.fork("a", "f", num_blocks=3)  # block 2 is not full
    with pytest.raises(ValueError, match="cannot share -1 full blocks"):
        mgr.fork("a", "f", num_blocks=-1)
    assert not mgr.has_sequence("f")
    s.check()

    # the children go on with their own tokens in their own blocks: nothing is copied
    alloc = s.grow("c", toks(10, 700))
    assert (alloc.new_block_ids, alloc.copies) == ([3], [])
    mem.apply("c", alloc, 10)
    alloc = s.grow("e", toks(5, 800))
    assert (alloc.new_block_ids, alloc.copies) == ([4], [])
    mem.apply("e", alloc, 5)
    s.cache("c")
    s.cache("e")
    assert refs(mgr, [0, 1, 2, 3, 4]) == [3, 2, 1, 1, 1]
    mem.check()
    assert mem.read("a") == toks(40) and mem.read("c") == toks(16) + toks(10, 700)
    finish(s)


def test_copy_on_write_that_cannot_get_a_block_fails_cleanly():
    s = new_seqs(num_blocks=3)
    mgr = s.mgr
    s.add("a", toks(20))  # 0, 1
    s.fork("a", "b")
    s.grow("c", [1])  # block 2: pool full
    before = mgr.stats()
    assert s.grow("b", [9]) is None
    assert mgr.stats() == before and mgr.block_table("b") == [0, 1] and mgr.num_tokens("b") == 20
    finish(s)


# ----------------------------------------------------------------------------- swap


def test_swap_out_and_back_in_restores_the_same_tokens():
    s = new_seqs(num_cpu_blocks=4)
    mgr = s.mgr
    mem = KVMemory(mgr, s.tokens)
    prompt = toks(40, 300)
    _, alloc = s.add("a", prompt)
    mem.apply("a", alloc, 40)
    pairs = mgr.swap_out(["a"])
    assert pairs == [(0, 0), (1, 1), (2, 2)]
    mem.swap(pairs, to_cpu=True)
    assert mgr.is_swapped("a") and mgr.block_table("a") == [0, 1, 2]
    st = mgr.stats()
    assert (st.used_blocks, st.cpu_used_blocks, st.num_swapped_seqs, st.cached_blocks) == (0, 3, 1, 2)
    s.check()

    _, alloc = s.add("other", toks(3 * BS, 9000))  # evicts nothing useful: 3, 4, 5
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
    alloc = s.grow("a", [41])
    mem.apply("a", alloc, 1)
    s.cache("a")
    mem.check()
    s.check()
    finish(s)


def test_swap_keeps_sharing_inside_a_group_and_fails_cleanly_when_cpu_is_full():
    s = new_seqs(num_cpu_blocks=3)
    mgr = s.mgr
    s.add("a", toks(40))
    s.fork("a", "b")
    s.add("c", toks(40, 800))
    assert mgr.swap_out(["c", "a"]) is None  # 6 distinct blocks, 3 CPU blocks
    assert mgr.stats().cpu_used_blocks == 0 and not mgr.is_swapped("a")
    pairs = mgr.swap_out(["a", "b"])  # 3 distinct blocks, each held twice
    assert pairs == [(0, 0), (1, 1), (2, 2)]
    assert [b.ref_count for b in mgr.cpu_pool.blocks] == [2, 2, 2]
    with pytest.raises(RuntimeError):
        mgr.allocate_slots("a", 1)
    s.check()
    pairs = mgr.swap_in(["a", "b"])
    assert mgr.block_table("a") == mgr.block_table("b") == [b for _, b in pairs]
    assert refs(mgr, mgr.block_table("a")) == [2, 2, 2]
    s.check()
    finish(s)


# ----------------------------------------------------------------------------- admission


def test_admission_now_later_never_with_watermark():
    s = Seqs(KVCacheManager(11, BS, watermark=0.2))  # 2 blocks held back
    mgr = s.mgr
    assert mgr.watermark_blocks == 2
    a = mgr.check_admission([toks(9 * BS)])
    assert (a.status, a.blocks_needed, a.blocks_available, a.shared_blocks) == (NOW, 9, 9, [0])
    # 10 blocks fit the empty pool, but only by using the watermark: later, not never
    assert mgr.check_admission([toks(9 * BS + 1)]).status is LATER
    never = mgr.check_admission([toks(11 * BS + 1)])  # 12 blocks > 11
    assert never.status is NEVER
    assert never.reason == "it needs 12 blocks of 16 tokens for 177 tokens, but the whole cache holds 11 blocks"
    s.add("a", toks(5 * BS))
    assert mgr.check_admission([toks(4 * BS, 1000)]).status is NOW
    later = mgr.check_admission([toks(5 * BS, 1000)])
    assert (later.status, later.blocks_needed, later.blocks_available, later.reason) == (LATER, 5, 4, None)
    # prefix hits need no new block
    prompt = toks(5 * BS) + toks(4 * BS, 1000)
    hit = mgr.check_admission([prompt])
    assert (hit.status, hit.blocks_needed, hit.prefix.block_ids) == (NOW, 4, [0, 1, 2, 3, 4])
    assert mgr.check_admission([prompt], use_prefix_cache=False).status is LATER
    finish(s)


def test_group_admission_shares_the_leads_blocks_as_far_as_tokens_agree():
    s = new_seqs()
    mgr = s.mgr
    s.add("old", toks(17))
    s.free("old")  # block 0 stays cached (free); queue 2..10, 1, 0
    lead = toks(50)  # 4 blocks, block 0 a hit
    sib1 = toks(40) + toks(30, 500)  # agrees with the lead on 40 tokens: shares 2 full blocks, owns 3
    sib2 = toks(20) + toks(5, 900)  # agrees on 20: shares 1, owns 1
    lists = [lead, sib1, sib2]
    adm = mgr.check_admission(lists)
    # 4 + 3 + 1 blocks, 1 of them a hit; the hit is free, so it is not available for new blocks
    assert (adm.status, adm.blocks_needed, adm.blocks_available, adm.shared_blocks) == (NOW, 7, 10, [0, 2, 1])
    assert (adm.prefix.block_ids, adm.prefix.num_tokens) == ([0], 16)
    s.admit(["L", "s1", "s2"], lists, adm)
    assert mgr.block_table("L") == [0, 2, 3, 4]
    assert mgr.block_table("s1") == [0, 2, 5, 6, 7]
    assert mgr.block_table("s2") == [0, 8]
    assert [mgr.num_tokens(x) for x in ("L", "s1", "s2")] == [50, 70, 25]
    assert refs(mgr, range(11)) == [3, 0, 2, 1, 1, 1, 1, 1, 1, 0, 0]
    assert mgr.pool.free_queue.block_ids() == [9, 10, 1]
    st = mgr.stats()
    assert (st.used_blocks, st.shared_blocks, st.logical_blocks, st.stored_tokens) == (8, 2, 11, 97)
    assert (st.prefix_query_tokens, st.prefix_hit_tokens) == (17 + 50, 16)
    assert len(mgr.prefix_cache) == 1  # admission registers nothing
    s.check()

    for x in ("L", "s1", "s2"):  # one step computes all three
        s.cache(x, commit=False)
    mgr.commit()
    # L registers its blocks 2, 3; s1 finds block 2 registered already and adds its own 5, 6
    assert len(mgr.prefix_cache) == 5
    assert mgr.find_cached_prefix(lead + [1]).block_ids == [0, 2, 3]
    assert mgr.find_cached_prefix(sib1 + [1]).block_ids == [0, 2, 5, 6]
    assert mgr.find_cached_prefix(sib2).block_ids == [0]
    s.check()
    finish(s)


def test_group_admission_never_names_the_sequences():
    mgr = new_mgr()
    lead = toks(100)  # 7 blocks
    sib = toks(16) + toks(84, 3000)  # 7 blocks, 1 shared
    adm = mgr.check_admission([lead, sib])
    assert (adm.status, adm.blocks_needed, adm.shared_blocks) == (NEVER, 13, [0, 1])
    assert (
        adm.reason == "its 2 sequences need 13 blocks of 16 tokens for 200 tokens, but the whole cache holds 11 blocks"
    )
    assert mgr.check_admission([lead]).status is NOW and mgr.check_admission([sib]).status is NOW
    with pytest.raises(RuntimeError, match="NOW admission"):
        mgr.admit(["a", "b"], [lead, sib], adm)
    assert mgr.seq_ids() == [] and mgr.stats().free_blocks == 11


def test_group_admission_now_or_later_around_the_watermark():
    s = Seqs(KVCacheManager(11, BS, watermark=0.2))  # 2 blocks held back
    mgr = s.mgr
    lead = toks(80)  # 5 blocks
    sib1 = toks(32) + toks(64, 700)  # 6 blocks, 2 shared with the lead
    sib2 = toks(16)  # one full block equal to the lead's, but its last token must be computed: shares none
    lists = [lead, sib1, sib2]
    keep = mgr.check_admission(lists)
    assert (keep.status, keep.blocks_needed, keep.blocks_available, keep.shared_blocks) == (LATER, 10, 9, [0, 2, 0])
    use = mgr.check_admission(lists, keep_watermark=False)
    assert (use.status, use.blocks_needed, use.blocks_available) == (NOW, 10, 11)
    assert mgr.check_admission(lists[:2]).status is NOW  # 9 blocks fit beside the watermark
    with pytest.raises(RuntimeError, match="NOW admission"):
        mgr.admit(["L", "s1", "s2"], lists, keep)
    s.admit(["L", "s1", "s2"], lists, use)
    assert mgr.block_table("L") == [0, 1, 2, 3, 4]
    assert mgr.block_table("s1") == [0, 1, 5, 6, 7, 8]
    assert mgr.block_table("s2") == [9]
    assert refs(mgr, range(11)) == [2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0]
    assert mgr.stats().free_blocks == 1
    s.check()
    finish(s)


def test_stale_admission_raises_and_changes_nothing():
    s = new_seqs()
    mgr = s.mgr
    lists = [toks(40), toks(40)]  # the sibling shares 2 blocks and owns 1
    adm = mgr.check_admission(lists)
    assert (adm.status, adm.blocks_needed, adm.shared_blocks) == (NOW, 4, [0, 2])
    s.add("filler", toks(8 * BS, 5000))  # 3 blocks left
    before = (mgr.stats(), mgr.pool.free_queue.block_ids())
    with pytest.raises(RuntimeError, match="stale Admission"):
        mgr.admit(["a", "b"], lists, adm)
    assert (mgr.stats(), mgr.pool.free_queue.block_ids()) == before and mgr.seq_ids() == ["filler"]
    with pytest.raises(RuntimeError, match="exactly these sequences"):
        mgr.admit(["a"], lists, adm)
    finish(s)

    # a hit block handed out since the check
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(40))
    s.free("a")  # 0, 1 cached
    adm = mgr.check_admission([toks(40)])
    assert (adm.status, adm.blocks_needed, adm.prefix.block_ids) == (NOW, 1, [0, 1])
    s.add("filler", toks(10 * BS, 5000), computed=False)  # takes 1, evicting it
    s.free("filler")
    before = (mgr.stats(), mgr.pool.free_queue.block_ids())
    with pytest.raises(RuntimeError, match="stale"):
        mgr.admit(["b"], [toks(40)], adm)
    assert (mgr.stats(), mgr.pool.free_queue.block_ids()) == before and mgr.seq_ids() == []
    finish(s)


# ----------------------------------------------------------------------------- stats and checks


def test_blocks_needed_counts_boundaries_and_copy_on_write():
    s = new_seqs(num_cpu_blocks=4)
    mgr = s.mgr
    s.add("a", toks(20))  # blocks 0, 1 (4 tokens in block 1)
    assert mgr.num_blocks_needed("a", 12) == 0
    assert mgr.num_blocks_needed("a", 13) == 1
    s.fork("a", "b")
    assert mgr.num_blocks_needed("a", 1) == 1  # the shared partial block must be copied
    assert mgr.num_blocks_needed("a", 13) == 2
    assert mgr.num_blocks_needed("a", 0) == 0
    before = mgr.stats().free_blocks
    assert len(s.grow("a", toks(13)).new_block_ids) + 1 == 2 == before - mgr.stats().free_blocks
    mgr.swap_out(["b"])
    assert mgr.num_blocks_to_swap_in(["b"]) == 2
    finish(s)


def test_blocks_to_grow_counts_each_copy_of_a_shared_partial_block_once():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(20))  # blocks 0, 1 (4 tokens in block 1)
    s.fork("a", "b")
    s.fork("a", "c")  # block 1 held by 3 tables
    assert mgr.num_blocks_to_grow([("a", 1)]) == 1  # a copy
    assert mgr.num_blocks_to_grow([("a", 1), ("b", 1)]) == 2  # two copies; c keeps block 1
    assert mgr.num_blocks_to_grow([("a", 1), ("b", 1), ("c", 1)]) == 2  # the last appender owns it alone
    assert mgr.num_blocks_to_grow([("a", 13), ("b", 0), ("c", 12)]) == 3  # a: copy + 1 block; c: copy
    before = mgr.stats().free_blocks
    for seq_id, n in (("a", 13), ("b", 0), ("c", 12)):
        s.grow(seq_id, toks(n, 100))
    assert before - mgr.stats().free_blocks == 3
    s.check()
    finish(s)


def test_stats_fields_exact():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(20))
    s.fork("a", "b")
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
        shared_of_used=1.0,
        num_seqs=2,
        num_swapped_seqs=0,
        cpu_total_blocks=0,
        cpu_used_blocks=0,
        bytes_per_block=0,  # a manager told nothing of the bytes
        tier_total_blocks=0,
        tier_cached_blocks=0,
        tier_hit_tokens=0,
        evicted_tokens=0,
        demoted_used_blocks={},  # no demoting policy: no pools per precision
        demoted_total_blocks={},
        demotions={},
        group_kinds=["full attention"],  # one KV-cache group: every layer's blocks in one table per sequence
        group_blocks=[4],
    )
    assert dataclasses.asdict(st) == expected
    assert st.usage == pytest.approx(2 / 11)
    finish(s)
    told = KVCacheManager(11, 16, bytes_per_block=4352).stats()
    assert told.bytes_per_block == 4352 and told.total_bytes == 11 * 4352 and told.used_bytes == 0


def test_check_invariants_catches_corruption():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(20))  # block 0 full and registered
    mgr.check_invariants({"a": toks(20)})
    with pytest.raises(InvariantError, match="a: chain digests"):
        mgr.check_invariants({"a": toks(20, 1)})
    with pytest.raises(InvariantError, match="20 slots but 19 tokens"):
        mgr.check_invariants({"a": toks(19)})
    mgr.pool.blocks[0].ref_count += 1
    with pytest.raises(InvariantError, match="ref_count"):
        mgr.check_invariants()
    mgr.pool.blocks[0].ref_count -= 1
    mgr.pool.blocks[1].num_tokens = 3
    with pytest.raises(InvariantError):
        mgr.check_invariants()


def test_misuse_raises_clear_errors():
    s = new_seqs()
    mgr = s.mgr
    with pytest.raises(KeyError, match="unknown sequence 'nope'"):
        mgr.free("nope")
    s.add("a", toks(4))
    with pytest.raises(ValueError, match="exists already"):
        mgr.fork("a", "a")
    with pytest.raises(ValueError, match="exists already"):
        mgr.allocate_slots("a", 1, mgr.find_cached_prefix(toks(5)))
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        mgr.allocate_slots("a", -1)
    with pytest.raises(IndexError, match="5 cached tokens"):
        mgr.cache_blocks("a", toks(5), 5)
    with pytest.raises(ValueError, match="at least one sequence"):
        mgr.check_admission([])
    with pytest.raises(ValueError, match="at least one token"):
        mgr.check_admission([toks(4), []])
    with pytest.raises(ValueError, match="watermark"):
        KVCacheManager(4, 16, watermark=1.5)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
    finish(s)


def test_a_sequence_that_ends_leaves_its_partly_filled_last_block_cached_as_a_tail():
    """Freed with its tokens, a sequence's last block (8 of 16 slots) is registered under those 8
    tokens: the same prompt again computes only its last token, a longer one (the next turn of a
    chat) only what follows. No full-block lookup can find a tail."""
    s = new_seqs()
    mgr = s.mgr
    prompt = toks(40)
    s.add("a", prompt)
    mgr.free("a", prompt, 40)
    del s.tokens["a"]
    tail = mgr.pool.blocks[2]
    assert tail.ref_count == 0 and tail.cache_key.token_ids == tuple(prompt[32:40])
    p = mgr.find_cached_prefix(prompt)
    assert p.block_ids == [0, 1] and (p.partial.block_id, p.partial.num_tokens, p.num_tokens) == (2, 7, 39)
    p = mgr.find_cached_prefix(prompt + [999, 998])
    assert (p.partial.block_id, p.num_tokens) == (2, 40)
    assert mgr.find_cached_prefix(toks(48) + [5]).num_tokens == 40  # (a full block 2 would be a tail's 8)
    mgr.check_invariants()
    finish(s)


def test_a_tail_is_kept_only_for_a_block_held_alone_and_never_announced_or_offloaded():
    s = Seqs(new_mgr(num_blocks=4, num_tier_blocks=2))
    mgr = s.mgr
    s.add("a", toks(24))
    s.fork("a", "b")  # both hold block 1 (8 tokens)
    mgr.free("a", toks(24), 24)
    del s.tokens["a"]
    assert mgr.pool.blocks[1].cache_key is None  # b still holds it
    mgr.free("b", toks(24), 24)
    del s.tokens["b"]
    assert mgr.pool.blocks[1].cache_key.token_ids == tuple(range(16, 24))
    batches, _ = mgr.events.since(0)
    announced = [d for b in batches for e in b.events for d in getattr(e, "block_hashes", [])]
    assert announced == [mgr.pool.blocks[0].cache_key.digest.hex()]  # block 0 only, never the tail
    s.grow("c", toks(4 * BS, 500))  # every block reused: block 0 goes to the tier, the tail does not
    assert len(mgr.tier.prefix_cache) == 1
    finish(s)


def test_a_sequence_with_uncomputed_slots_keeps_only_what_was_computed():
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(40), computed=False)
    s.cache("a", 20)  # an abort after the first 20 tokens: slots for 40, KV for 20
    mgr.free("a", toks(40), 20)
    del s.tokens["a"]
    assert mgr.pool.blocks[1].cache_key.token_ids == tuple(range(16, 20))
    assert mgr.find_cached_prefix(toks(40)).num_tokens == 20
    with pytest.raises(IndexError, match="41 computed tokens"):
        s.add("b", toks(40))
        mgr.free("b", toks(40), 41)
    finish(s)


def test_in_the_first_block_a_partial_hit_needs_half_a_block():
    """Chat prompts all start with the template's few tokens: no copy for those alone."""
    s = new_seqs()
    mgr = s.mgr
    s.add("a", toks(20))
    assert mgr.find_cached_prefix(toks(7) + [900, 901]).num_tokens == 0  # 7 of 16: not worth a block
    p = mgr.find_cached_prefix(toks(8) + [900, 901])
    assert (p.partial.block_id, p.num_tokens) == (0, 8)
    finish(s)
