"""Prompts of segments on the real model (float32): each segment's own KV reused where it stands.

What must agree with a full prefill does, token for token; what is an approximation (the KV of a
document computed without its new context) is checked where it is exact: layer 0's keys and values
depend on the token and its position only, so the copied, re-rotated slots equal a full prefill's.
"""

from __future__ import annotations

import pytest
import torch

from kvpage.core.scheduler_output import SeqKey
from kvpage.core.seq_plan import SegmentFill
from kvpage.engine.segment_prompts import SegmentedPrompt
from kvpage.tools.perplexity import english_corpus
from kvpage.worker.selective import CacheBlend
from tests.engine.helpers import assert_clean, greedy, make_llm

BS = 16


@pytest.fixture(scope="module")
def llm():
    return make_llm(num_kv_blocks=160)


@pytest.fixture(scope="module")
def docs(llm):
    ids = llm.llm_engine.tokenizer.encode(english_corpus(), add_special_tokens=False)
    # lengths that are not multiples of the block size: every segment starts inside a block
    return [ids[0:37], ids[100:171], ids[300:390], ids[500:520]]


def fresh(llm):
    assert llm.llm_engine.reset_prefix_cache()
    return llm


def fill_of(seq) -> SegmentFill:
    return seq.plan.get(SegmentFill)


def test_with_everything_recomputed_a_prompt_of_segments_is_the_full_prefill(llm, docs):
    full = [t for d in docs for t in d]
    want = fresh(llm).generate([full], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    fresh(llm)
    got = llm.generate([{"segments": docs, "recompute_blocks": 99}], greedy(8), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want
    assert got.prompt_token_ids == full
    assert_clean(llm)


def test_reused_segments_copy_their_own_kv_rotated_to_where_they_stand(llm, docs):
    eng = fresh(llm).llm_engine
    copied0 = eng.kv_manager.num_segment_tokens_copied
    eng.add_request("s", SegmentedPrompt.parse(docs, 1), greedy(4))
    while "s" not in eng.scheduler.requests:  # the two middle documents are prefilled alone first
        assert not [o for o in eng.step() if o.request_id == "s"]
    eng.step()
    seq = eng.scheduler.requests["s"].sequences[0]
    # documents at 37 (71 tokens: 4 full blocks) and 108 (90: 5); the first block of each recomputed
    assert fill_of(seq).filled == [(37 + BS, 37 + 4 * BS), (108 + BS, 108 + 5 * BS)] and fill_of(seq).exact_upto == 53
    assert eng.kv_manager.num_segment_tokens_copied - copied0 == 3 * BS + 4 * BS
    eng.add_request("f", [t for d in docs for t in d], greedy(4))
    eng.step()
    mine, full = eng.kv_manager.block_table(SeqKey("s", 0)), eng.kv_manager.block_table(SeqKey("f", 0))
    for layer, tol in ((eng.kv_cache.layers[0], 1e-4), (eng.kv_cache.layers[5], None)):
        for start, end in fill_of(seq).filled:
            for p in range(start, end):
                a = layer.k[mine[p // BS], :, p % BS], layer.v[mine[p // BS], :, p % BS]
                b = layer.k[full[p // BS], :, p % BS], layer.v[full[p // BS], :, p % BS]
                if tol is not None:  # layer 0: the rotated copy is the key at its new position
                    assert (a[0] - b[0]).abs().max() < tol and (a[1] == b[1]).all()
        if tol is None:  # deeper layers saw another context: the approximation is real
            assert (a[0] - b[0]).abs().max() > 1e-2
    while eng.has_unfinished_requests():
        eng.step()
    assert_clean(llm)


def test_selective_recompute_of_every_copied_token_is_the_full_prefill(llm, docs):
    full = [t for d in docs for t in d]
    want = fresh(llm).generate([full], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    counts = llm.llm_engine.runner.hook(CacheBlend).tokens
    before = dict(counts)
    fresh(llm)
    prompt = {"segments": docs, "recompute_blocks": 0, "recompute_ratio": 1.0}
    got = llm.generate([prompt], greedy(8), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want
    # the two middle documents' full blocks (4 + 5) were copied, then every one of their tokens recomputed
    assert counts["candidates"] - before["candidates"] == 9 * BS
    assert counts["recomputed"] - before["recomputed"] == 9 * BS
    assert_clean(llm)


def test_selective_recompute_keeps_the_tokens_whose_kv_deviated_most_at_the_check_layer(llm, docs):
    from kvpage.worker.selective import CHECK_LAYER

    eng = fresh(llm).llm_engine
    # naive reuse first: its copied slots hold the copies CacheBlend starts from, bit for bit
    eng.add_request("n", SegmentedPrompt.parse(docs, 0), greedy(6))
    while "n" not in eng.scheduler.requests:
        eng.step()
    eng.step()
    eng.add_request("c", SegmentedPrompt.parse(docs, 0, 0.25), greedy(4))
    eng.step()  # (its prompt runs beside the naive request's decode)
    seq = eng.scheduler.requests["c"].sequences[0]
    assert fill_of(seq).filled == [(37, 37 + 4 * BS), (108, 108 + 5 * BS)] and seq.num_computed == seq.num_prompt_tokens
    mine, naive = eng.kv_manager.block_table(SeqKey("c", 0)), eng.kv_manager.block_table(SeqKey("n", 0))
    slots = [p for a, b in fill_of(seq).filled for p in range(a, b)]

    def kv_at(table, layer):
        kv = eng.kv_cache.layers[layer]
        rows = torch.tensor([table[p // BS] * BS + p % BS for p in slots])
        return kv.read_slots(rows)

    def deviation(layer):
        (ka, va), (kb, vb) = kv_at(mine, layer), kv_at(naive, layer)
        return ((ka - kb) ** 2).sum((1, 2)) + ((va - vb) ** 2).sum((1, 2))

    check = deviation(CHECK_LAYER)
    assert (check > 0).all()  # every copied token was recomputed up to the check layer
    kept = deviation(CHECK_LAYER + 1) > 0
    assert int(kept.sum()) == 9 * BS // 4  # a quarter of the 144 copied tokens: past it, only those carried on ...
    for layer in (CHECK_LAYER + 2, eng.model_config.num_layers - 1):
        assert ((deviation(layer) > 0) == kept).all()  # ... the same ones in every later layer
    assert check[kept].min() > check[~kept].max()  # those whose K/V deviated most from the copy
    while eng.has_unfinished_requests():
        eng.step()
    assert_clean(llm)


def test_approximate_kv_is_never_served_as_a_prefix_hit(llm, docs):
    order = [docs[0], docs[2], docs[1], docs[3]]
    full = [t for d in order for t in d]
    want = fresh(llm).generate([full], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    fresh(llm)
    llm.generate([{"segments": order}], greedy(8), use_tqdm=False)
    again = llm.generate([full], greedy(8), use_tqdm=False)[0]
    assert again.num_cached_tokens <= len(docs[0]) + BS  # at most what was computed before the first copy
    assert again.outputs[0].token_ids == want
    assert_clean(llm)


def test_requests_sharing_a_document_wait_on_one_prefill_of_it_and_internal_requests_stay_hidden(llm, docs):
    eng = fresh(llm).llm_engine
    prompts = [{"segments": [docs[0], docs[1], q]} for q in (docs[3], docs[2][:20])]
    states0 = eng.num_prompt_tokens
    outs = llm.generate(prompts, greedy(4), use_tqdm=False)
    assert len(outs) == 2 and all(len(o.outputs[0].token_ids) == 4 for o in outs)
    # the document alone (once), then the two prompts
    assert eng.num_prompt_tokens - states0 == len(docs[1]) + sum(len(o.prompt_token_ids) for o in outs)
    assert eng.kv_manager.num_resident_blocks(docs[1]) == len(docs[1]) // BS
    assert_clean(llm)


@pytest.mark.parametrize("ratio", [0.0, 0.15])
def test_segments_under_preemption_and_abort_leave_the_pool_free(docs, ratio):
    llm = make_llm(num_kv_blocks=24, max_model_len=24 * BS, preemption_mode="recompute")
    prompts = [{"segments": [docs[0], docs[i % 3], docs[3]], "recompute_ratio": ratio} for i in range(1, 5)]
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    eng = llm.llm_engine
    eng.add_request("a", SegmentedPrompt.parse([docs[0], docs[2][::-1], docs[3]]), greedy(4))
    eng.step()
    eng.abort_request("a")  # held, waiting on its document's prefill: both go
    assert not eng.has_unfinished_requests()
    assert_clean(llm)


def test_prompt_logprobs_cover_the_computed_positions_and_equal_the_full_prefills_there(llm, docs):
    from kvpage import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    full = fresh(llm).generate([[t for d in docs for t in d]], params, use_tqdm=False)[0].prompt_logprobs
    every = llm.generate([{"segments": docs, "recompute_blocks": 99}], params, use_tqdm=False)[0].prompt_logprobs
    assert len(every) == len(full) and every[0] is None and all(p is not None for p in every[1:])
    for a, b in zip(every[1:], full[1:], strict=True):
        ((ta, la),) = [(t, lp.logprob) for t, lp in a.items()]
        assert ta in b and abs(la - b[ta].logprob) < 1e-3
    reused = llm.generate([{"segments": docs, "recompute_blocks": 1}], params, use_tqdm=False)[0].prompt_logprobs
    # a copied position has no hidden state: the token after it has no log-probability
    missing = [p for p, lp in enumerate(reused) if lp is None]
    assert missing == [0] + [p + 1 for a, b in [(53, 101), (124, 188)] for p in range(a, b)]
    assert_clean(llm)


def test_bad_segments_are_refused_naming_the_field(llm, docs):
    from kvpage import SamplingParams

    with pytest.raises(ValueError, match="segments"):
        llm.generate([{"segments": []}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"segments\[1\]"):
        llm.generate([{"segments": ["a", ""]}], use_tqdm=False)
    with pytest.raises(ValueError, match="recompute_blocks"):
        llm.generate([{"segments": ["a", "b"], "recompute_blocks": -1}], use_tqdm=False)
    with pytest.raises(ValueError, match="recompute_ratio"):
        llm.generate([{"segments": ["a", "b"], "recompute_ratio": 1.5}], use_tqdm=False)
    with pytest.raises(ValueError, match="unsupported prompt field"):
        llm.generate([{"segments": ["a"], "prompt": "b"}], use_tqdm=False)
    with pytest.raises(ValueError, match="kv_eviction: .* does not go with a prompt of segments"):
        streaming = SamplingParams(kv_eviction="streaming:sink_tokens=16,window_tokens=64")
        llm.generate([{"segments": docs}], streaming, use_tqdm=False)
    assert_clean(llm)


def test_parallel_samples_and_beams_over_a_prompt_of_segments(llm, docs):
    from kvpage import BeamSearchParams, SamplingParams

    fresh(llm)
    prompt = {"segments": [docs[0], docs[2], docs[3]]}
    (out,) = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5), use_tqdm=False)
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 6 for c in out.outputs)
    (beams,) = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6))
    assert len(beams.outputs) == 3
    # the samples and beams forked from a lead with copied KV: none of it was registered
    again = llm.generate([[t for d in (docs[0], docs[2], docs[3]) for t in d]], greedy(1), use_tqdm=False)[0]
    assert again.num_cached_tokens <= len(docs[0]) + BS
    assert_clean(llm)


def test_aborting_a_segments_own_prefill_lets_the_request_that_waits_on_it_go_on(llm, docs):
    eng = fresh(llm).llm_engine
    eng.add_request("w", SegmentedPrompt.parse([docs[0], docs[1], docs[3]]), greedy(3))
    internal = [r["request_id"] for r in eng.request_summaries() if r["request_id"] != "w"]
    assert len(internal) == 1 and "w" not in eng.scheduler.requests  # held until its document is cached
    eng.abort_request(internal[0])
    finished = []
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step() if o.finished]
    assert finished == ["w"]  # (computed in context: nothing to copy)
    (out,) = llm.generate([SegmentedPrompt.parse([docs[0], docs[1], docs[3]])], greedy(2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
    assert_clean(llm)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_copied_slots_of_a_quantized_cache_are_requantized_after_the_rotation(docs, kv_dtype):
    from kvpage.attention.kv_quant import dequantize

    llm = make_llm(num_kv_blocks=96, kv_cache_dtype=kv_dtype)
    eng = llm.llm_engine
    eng.add_request("s", SegmentedPrompt.parse(docs, 1), greedy(4))
    while "s" not in eng.scheduler.requests:
        eng.step()
    eng.step()
    seq = eng.scheduler.requests["s"].sequences[0]
    assert fill_of(seq).filled
    eng.add_request("f", [t for d in docs for t in d], greedy(4))
    eng.step()
    mine, full = eng.kv_manager.block_table(SeqKey("s", 0)), eng.kv_manager.block_table(SeqKey("f", 0))
    layer = eng.kv_cache.layers[0]  # (layer 0: context-free, so the copy must be the key at its new position)
    for start, end in fill_of(seq).filled:
        a = [(mine[p // BS], p % BS) for p in range(start, end)]
        b = [(full[p // BS], p % BS) for p in range(start, end)]
        ka = dequantize(
            layer.k[[x for x, _ in a], :, [y for _, y in a]],
            layer.k_scale[[x for x, _ in a], :, [y for _, y in a]],
            torch.float32,
        )
        kb = dequantize(
            layer.k[[x for x, _ in b], :, [y for _, y in b]],
            layer.k_scale[[x for x, _ in b], :, [y for _, y in b]],
            torch.float32,
        )
        step = layer.k_scale[[x for x, _ in b], :, [y for _, y in b]][..., None]  # one quantization step per token
        if kv_dtype == "int8":  # within two rounding steps (the source's and the copy's)
            assert ((ka - kb).abs() <= 2 * step).all()
        else:  # e4m3 keeps 3 mantissa bits: about 6% of each value, twice
            assert (ka - kb).abs().mean() <= 0.08 * kb.abs().mean(), float((ka - kb).abs().mean() / kb.abs().mean())
        va, vb = (
            layer.tensors()[1][[x for x, _ in a], :, [y for _, y in a]],
            layer.tensors()[1][[x for x, _ in b], :, [y for _, y in b]],
        )
        assert (va == vb).all()  # values copied bit for bit, scales with them
    while eng.has_unfinished_requests():
        eng.step()
    assert_clean(llm)
