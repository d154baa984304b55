"""The scheduler built directly over tiny pools (4-token blocks), with exact expected outputs.

Each test plays the engine's part by hand: `schedule()`, then `update_from_output()` with the
tokens, forks and endings an engine would send. Block ids follow the pool's LRU free queue: fresh
blocks come from the head in id order; freed blocks go to the tail, last block first.
"""

from __future__ import annotations

import pytest

from kvpage.core import KVCacheManager
from kvpage.core.request import Request, RequestStatus
from kvpage.core.scheduler import Scheduler
from kvpage.core.scheduler_output import SeqKey
from kvpage.core.step_update import RequestUpdate, SeqUpdate, StepResult

BS = 4


def make(num_blocks, *, caching=True, cpu=0, mode=None, budget=64, max_seqs=16, max_len=64, watermark=0.0):
    kv = KVCacheManager(num_blocks, BS, num_cpu_blocks=cpu, enable_prefix_caching=caching, watermark=watermark)
    return Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                     preemption_mode=mode)  # fmt: skip


def add(s: Scheduler, rid: str, prompt: list[int], width: int = 1) -> Request:
    req = Request(rid, prompt, len(s.requests), width=width)
    s.add_request(req)
    return req


def seqs(out):
    """The scheduled sequences as tuples: (request, index, tokens, num_computed, block table, logits)."""
    return [(s.seq_id.request_id, s.seq_id.index, s.token_ids, s.num_computed, s.block_table, s.return_logits)
            for s in out.sequences]  # fmt: skip


def step(s: Scheduler, *updates: RequestUpdate):
    out = s.schedule()
    s.check_invariants()
    result = s.update_from_output(out, {u.request_id: u for u in updates})
    s.check_invariants()
    return out, result


def tok(rid, *seq_updates):
    return RequestUpdate(rid, [SeqUpdate(*u) if isinstance(u, tuple) else u for u in seq_updates])


def assert_empty(s: Scheduler) -> None:
    s.check_invariants()
    st = s.kv.stats()
    assert not s.has_unfinished() and st.used_blocks == 0 and st.cpu_used_blocks == 0


# ----------------------------------------------------------------------------- in-batch sharing


def test_requests_arriving_together_share_a_prefix_computed_in_the_same_step():
    s = make(10)
    add(s, "a", list(range(1, 11)))  # blocks: [1 2 3 4][5 6 7 8][9 10]
    add(s, "b", list(range(1, 9)) + [50, 51, 52])  # the same two full blocks, then its own
    out, _ = step(s, tok("a", (0, 11)), tok("b", (0, 53)))
    # b hits a's two full blocks, registered as a's step was scheduled: it computes only its own tokens
    assert seqs(out) == [
        ("a", 0, list(range(1, 11)), 0, [0, 1, 2], True),
        ("b", 0, [50, 51, 52], 8, [0, 1, 3], True),
    ]
    st = s.kv.stats()
    assert st.prefix_hit_tokens == 8 and st.used_blocks == 4 and st.shared_blocks == 2
    s.abort_request("a")
    s.abort_request("b")
    assert_empty(s)


def test_a_failed_step_forgets_the_blocks_it_registered_and_fails_only_its_requests():
    s = make(10)
    add(s, "a", list(range(1, 11)))
    add(s, "b", list(range(1, 9)) + [50])
    out = s.schedule()
    assert [x[:4] for x in seqs(out)] == [("a", 0, list(range(1, 11)), 0), ("b", 0, [50], 8)]
    add(s, "c", [7, 7, 7])  # arrives while the step runs: not part of it
    result = s.fail_step(out, "the model step failed: boom")
    assert result == StepResult([], {"a": "the model step failed: boom", "b": "the model step failed: boom"})
    s.check_invariants()
    # the KV of a's blocks was never written: nobody may hit them now
    assert len(s.kv.prefix_cache) == 0 and s.kv.find_cached_prefix(list(range(1, 11))).num_tokens == 0
    out, result = step(s, tok("c", (0, 1, None, "stop")))
    assert [x[:4] for x in seqs(out)] == [("c", 0, [7, 7, 7], 0)] and result.finished == ["c"]
    assert_empty(s)


# ----------------------------------------------------------------------------- several sequences


def test_n_samples_fork_then_copy_the_shared_partial_block_exactly_twice():
    s = make(8)
    add(s, "a", [1, 2, 3, 4, 5, 6], width=3)
    out, _ = step(s, tok("a", (0, 7), (1, 8, 0), (2, 9, 0)))
    assert seqs(out) == [("a", 0, [1, 2, 3, 4, 5, 6], 0, [0, 1], True)]
    assert s.kv.stats().shared_blocks == 2  # three tables, two blocks
    out, _ = step(s, tok("a", (0, 10), (1, 11), (2, 12)))
    # of three appenders to block 1, two copy it and the last keeps it
    assert out.copies == [(1, 2), (1, 3)]
    assert seqs(out) == [("a", 0, [7], 6, [0, 2], True), ("a", 1, [8], 6, [0, 3], True), ("a", 2, [9], 6, [0, 1], True)]
    s.abort_request("a")
    assert_empty(s)


def _preempted_n3_request(caching: bool):
    """b (older) and a (n = 3) share a 6-block pool until b's growth preempts a by recompute."""
    s = make(6, caching=caching, mode="recompute")
    add(s, "b", list(range(30, 38)))
    add(s, "a", [1, 2, 3, 4, 5, 6], width=3)
    out, _ = step(s, tok("b", (0, 38)), tok("a", (0, 7), (1, 8, 0), (2, 9, 0)))
    assert seqs(out) == [("b", 0, list(range(30, 38)), 0, [0, 1], True), ("a", 0, [1, 2, 3, 4, 5, 6], 0, [2, 3], True)]
    out, _ = step(s, tok("b", (0, 39)))
    # b needs a third block (1 free); a's three decodes need two copies: a, the newest, is preempted
    assert seqs(out) == [("b", 0, [38], 8, [0, 1, 4], True)] and out.copies == []
    assert [r.request_id for r in s.waiting] == ["a"] and s.num_preemptions == 1
    out, result = step(s, tok("b", (0, 40, None, "length")))  # a cannot come back while b holds 3 blocks
    assert seqs(out) == [("b", 0, [39], 9, [0, 1, 4], True)] and result.finished == ["b"]
    return s


def test_a_preempted_request_with_three_samples_comes_back_sharing_its_prompt():
    s = _preempted_n3_request(caching=True)
    # free queue now: 5, then a's freed blocks 3, 2, then b's 4, 1, 0. a's lead hits cached block 2;
    # the siblings share it with the lead (the old admission counted that hit three times and hung).
    # Block 3 ([5, 6], shared by the three) stayed cached as a tail when the last sample let it go:
    # the lead copies it (a partial hit) and computes only its 7; the siblings recompute their own
    out, _ = step(s, tok("a", (0, 10), (1, 11), (2, 12)))
    assert seqs(out) == [
        ("a", 0, [7], 6, [2, 5], True),
        ("a", 1, [5, 6, 8], 4, [2, 4], True),
        ("a", 2, [5, 6, 9], 4, [2, 1], True),
    ]
    assert out.copies == [(3, 5)]
    assert [q.output_token_ids for q in s.requests["a"].sequences] == [[7, 10], [8, 11], [9, 12]]
    s.abort_request("a")
    assert_empty(s)


def test_without_prefix_caching_the_siblings_wait_for_the_lead_to_recompute_what_they_share():
    s = _preempted_n3_request(caching=False)
    s.max_num_batched_tokens = 3
    # free queue: 5, 3, 2, 4, 1, 0. The lead takes 5 and 3; each sibling shares 5 and takes one more
    out, _ = step(s)  # the lead recomputes its first 3 tokens
    assert seqs(out) == [("a", 0, [1, 2, 3], 0, [5, 3], False)]
    assert [q.depends_on for q in s.requests["a"].sequences] == [None, (0, 4), (0, 4)]
    out, _ = step(s)  # the lead passes the shared block: the siblings may run in the same step
    assert seqs(out) == [("a", 0, [4, 5, 6], 3, [5, 3], False)]
    out, _ = step(s, tok("a", (0, 10)))
    assert seqs(out) == [("a", 0, [7], 6, [5, 3], True), ("a", 1, [5, 6], 4, [5, 2], False)]
    out, _ = step(s, tok("a", (1, 11)))
    assert seqs(out) == [
        ("a", 0, [10], 7, [5, 3], True),
        ("a", 1, [8], 6, [5, 2], True),
        ("a", 2, [5], 4, [5, 4], False),
    ]
    s.abort_request("a")
    assert_empty(s)


def test_beams_fork_and_prune_in_one_update_forks_first():
    s = make(12)
    add(s, "a", [1, 2, 3, 4, 5], width=3)
    step(s, tok("a", (0, 6), (1, 7, 0), (2, 8, 0)))
    # beam 1 continues twice (itself and a new beam 3), beam 0 continues, beam 2 is pruned
    out, _ = step(s, tok("a", (1, 20), (3, 21, 1), (0, 22), (2, None, None, "abort")))
    req = s.requests["a"]
    assert [(q.index, q.output_token_ids, q.finish_reason) for q in req.sequences] == [
        (0, [6, 22], None), (1, [7, 20], None), (2, [8], "abort"), (3, [7, 21], None)]  # fmt: skip
    assert s.kv.block_table(SeqKey("a", 3)) == s.kv.block_table(SeqKey("a", 1))  # shares all, until it writes
    with pytest.raises(KeyError):
        s.kv.block_table(SeqKey("a", 2))  # a pruned beam's blocks are gone at once
    s.abort_request("a")
    assert_empty(s)


# ----------------------------------------------------------------------------- requests that never fit


def _grow_three_samples_to_a_full_pool(s: Scheduler) -> None:
    """wide (n = 3) fills a 4-block pool: block 0 shared, one last block each after copy-on-write."""
    step(s, tok("wide", (0, 7), (1, 8, 0), (2, 9, 0)), tok("next", (0, 1)))
    out, _ = step(s, tok("wide", (0, 10), (1, 11), (2, 12)))
    assert out.copies == [(1, 3), (1, 2)] and [x[4] for x in seqs(out)] == [[0, 3], [0, 2], [0, 1]]
    step(s, tok("wide", (0, 13), (1, 14), (2, 15)))  # the 8th tokens still fit their blocks


def test_a_request_that_outgrows_the_whole_pool_fails_alone_and_the_queue_goes_on():
    s = make(4, mode="recompute")
    add(s, "wide", [1, 2, 3, 4, 5, 6], width=3)
    add(s, "next", [9, 9])
    _grow_three_samples_to_a_full_pool(s)  # next was preempted (recompute) to make room for the copies
    assert s.num_preemptions == 1 and s.requests["next"].status is RequestStatus.WAITING
    out, result = step(s, tok("next", (0, 2, None, "length")))
    # each 9th token needs a block of its own and nothing else holds any: wide fails, next runs
    assert result.failed == {
        "wide": "request 'wide' can never fit: its 3 sequences need 3 more blocks to go on, but only 0 are "
        "free with nothing else running (the cache holds 4 blocks of 4 tokens)"
    }
    assert seqs(out) == [("next", 0, [9, 9, 1], 0, [3], True)] and result.finished == ["next"]
    assert_empty(s)


def test_a_request_that_outgrows_the_pool_fails_instead_of_swapping_out_and_in_forever():
    s = make(4, cpu=16, mode="swap")
    add(s, "wide", [1, 2, 3, 4, 5, 6], width=3)
    add(s, "next", [9, 9])
    _grow_three_samples_to_a_full_pool(s)  # next was swapped out to make room for the copies
    assert s.num_swapped_out == 1 and s.requests["next"].status is RequestStatus.SWAPPED
    out, result = step(s, tok("next", (0, 2, None, "length")))
    assert out.swap_out == [] and list(result.failed) == ["wide"] and s.num_swapped_out == 1
    assert out.swap_in == [(0, 3)] and seqs(out) == [("next", 0, [1], 2, [3], True)]
    assert result.finished == ["next"]
    assert_empty(s)


@pytest.mark.parametrize(
    ("kw", "width", "prompt_len", "reason"),
    [
        ({}, 1, 65, "the prompt has 65 tokens, more than max_model_len=64"),
        ({"max_seqs": 4}, 5, 3, "it runs 5 sequences at once, more than max_num_seqs=4"),
        ({"budget": 8}, 16, 3, "its 16 sequences decode together, more tokens than max_num_batched_tokens=8"),
    ],
)
def test_an_unschedulable_request_is_reported_by_the_next_step_and_takes_no_block(kw, width, prompt_len, reason):
    s = make(64, **kw)
    add(s, "x", [1] * prompt_len, width=width)
    add(s, "ok", [2, 2])
    out, result = step(s, tok("ok", (0, 3, None, "stop")))
    assert out.failed == [("x", f"request 'x' can never be scheduled: {reason}")]
    assert result.failed == {"x": f"request 'x' can never be scheduled: {reason}"} and result.finished == ["ok"]
    assert_empty(s)


def test_a_prompt_bigger_than_the_pool_fails_at_admission_and_the_next_one_is_admitted():
    s = make(3)
    add(s, "big", list(range(13)))  # 4 blocks
    add(s, "small", [5, 6])
    out, result = step(s, tok("small", (0, 1, None, "stop")))
    assert result.failed == {
        "big": "request 'big' can never fit: it needs 4 blocks of 4 tokens for 13 tokens, but the whole "
        "cache holds 3 blocks"
    }
    assert seqs(out) == [("small", 0, [5, 6], 0, [0], True)] and result.finished == ["small"]
    assert_empty(s)


# ----------------------------------------------------------------------------- swap


def test_swap_out_and_back_in_keeps_the_tables_shape_and_the_shared_blocks():
    s = make(5, cpu=8, mode="swap")
    add(s, "old", [1, 2, 3, 4, 5, 6, 7, 8])
    add(s, "new", [9, 9, 9, 9, 9], width=2)
    step(s, tok("old", (0, 10)), tok("new", (0, 11), (1, 12, 0)))
    out, _ = step(s, tok("old", (0, 13)))
    # old needs a third block, new needs a copy: new (the newest) goes to the CPU, its shared block once
    assert out.swap_out == [(2, 0), (3, 1)] and seqs(out) == [("old", 0, [10], 8, [0, 1, 4], True)]
    assert [r.request_id for r in s.swapped] == ["new"]
    out, result = step(s, tok("old", (0, 14, None, "length")))
    # old still fits its third block, and the two blocks new needs are free: it comes back at once
    assert out.swap_in == [(0, 3), (1, 2)] and result.finished == ["old"]
    assert [s.kv.block_table(SeqKey("new", i)) for i in (0, 1)] == [[3, 2], [3, 2]]
    assert s.requests["new"].status is RequestStatus.RUNNING
    s.abort_request("new")
    assert_empty(s)


# ----------------------------------------------------------------------------- independent samples


def _drive_samples(s: Scheduler, lengths: dict[str, int]) -> list[tuple]:
    """Run to the end as the engine would (each sample's tokens numbered from 101; the samples of
    'wide' forked at its first token): per step (scheduled, copies, swap-outs, swap-ins, parked)."""
    trace, token = [], 100
    while s.has_unfinished():
        out = s.schedule()
        s.check_invariants()
        updates: dict[str, RequestUpdate] = {}
        for sq in out.sequences:
            rid, index = sq.seq_id
            req = s.requests[rid]
            seq = req.sequences[index]
            token += 1
            done = "length" if len(seq.output_token_ids) + 1 >= lengths[rid] else None
            u = updates.setdefault(rid, RequestUpdate(rid))
            u.sequences.append(SeqUpdate(index, token, None, done))
            if req.width > 1 and len(req.sequences) == 1:
                u.sequences += [SeqUpdate(j, token, 0, done) for j in range(1, req.width)]
        s.update_from_output(out, updates)
        s.check_invariants()
        wide = s.requests.get("wide")
        parked = [q.index for q in wide.sequences if q.parked] if wide else []
        trace.append((seqs(out), out.copies, out.swap_out, out.swap_in, parked))
    return trace


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_samples_give_way_one_by_one_and_finish_where_the_gang_failed(mode):
    """The pool of test_a_request_that_outgrows_the_whole_pool_fails_alone...: 3 samples' 9th tokens
    need 3 blocks with none free. As independent samples (the engine's n > 1) the last two give way,
    the first finishes, then each comes back alone: by recompute (its prefix blocks still cached, so
    it computes only what was lost) or by swap. 'next' waits its turn behind the parked samples."""
    s = make(4, mode=mode, cpu=16 if mode == "swap" else 0)
    s.add_request(Request("wide", [1, 2, 3, 4, 5, 6], 0, width=3, independent=True))
    s.add_request(Request("next", [9, 9], 1))
    trace = _drive_samples(s, {"wide": 6, "next": 2})
    decode = [("wide", i, [t], 6, [0, 3 - i], True) for i, t in enumerate([101, 101, 101])]
    assert trace[:3] == [
        ([("wide", 0, [1, 2, 3, 4, 5, 6], 0, [0, 1], True), ("next", 0, [9, 9], 0, [2], True)], [], [], [], []),
        (decode, [(1, 3), (1, 2)], [(2, 0)] if mode == "swap" else [], [], []),  # next gives way to the copies
        ([("wide", i, [t], 7, [0, 3 - i], True) for i, t in enumerate([103, 104, 105])], [], [], [], []),
    ]
    # the 9th tokens: samples 2 then 1 give way (swapped out whole, their shared block 0 copied too)
    gave_way = [(0, 1), (1, 2), (0, 3), (2, 4)] if mode == "swap" else []
    assert trace[3] == ([("wide", 0, [106], 8, [0, 3, 1], True)], [], gave_way, [], [1, 2])
    if mode == "recompute":
        assert [t[0] for t in trace[4:]] == [
            [("wide", 0, [109], 9, [0, 3, 1], True)],
            [("wide", 0, [110], 10, [0, 3, 1], True)],  # sample 0 ends: its blocks go back
            [("wide", 1, [107], 8, [0, 2, 1], True)],  # back: its first 8 tokens are prefix hits
            [("wide", 1, [112], 9, [0, 2, 1], True)],
            [("wide", 1, [113], 10, [0, 2, 1], True)],
            # sample 2's own block was reused by sample 0, but sample 1's block 2 starts as its did
            # ([5, 6, 101]): copied into block 3, so it recomputes from token 7 only
            [("wide", 2, [105, 108], 7, [0, 3, 1], True)],
            # the copy's source was pinned for that step: next goes now, at last
            [("wide", 2, [115], 9, [0, 3, 1], True), ("next", 0, [9, 9, 102], 0, [2], True)],
            [("wide", 2, [116], 10, [0, 3, 1], True)],
        ]
        assert trace[9][1] == [(2, 3)]  # the partial hit's copy
        assert (s.num_preemptions, s.num_swapped_out) == (3, 0)
    else:
        assert [(t[0], t[3]) for t in trace[4:7]] == [
            ([("wide", 0, [109], 9, [0, 3, 1], True), ("next", 0, [102], 2, [2], True)], [(0, 2)]),  # swapped first
            ([("wide", 0, [110], 10, [0, 3, 1], True)], []),
            ([("wide", 1, [107], 8, [2, 1, 3], True)], [(3, 2), (4, 1)]),
        ]
        assert trace[9][3] == [(1, 0), (2, 3)] and len(trace) == 12
        assert (s.num_preemptions, s.num_swapped_out) == (3, 3)
    assert_empty(s)


# ----------------------------------------------------------------------------- jump-forward


def test_forced_tokens_run_as_one_chunk_after_their_sampled_token_and_are_cached_like_any():
    s = make(8)
    add(s, "a", [1, 2, 3, 4, 5, 6])  # blocks [1 2 3 4][5 6 ..
    step(s, RequestUpdate("a", [SeqUpdate(0, 7, forced=(8, 9, 10, 11))]))  # sampled 7, then 8..11 forced
    out, _ = step(s, tok("a", (0, 12)))
    # one entry computes the sampled token and the forced ones: a prefill chunk into a running sequence,
    # logits at its last token; it fills block 1 and starts block 2
    assert seqs(out) == [("a", 0, [7, 8, 9, 10, 11], 6, [0, 1, 2], True)]
    assert s.requests["a"].sequences[0].token_ids == list(range(1, 13))
    assert s.kv.stats().used_blocks == 3
    out, result = step(s, tok("a", (0, 13, None, "stop")))
    assert seqs(out) == [("a", 0, [12], 11, [0, 1, 2], True)] and result.finished == ["a"]
    add(s, "b", list(range(1, 12)) + [50])  # forced tokens were cached like any: b finds all 11 of its first
    out, _ = step(s, tok("b", (0, 51)))  # (the partial tail block copied on write, to block 3)
    assert seqs(out) == [("b", 0, [50], 11, [0, 1, 3], True)]
    s.abort_request("b")
    assert_empty(s)


def test_forced_tokens_without_a_sampled_token_fail_the_request_alone():
    s = make(8)
    add(s, "a", [1, 2, 3])
    add(s, "b", [4, 5, 6])
    _, result = step(s, RequestUpdate("a", [SeqUpdate(0, None, forced=(8,))]), tok("b", (0, 9)))
    assert "forced tokens follow a sampled token" in result.failed["a"] and "b" in s.requests
    s.abort_request("b")
    assert_empty(s)
