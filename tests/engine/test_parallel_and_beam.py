"""Parallel sampling and beam search on shared blocks (copy-on-write), against transformers."""

from __future__ import annotations

import pytest
import torch

from kvpage import BeamSearchParams, SamplingParams
from tests.engine.helpers import assert_clean, greedy, make_llm


@pytest.fixture(scope="module")
def llm():
    return make_llm(num_kv_blocks=96)


def test_n_samples_share_the_prompt_blocks(llm, prompts, hf_f32_greedy):
    engine = llm.llm_engine
    p = prompts[0]  # a chat prompt of 3 blocks, the last one partly filled
    full_blocks = len(p) // 16
    assert len(p) % 16
    engine.add_request("n4", p, greedy(8, n=4))
    engine.step()  # the prompt runs once; its first token is sampled 4 times and the sequence forked
    st = llm.cache_stats()
    # stored once, not four times: every prompt block is shared by the four samples
    assert st.num_seqs == 4 and st.used_blocks == full_blocks + 1 and st.logical_blocks == 4 * (full_blocks + 1)
    assert st.shared_blocks == full_blocks + 1 and st.sharing_ratio == 1.0
    engine.step()  # each sample writes its token: the shared partial block is copied for 3 of them
    st = llm.cache_stats()
    assert st.used_blocks == full_blocks + 4 and st.shared_blocks == full_blocks
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    out = outs[-1]
    # greedy samples all continue exactly like transformers: the copies carried the right KV
    assert [c.token_ids for c in out.outputs] == [hf_f32_greedy[0][0][:8]] * 4
    assert_clean(llm)


def test_seeded_samples_differ_from_each_other_but_repeat(llm, prompts):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = llm.generate([prompts[4]], params, use_tqdm=False)[0]
    b = llm.generate([prompts[4]], params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    assert_clean(llm)


def hf_beams(hf, prompt, width, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                          do_sample=False, max_new_tokens=n, eos_token_id=2, pad_token_id=2,
                          length_penalty=1.0)  # fmt: skip
    beams = []
    for row in out[:, len(prompt) :].tolist():
        beams.append(row[: row.index(2) + 1] if 2 in row else row)
    return beams


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_transformers(llm, prompts, hf_f32, width):
    chosen = [prompts[i] for i in (0, 3, 5)] + [llm.get_tokenizer().encode(
        llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Say hi."}]))]  # fmt: skip
    outs = llm.beam_search(chosen, BeamSearchParams(beam_width=width, max_tokens=16))
    eos_seen = False
    for p, out in zip(chosen, outs, strict=True):
        ours = [c.token_ids for c in out.outputs]
        assert ours == hf_beams(hf_f32, p, width, 16)
        eos_seen |= any(t[-1] == 2 for t in ours)
        scores = [c.cumulative_logprob / len(c.token_ids) for c in out.outputs]
        assert scores == sorted(scores, reverse=True)  # best first (length penalty 1.0)
    assert eos_seen  # the EOS rules were exercised too
    assert_clean(llm)


def test_beams_share_blocks_and_pruned_beams_free_theirs(llm, prompts):
    engine = llm.llm_engine
    engine.add_request("beam", prompts[7], BeamSearchParams(beam_width=4, max_tokens=40, ignore_eos=True))
    peak_logical = peak_used = 0
    while engine.has_unfinished_requests():
        engine.step()
        st = llm.cache_stats()
        assert st.num_seqs <= 4
        if st.logical_blocks > peak_logical:
            peak_logical, peak_used = st.logical_blocks, st.used_blocks
    # four independent copies would store every logical block; the beams share their common prefix
    assert peak_used < 0.6 * peak_logical
    assert_clean(llm)
