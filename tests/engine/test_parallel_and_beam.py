"""Parallel sampling and beam search on shared blocks (copy-on-write), against transformers."""

from __future__ import annotations

import pytest
import torch

from kvpage import BeamSearchParams, RequestOutput, SamplingParams
from kvpage.outputs import BeamSearchOutput, BeamSearchSequence
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
    assert st.shared_blocks == full_blocks + 1 and st.shared_of_used == 1.0
    assert st.shared_of_total == (full_blocks + 1) / st.total_blocks  # the seed's rate: of the whole pool
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


def test_beam_search_gives_vllms_sequences(llm, prompts, hf_f32):
    """vLLM's offline shape: `.sequences` are BeamSearchSequences, best first, whose tokens are the
    prompt's then the beam's, whose text decodes all of them (special tokens kept), and whose
    logprobs hold per generated token the chosen token and its row's top 2 * beam_width; the old
    RequestOutput attributes stay as they were."""
    width, tok, prompt = 3, llm.get_tokenizer(), prompts[3]
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=8))
    assert isinstance(out, BeamSearchOutput) and isinstance(out, RequestOutput)
    assert [f for f in BeamSearchSequence.__dataclass_fields__][:4] == ["tokens", "logprobs", "cum_logprob", "text"]
    assert [c.token_ids for c in out.outputs] == hf_beams(hf_f32, prompt, width, 8)
    assert len(out.sequences) == width
    for c, seq in zip(out.outputs, out.sequences, strict=True):
        assert seq.tokens == prompt + c.token_ids
        assert seq.text == tok.decode(prompt + c.token_ids, skip_special_tokens=False)
        assert seq.cum_logprob == c.cumulative_logprob and seq.finish_reason == c.finish_reason
        assert seq.logprobs is c.logprobs and len(seq.logprobs) == len(c.token_ids)
        with torch.no_grad():  # the no-cache oracle's log-softmax at every generated position
            lp = torch.log_softmax(hf_f32(torch.tensor([seq.tokens])).logits[0, len(prompt) - 1 : -1].float(), -1)
        for t, (token, pos) in enumerate(zip(c.token_ids, seq.logprobs, strict=True)):
            top = torch.topk(lp[t], 2 * width)
            assert list(pos) == [token] + [i for i in top.indices.tolist() if i != token]
            assert [pos[i].rank for i in top.indices.tolist()] == list(range(1, 2 * width + 1))
            assert pos[token].decoded_token == tok.decode([token], skip_special_tokens=False)
            for i, p in pos.items():
                assert p.logprob == pytest.approx(float(lp[t, i]), abs=1e-4)
        assert sum(pos[token].logprob for token, pos in zip(c.token_ids, seq.logprobs)) == pytest.approx(
            seq.cum_logprob, abs=1e-4
        )
    assert_clean(llm)


def blocks_of_beams(prompt: list[int], beams: list[list[int]], block_size: int) -> tuple[int, int]:
    """(distinct blocks, logical blocks) the live beams must hold between two steps, from their tokens.

    Between steps a beam has slots for all its tokens but the newest (the next step writes that
    one), so its table has ceil(written / B) blocks. Two beams agree on a prefix exactly as far
    back as their common ancestor; they hold the same block j iff they agree on every slot of it
    that is written, positions [0, min((j+1)*B, written)):

        beams forked in this step (they differ in the newest token only): every block shared,
            the partly filled last one too: the fork copied nothing;
        beams forked earlier: only blocks full of common tokens are shared; the next step after
            the fork gave every holder of the shared partial block a copy (copy-on-write) but the
            last, which wrote in place.
    """
    keys, logical = set(), 0
    for out in beams:
        tokens = prompt + out
        written = len(tokens) - 1
        num = -(-written // block_size)
        keys.update(tuple(tokens[: min((j + 1) * block_size, written)]) for j in range(num))
        logical += num
    return len(keys), logical


def test_beams_share_blocks_and_pruned_beams_free_theirs(llm, prompts):
    engine, prompt, bs = llm.llm_engine, prompts[7], 16
    engine.add_request("beam", prompt, BeamSearchParams(beam_width=4, max_tokens=40, ignore_eos=True))
    num_steps = shared_steps = 0
    while engine.has_unfinished_requests():
        (out,) = engine.step()  # the prompt is one chunk, so every step advances the beams
        num_steps += 1
        st = llm.cache_stats()
        beams = [] if out.finished else [c.token_ids for c in out.outputs]
        assert all(len(b) == num_steps for b in beams) and st.num_seqs == len(beams)
        expected_used, expected_logical = blocks_of_beams(prompt, beams, bs)
        assert (st.used_blocks, st.logical_blocks) == (expected_used, expected_logical), num_steps
        shared_steps += expected_used < expected_logical
    assert num_steps == 40 and out.finished and len(out.outputs) == 4
    assert shared_steps == 39  # the beams shared blocks at every step but the last (all freed)
    assert_clean(llm)
