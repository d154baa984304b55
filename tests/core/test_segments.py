"""Prompts of segments (core/segments.py) over tiny pools (4-token blocks), with exact block ids and slots.

Block ids follow the pool's LRU free queue: fresh blocks come from the head in id order; freed
blocks go to the tail. A slot is block * 4 + offset.
"""

from __future__ import annotations

import pytest

from kvpage.core import KVCacheManager
from kvpage.core.request import Request
from kvpage.core.scheduler import Scheduler
from kvpage.core.segments import Fill, plan_fills, segment_spans
from kvpage.core.seq_plan import SegmentFill, plan_of
from kvpage.core.step_update import RequestUpdate, SeqUpdate

BS = 4
DOC = list(range(100, 108))  # two full blocks


def make(num_blocks=32, budget=64, mode=None):
    kv = KVCacheManager(num_blocks, BS, watermark=0.0)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64, preemption_mode=mode)


def run(s: Scheduler, req: Request, token: int = 7):
    """Steps until `req` has produced its first token; returns the scheduler outputs."""
    outs = []
    while True:
        out = s.schedule()
        s.check_invariants()
        done = any(q.seq_id.request_id == req.request_id and q.return_logits for q in out.sequences)
        updates = {req.request_id: RequestUpdate(req.request_id, [SeqUpdate(0, token, None, "length")])} if done else {}
        s.update_from_output(out, updates)
        s.check_invariants()
        outs.append(out)
        if done:
            return outs


def cache_doc(s: Scheduler) -> None:
    """The document alone, as a prompt: its two blocks (0 and 1) registered and then free."""
    doc = Request("doc", DOC, 0)
    s.add_request(doc)
    run(s, doc)
    assert s.kv.num_resident_blocks(DOC) == 2


def fill_of(seq) -> SegmentFill:
    """The sequence's segments feature (seq_plan.py): what it copied, where its exact KV ends."""
    return seq.plan.get(SegmentFill)


def entries(out):
    return [(q.token_ids, q.num_computed, q.block_table, q.return_logits) for q in out.sequences]


def segmented(rid, segments, recompute_blocks=0, recompute_ratio=0.0) -> Request:
    prompt = [t for seg in segments for t in seg]
    spans = segment_spans([len(g) for g in segments])
    return Request(rid, prompt, 1, plan=plan_of(spans, recompute_blocks, recompute_ratio))


def test_plan_copies_a_segment_slot_by_slot_to_any_offset_with_its_position_as_the_shift():
    # segment 1 (8 tokens) at position 3, its blocks cached as 0 and 1; the prompt's table is 2..5
    fills = plan_fills([(0, 3), (3, 8), (11, 2)], [[], [0, 1], []], [2, 3, 4, 5], BS, recompute_blocks=0)
    assert fills == [Fill(3, 11, ((0, 11, 1, 3), (1, 12, 3, 3), (4, 15, 1, 3), (5, 16, 3, 3)), (0, 1))]
    # one block recomputed in the new context: only the second block is copied
    fills = plan_fills([(0, 3), (3, 8), (11, 2)], [[], [0, 1], []], [2, 3, 4, 5], BS, recompute_blocks=1)
    assert fills == [Fill(7, 11, ((4, 15, 1, 3), (5, 16, 3, 3)), (1,))]
    # block-aligned: whole blocks, one run each
    fills = plan_fills([(0, 4), (4, 8), (12, 1)], [[], [9, 8], []], [2, 3, 4, 5], BS, recompute_blocks=0)
    assert fills == [Fill(4, 12, ((36, 12, 4, 4), (32, 16, 4, 4)), (9, 8))]


def test_plan_fills_neither_the_first_nor_the_last_segment_nor_what_a_prefix_hit_holds():
    spans = [(0, 8), (8, 8), (16, 8)]
    hits = [[0, 1], [2, 3], [4, 5]]
    table = [6, 7, 8, 9, 10, 11]
    (fill,) = plan_fills(spans, hits, table, BS, recompute_blocks=0)
    assert (fill.start, fill.end, fill.source_blocks) == (8, 16, (2, 3))
    (fill,) = plan_fills(spans, hits, table, BS, recompute_blocks=0, from_pos=12)  # the prefix hit ends at 12
    assert (fill.start, fill.end, fill.runs) == (12, 16, ((12, 36, 4, 8),))
    assert plan_fills(spans, hits, table, BS, recompute_blocks=2) == []  # both blocks recomputed
    assert plan_fills(spans, [[], [2], []], table, BS, recompute_blocks=0)[0].end == 12  # one block cached
    assert plan_fills(spans, [[], [], []], table, BS, recompute_blocks=0) == []
    with pytest.raises(ValueError, match="recompute_blocks"):
        plan_fills(spans, hits, table, BS, recompute_blocks=-1)
    with pytest.raises(ValueError, match="empty"):
        segment_spans([3, 0])


def test_a_cached_segment_is_copied_at_another_position_and_only_the_rest_is_computed():
    s = make()
    cache_doc(s)
    req = segmented("s", [[1, 2, 3], DOC, [9, 9]], recompute_blocks=0)
    s.add_request(req)
    out = s.schedule()
    s.check_invariants()
    # fresh blocks 2..5 for 13 tokens; the document's blocks 0 and 1 are the sources, pinned for the step
    assert out.slot_copies == [(0, 11, 1, 3), (1, 12, 3, 3), (4, 15, 1, 3), (5, 16, 3, 3)]
    assert entries(out) == [([1, 2, 3], 0, [2, 3, 4, 5], False), ([9, 9], 11, [2, 3, 4, 5], True)]
    assert s.kv.prefix.pinned_blocks() == [0, 1]
    assert out.num_tokens == 5
    s.update_from_output(out, {"s": RequestUpdate("s", [SeqUpdate(0, 7, None, "length")])})
    s.check_invariants()
    assert s.kv.prefix.pinned_blocks() == []
    assert s.kv.num_segment_tokens_copied == 8
    # nothing approximate was registered: the document's two blocks, and block 2's first three
    # tokens (exact: computed before the copy) as a tail for partial hits
    assert len(s.kv.prefix_cache) == 3 and s.kv.pool.blocks[2].cache_key.token_ids == (1, 2, 3)
    assert s.kv.stats().used_blocks == 0


def test_recomputed_blocks_chunking_and_the_exact_prefix_that_is_registered():
    s = make(budget=4)
    cache_doc(s)
    seg0 = [1, 2, 3, 4, 5]  # a block and a token: its block is exact and registered
    req = segmented("s", [seg0, DOC, [9, 9]], recompute_blocks=1)
    s.add_request(req)
    outs = run(s, req)
    # copied: the document's second block, to positions 9..12; computed: 0..8 and 13..14, 4 tokens a step
    assert outs[0].slot_copies == [(4, 17, 3, 5), (7, 20, 1, 5)]
    assert [entries(o) for o in outs] == [
        [([1, 2, 3, 4], 0, [2, 3, 4, 5], False)],
        [([5, 100, 101, 102], 4, [2, 3, 4, 5], False)],
        [([103], 8, [2, 3, 4, 5], False), ([9, 9], 13, [2, 3, 4, 5], True)],
    ]
    assert s.kv.num_segment_tokens_copied == 4
    # registered: the document's two blocks and what the prompt computed before the first copy
    # (positions 0..8: two full blocks and a one-token tail); nothing from position 9 on
    held = sorted(b.cache_key.token_ids for b in s.kv.pool.blocks if b.cache_key is not None)
    assert held == [(1, 2, 3, 4), (5, 100, 101, 102), (100, 101, 102, 103), (103,), (104, 105, 106, 107)]
    assert s.kv.stats().used_blocks == 0


def test_selective_recompute_runs_the_copied_span_too_marked_with_its_share_and_chunked():
    s = make(budget=6)
    cache_doc(s)
    req = segmented("s", [[1, 2, 3], DOC, [9, 9]], recompute_ratio=0.25)
    s.add_request(req)
    outs = run(s, req)
    # the copies are made as without it; then the copied span 3..10 is computed as runs of its own,
    # marked with the share to keep past the check layer, 6 tokens a step
    assert outs[0].slot_copies == [(0, 11, 1, 3), (1, 12, 3, 3), (4, 15, 1, 3), (5, 16, 3, 3)]
    assert [[(q.token_ids, q.num_computed, q.select_ratio, q.return_logits) for q in o.sequences] for o in outs] == [
        [([1, 2, 3], 0, None, False), ([100, 101, 102], 3, 0.25, False)],
        [([103, 104, 105, 106, 107], 6, 0.25, False), ([9], 11, None, False)],
        [([9], 12, None, True)],
    ]
    assert fill_of(req.sequences[0]).filled == [(3, 11)] and fill_of(req.sequences[0]).exact_upto == 3
    # what was registered is what it would be without it: nothing from the first copied position on
    held = sorted(b.cache_key.token_ids for b in s.kv.pool.blocks if b.cache_key is not None)
    assert held == [(1, 2, 3), (100, 101, 102, 103), (104, 105, 106, 107)]
    assert s.kv.stats().used_blocks == 0


def test_the_sources_are_held_before_admission_allocates_leading_blocks_included():
    s = make(num_blocks=7)
    cache_doc(s)  # the document's blocks 0 and 1, free and cached
    other = Request("x", list(range(50, 70)), 1)  # five blocks taken and freed: the document's are now oldest
    s.add_request(other)
    run(s, other)
    assert [b.block_id for b in s.kv.pool.free_queue][:2] == [1, 0]
    req = segmented("s", [[1, 2, 3], DOC, [9, 9]], recompute_blocks=1)
    s.add_request(req)
    out = s.schedule()
    s.check_invariants()
    # held first, the document's blocks were not the ones the prompt's four fresh blocks evicted; the
    # first (recomputed, never copied) is held too, so that it is as recently used as the second
    assert s.kv.block_table(req.sequences[0].key) == [6, 5, 4, 3]
    assert out.slot_copies == [(4, 23, 1, 3), (5, 16, 3, 3)] and s.kv.prefix.pinned_blocks() == [0, 1]
    s.update_from_output(out, {"s": RequestUpdate("s", [SeqUpdate(0, 7, None, "length")])})
    s.check_invariants()
    assert s.kv.num_resident_blocks(DOC) == 2 and s.kv.stats().used_blocks == 0


def test_a_prompt_that_fits_only_if_its_sources_give_way_computes_in_full_instead_of_waiting():
    s = make(num_blocks=5)
    cache_doc(s)
    req = segmented("s", [[1, 2, 3], DOC, [9, 9]], recompute_blocks=0)
    s.add_request(req)
    outs = run(s, req)
    assert not any(o.slot_copies for o in outs) and s.kv.num_segment_tokens_copied == 0
    assert sum(o.num_tokens for o in outs) == 13 and s.kv.prefix.pinned_blocks() == []
    assert s.kv.stats().used_blocks == 0


def test_a_recompute_forgets_the_fills_and_fills_again_at_admission():
    s = make()
    cache_doc(s)
    req = segmented("s", [[1, 2, 3], DOC, [9, 9]], recompute_blocks=0)
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out, {"s": RequestUpdate("s", [SeqUpdate(0, 7, None, None)])})
    seq = req.sequences[0]
    assert fill_of(seq).filled == [(3, 11)] and fill_of(seq).exact_upto == 3 and seq.num_computed == 13
    s.running.remove(req)
    s._preempt(req, out)  # recompute: blocks freed, nothing approximate kept as a tail
    assert fill_of(seq).filled == [] and fill_of(seq).exact_upto is None and seq.num_computed == 0
    s.check_invariants()
    out = s.schedule()
    # its exact tail (positions 0..2, kept at the drop) is a partial hit; the document is copied again
    assert len(out.copies) == 1 and len(out.slot_copies) == 4 and fill_of(seq).filled == [(3, 11)]
    assert [e[:2] for e in entries(out)] == [([9, 9, 7], 11)]
    s.abort_request("s")
    s.update_from_output(out, {})
    s.check_invariants()
    assert s.kv.stats().used_blocks == 0


def test_after_sample_0_ended_a_recompute_fills_the_first_live_sample():
    s = make(mode="recompute")
    cache_doc(s)
    req = segmented("s", [[1, 2, 3], DOC, [9, 9]], recompute_blocks=0)
    req.width, req.independent = 2, True
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out, {"s": RequestUpdate("s", [SeqUpdate(0, 7, None, None), SeqUpdate(1, 8, 0, None)])})
    out = s.schedule()  # both samples decode; sample 0 ends
    s.update_from_output(out, {"s": RequestUpdate("s", [SeqUpdate(0, 5, None, "stop"), SeqUpdate(1, 6, None, None)])})
    s.check_invariants()
    one = req.sequences[1]
    assert fill_of(one).exact_upto == 3 and req.sequences[0].finished
    s.running.remove(req)
    s._preempt(req, out)  # recompute: sample 1 is the lead now
    out = s.schedule()
    s.check_invariants()
    assert fill_of(one).filled == [(3, 11)] and fill_of(one).exact_upto == 3 and len(out.slot_copies) == 4
    assert [e[:2] for e in entries(out)] == [([9, 9, 8, 6], 11)]
    s.update_from_output(out, {"s": RequestUpdate("s", [SeqUpdate(1, 4, None, "length")])})
    s.check_invariants()
    assert s.kv.stats().used_blocks == 0 and not s.has_unfinished()


def test_the_core_refuses_segments_with_an_evicting_policy():
    from kvpage.core.eviction.policies import StreamingLLM

    s = make()
    req = segmented("s", [[1, 2, 3], DOC, [9, 9]])
    req.eviction = StreamingLLM(sink_tokens=4, window_tokens=8)
    s.add_request(req)
    out = s.schedule()
    assert [rid for rid, _ in out.failed] == ["s"] and "segments" in out.failed[0][1]
