"""`LLM.verify_kv_cache`: the used blocks hold finite values, and in deterministic mode a cached
prefix recomputed from its tokens is the same bits as what the cache holds. A corrupted block is
found and named (block, holders, layer): by the range check for a NaN, by the recompute for one
changed bit."""

from __future__ import annotations

import pytest
import torch

from kvpage import LLM, SamplingParams
from tests.engine.helpers import assert_clean

SYSTEM = "You are the help desk of a library. Answer politely, in one sentence, and name the branch if asked."


def _llm(**kw) -> LLM:
    return LLM("smollm2", dtype="bfloat16", num_kv_blocks=64, **kw)


def _chats(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]))
            for q in ("When do you open?", "Can I renew a book online?")]  # fmt: skip


def _cached_block(llm: LLM) -> int:
    kv = llm.llm_engine.kv_manager
    return min(b.block_id for _, b in kv.prefix_cache.items() if b.cache_key.parent is None)  # a first block


def test_a_clean_cache_passes_and_a_changed_bit_is_named_with_its_block_and_layer():
    llm = _llm(deterministic=True)
    chats = _chats(llm)
    llm.generate(chats, SamplingParams(max_tokens=4), use_tqdm=False)
    report = llm.verify_kv_cache(sample=8)
    assert report.ok and report.blocks_checked == llm.cache_stats().cached_blocks > 0
    assert report.blocks_recomputed >= len(chats[0]) // 16  # every full block of a chain or more
    block = _cached_block(llm)
    k = llm.llm_engine.kv_cache.layers[5].k
    flat = k[block].view(-1).view(torch.int16)
    flat[7] ^= 1  # one bit of one bfloat16 key: still finite, within range
    report = llm.verify_kv_cache(sample=8)
    assert [(m.block_id, m.layer, m.check) for m in report.mismatches] == [(block, 5, "recompute")]
    assert "K differ from a recompute" in report.mismatches[0].detail
    flat[7] ^= 1
    assert llm.verify_kv_cache(sample=8).ok
    assert llm.llm_engine.num_kv_mismatches == 1
    assert_clean(llm)


def test_a_nan_is_found_by_the_range_check_naming_the_sequences_that_hold_it():
    llm = _llm()  # the default mode: no recompute (it would differ by rounding), the range check only
    engine = llm.llm_engine
    chats = _chats(llm)
    engine.add_request("a", chats[0], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("b", chats[1], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    shared = engine.kv_manager.block_table(next(s for s in engine.kv_manager.seq_ids() if s.request_id == "a"))[0]
    engine.kv_cache.layers[2].v[shared, 1, 3, 0] = float("nan")
    report = llm.verify_kv_cache()
    assert report.blocks_recomputed == 0
    assert [(m.block_id, m.layer, m.check, m.holders) for m in report.mismatches] == [
        (shared, 2, "range", ("a#0", "b#0", "b#1"))]  # fmt: skip
    assert "V of slot 3 is not a finite value" in str(report.mismatches[0])
    engine.kv_cache.layers[2].v[shared, 1, 3, 0] = 0.0
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.verify_kv_cache().ok
    assert_clean(llm)


def test_int8_levels_out_of_range_and_the_check_every_n_steps():
    llm = _llm(kv_cache_dtype="int8", deterministic=True, verify_kv_every=2)
    engine = llm.llm_engine
    llm.generate(_chats(llm), SamplingParams(max_tokens=5), use_tqdm=False)
    assert engine.num_kv_verified_blocks > 0 and engine.num_kv_mismatches == 0  # checked along the way
    assert llm.verify_kv_cache(sample=4).ok
    block = _cached_block(llm)
    engine.kv_cache.layers[0].k[block, 0, 0, 0] = -128
    report = llm.verify_kv_cache(sample=0)
    assert [(m.block_id, m.layer, m.check) for m in report.mismatches] == [(block, 0, "range")]
    with pytest.raises(ValueError, match="^sample must be an integer >= 0, got -1$"):
        llm.verify_kv_cache(sample=-1)
    with pytest.raises(ValueError, match="^verify_kv_every must be an integer >= 0"):
        _llm(verify_kv_every=-3)


def test_fp8_blocks_are_range_checked_by_their_bytes():
    llm = _llm(kv_cache_dtype="fp8")
    llm.generate(_chats(llm)[:1], SamplingParams(max_tokens=3), use_tqdm=False)
    assert llm.verify_kv_cache().ok
    block = _cached_block(llm)
    llm.llm_engine.kv_cache.layers[4].v.view(torch.uint8)[block, 2, 5, 9] = 0x7F  # e4m3fn's NaN
    report = llm.verify_kv_cache()
    assert [(m.block_id, m.layer, m.check) for m in report.mismatches] == [(block, 4, "range")]


def test_a_sequence_with_evicted_blocks_is_checked_around_its_holes():
    """A StreamingLLM sequence whose policy released blocks: the check reads the blocks it still holds
    (holes are not blocks) and a periodic check during the run finds nothing wrong."""
    llm = _llm(verify_kv_every=2, kv_eviction="streaming:sink_tokens=16,window_tokens=32")
    engine = llm.llm_engine
    engine.add_request("long", list(range(100, 200)), SamplingParams(max_tokens=40, ignore_eos=True))
    while engine.has_unfinished_requests() and not engine.kv_manager.stats().evicted_tokens:
        engine.step()
    kv = engine.kv_manager
    (seq,) = kv.seq_ids()
    table = kv.block_table(seq)
    assert None in table  # holes
    report = llm.verify_kv_cache()
    assert report.ok and report.blocks_checked == sum(b is not None for b in table) + 1  # + its sink copy
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_kv_mismatches == 0 and engine.num_kv_verified_blocks > report.blocks_checked
    assert_clean(llm)
