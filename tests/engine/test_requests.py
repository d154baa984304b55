"""Aborts, bad input and impossible requests: clear errors, nothing lost, nothing leaked."""

from __future__ import annotations

import pytest

from kvpage import LLM, BeamSearchParams, SamplingParams
from tests.engine.helpers import assert_clean, greedy, make_llm


@pytest.fixture(scope="module")
def llm():
    return make_llm(num_kv_blocks=16, max_model_len=256)


def test_abort_in_the_middle_frees_everything(llm, prompts, hf_f32_greedy):
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"a{i}", prompts[i], greedy(40, n=2 if i == 1 else 1))
    for _ in range(4):
        engine.step()
    assert llm.cache_stats().used_blocks > 0
    engine.abort_request("a1")
    engine.abort_request("no-such-request")  # ignored
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"a0", "a2"}
    assert done["a0"].outputs[0].token_ids[:32] == hf_f32_greedy[0][0][:32]
    engine.add_request("late", prompts[3], greedy(30))
    engine.step()
    engine.abort_request("late")
    assert_clean(llm)


def test_an_impossible_request_fails_alone(llm, prompts, hf_f32_greedy):
    too_long = list(range(100, 400))  # 300 tokens > max_model_len 256
    outs = llm.generate([prompts[3], too_long, prompts[4]], greedy(8), use_tqdm=False)
    assert outs[1].finished and "max_model_len" in outs[1].error and outs[1].outputs[0].finish_reason == "abort"
    assert outs[0].error is None and outs[0].outputs[0].token_ids == hf_f32_greedy[3][0][:8]
    assert outs[2].outputs[0].token_ids == hf_f32_greedy[4][0][:8]
    assert_clean(llm)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.2), "top_p"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(logprobs=-1), "logprobs"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(best_of_everything=3), "best_of_everything"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_invalid_engine_and_request_input_take_no_blocks(llm, prompts):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM("smollm2", colour="blue")
    with pytest.raises(ValueError, match="block_size"):
        LLM("smollm2", block_size=12)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM("smollm2", kv_cache_memory="lots")
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(num_kv_blocks=4, max_model_len=1000)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([""], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**7]], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"unsupported prompt field\(s\) \['multi_modal_data'\]"):
        llm.generate({"prompt": "hi", "multi_modal_data": {}}, greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of 'prompt' and 'prompt_token_ids'"):
        llm.generate([{"prompt": "hi", "prompt_token_ids": [1]}], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 2 entries for 3 prompts"):
        llm.generate(prompts[:3], [greedy(2), greedy(2)], use_tqdm=False)
    with pytest.raises(ValueError, match="already in use"):
        llm.llm_engine.add_request("dup", prompts[0], greedy(2))
        llm.llm_engine.add_request("dup", prompts[0], greedy(2))
    llm.llm_engine.abort_request("dup")
    assert_clean(llm)


def test_prompts_as_vllm_dicts(llm, prompts):
    """vLLM's TextPrompt / TokensPrompt dicts give what their plain forms give."""
    text = "The capital of France is"
    plain = llm.generate([text, prompts[0]], greedy(4), use_tqdm=False)
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": prompts[0]}], greedy(4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[1].prompt_token_ids == prompts[0]
    one = llm.generate({"prompt_token_ids": prompts[0]}, greedy(4), use_tqdm=False)
    assert one[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    assert_clean(llm)
