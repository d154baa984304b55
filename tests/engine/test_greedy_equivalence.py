"""Greedy output of the engine equals transformers' (float32), whatever the cache does underneath."""

from __future__ import annotations

import random

import pytest

from tests.engine.helpers import assert_clean, greedy, make_llm, make_pressed_llm
from tests.engine.replay import replay

N = 32


def expected(hf_f32_greedy, n=N):
    return [tokens[:n] for tokens, _ in hf_f32_greedy]


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_on_and_off(prompts, hf_f32_greedy, caching):
    llm = make_llm(enable_prefix_caching=caching)
    outs = llm.generate(prompts, greedy(N), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected(hf_f32_greedy)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    # a second round hits the cache (when on) and still gives the same tokens
    outs = llm.generate(prompts, greedy(N), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected(hf_f32_greedy)
    assert (llm.cache_stats().prefix_hit_tokens > 0) == caching
    assert_clean(llm)


def test_prompts_that_part_inside_a_cached_block(smollm2, hf_f32):
    """A system prompt that ends inside a block, then other questions: each later request copies the
    leading tokens of that block from the first one's (a partial hit) and computes only its own
    question, with transformers' tokens. One is run alone, two more in one batch."""
    from tests.conftest import hf_greedy

    tok = smollm2.tokenizer
    system = "You are a careful assistant for a shop that sells bicycles, parts and repairs. " * 3
    questions = ["What time do you open?", "Do you fix brakes?", "How much is a bell?"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                   {"role": "user", "content": q}])) for q in questions]  # fmt: skip
    common = 0
    while prompts[0][common] == prompts[1][common] == prompts[2][common]:
        common += 1
    assert common % 16, "the shared part must end inside a block for this test to mean anything"
    llm = make_llm()
    n = 12
    first = llm.generate([prompts[0]], greedy(n), use_tqdm=False)
    rest = llm.generate(prompts[1:], greedy(n), use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    for out in rest:
        assert out.num_cached_tokens >= common > common // 16 * 16  # past the last full block shared
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == [hf_greedy(hf_f32, p, n)[0] for p in prompts]
    assert_clean(llm)


def test_reference_backend_where_no_compiler_is(prompts, hf_f32_greedy):
    """The pure-torch path (attention and per-layer math), which runs where the kernels cannot be built;
    the kernels themselves are the default and run in every other test here."""
    llm = make_llm(attention_backend="torch", max_num_batched_tokens=64)
    assert llm.llm_engine.kernels == "torch reference"
    outs = llm.generate(prompts, greedy(16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected(hf_f32_greedy, 16)
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption(prompts, hf_f32_greedy, mode):
    # 12 blocks of 16 tokens for 8 requests of up to ~90 tokens each: preempted again and again
    llm = make_pressed_llm(12, mode, "64MiB", max_model_len=192)
    outs = llm.generate(prompts, greedy(N), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected(hf_f32_greedy)
    sched = llm.llm_engine.scheduler
    # exactly what the bare scheduler does when driven with the same tokens (a model-free replay)
    model = replay(llm.llm_engine, [(f"r{i}", p, 1, hf_f32_greedy[i][0][:N]) for i, p in enumerate(prompts)])
    assert sched.num_preemptions == model.num_preemptions >= 5
    assert sched.num_swapped_out == model.num_swapped_out and (model.num_swapped_out > 0) == (mode == "swap")
    assert sum(o.metrics["num_preemptions"] for o in outs) == sched.num_preemptions
    assert_clean(llm)


def test_prefill_budget_of_16_tokens(prompts, hf_f32_greedy):
    llm = make_llm(max_num_batched_tokens=16)
    outs = llm.generate(prompts, greedy(16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected(hf_f32_greedy, 16)
    assert_clean(llm)


def test_any_batch_composition_and_arrival_order(prompts, hf_f32_greedy):
    llm = make_llm(max_num_seqs=3)
    engine = llm.llm_engine
    order = list(range(len(prompts)))
    random.Random(7).shuffle(order)
    pending = {f"r{i}": i for i in order}
    results = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step, in shuffled order
            rid, i = next(iter(pending.items()))
            del pending[rid]
            engine.add_request(rid, prompts[i], greedy(N))
        for out in engine.step():
            if out.finished:
                results[int(out.request_id[1:])] = out.outputs[0].token_ids
        step += 1
    assert [results[i] for i in range(len(prompts))] == expected(hf_f32_greedy)
    assert_clean(llm)
