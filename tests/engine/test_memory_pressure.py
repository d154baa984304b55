"""Requests with several sequences under memory pressure, on the real model (float32, greedy).

Parallel samples and beams in tiny pools, preempted by recompute or by swap, must give transformers'
tokens; parallel samples give way one by one, so they finish wherever one sample fits; requests
arriving together share their common prefix; a request that can never fit fails alone while the
others are served; the scheduler's preemption counts equal a model-free replay's.
"""

from __future__ import annotations

import pytest

from kvpage import BeamSearchParams, SamplingParams
from tests.conftest import hf_greedy
from tests.engine.helpers import assert_clean, greedy, make_llm, make_pressed_llm
from tests.engine.replay import replay
from tests.engine.test_parallel_and_beam import hf_beams

N = 12


@pytest.mark.parametrize(
    ("blocks", "mode"), [(10, None), (14, "recompute"), (12, "swap")]
)  # fmt: skip
def test_three_requests_of_three_samples_in_a_tiny_pool(prompts, hf_f32_greedy, blocks, mode):
    # the defaults: prefix caching on, no swap space (recompute); "swap" gets a CPU pool
    llm = make_pressed_llm(blocks, mode, "32MiB")
    chosen = [0, 2, 6]  # chat prompts of 3 to 4 blocks: the three requests need ~20 blocks together
    outs = llm.generate([prompts[i] for i in chosen], greedy(N, n=3), use_tqdm=False)
    for i, out in zip(chosen, outs, strict=True):
        assert out.error is None
        assert [c.token_ids for c in out.outputs] == [hf_f32_greedy[i][0][:N]] * 3
    sched = llm.llm_engine.scheduler
    model = replay(llm.llm_engine, [(f"r{i}", prompts[i], 3, hf_f32_greedy[i][0][:N]) for i in chosen])
    assert sched.num_preemptions == model.num_preemptions > 0
    assert sched.num_swapped_out == model.num_swapped_out and (model.num_swapped_out > 0) == (mode == "swap")
    assert sum(o.metrics["num_preemptions"] for o in outs) == sched.num_preemptions
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_under_preemption_equals_transformers(prompts, hf_f32, mode):
    llm = make_pressed_llm(10, mode, "32MiB", max_model_len=160)
    chosen = [prompts[i] for i in (0, 2, 6)]
    outs = llm.beam_search(chosen, BeamSearchParams(beam_width=4, max_tokens=12))
    for p, out in zip(chosen, outs, strict=True):
        assert [c.token_ids for c in out.outputs] == hf_beams(hf_f32, p, 4, 12)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_clean(llm)


def test_six_requests_arriving_together_store_their_system_prompt_once(hf_f32):
    llm = make_llm(num_kv_blocks=128)
    tok = llm.get_tokenizer()
    system = ("You are the customer-service assistant of an online bookshop. Answer in one short sentence, "
              "politely, and always repeat the order number when the customer gives one.")  # fmt: skip
    questions = ["Where is my order 123?", "Can I return a book?", "Do you ship to Canada?",
                 "What are your hours?", "How do I reset my password?", "Do students get a discount?"]  # fmt: skip
    ids = [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                               {"role": "user", "content": q}])) for q in questions]  # fmt: skip
    engine = llm.llm_engine
    for i, p in enumerate(ids):
        engine.add_request(f"q{i}", p, greedy(6))
    outs = {o.request_id: o for o in engine.step()}  # all six prompts run in this one step

    def common(a, b):
        return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    # each prompt hits every full block it shares with an earlier one (the last token always runs)
    hits = [max((min(common(p, q), len(p) - 1) // 16 for q in ids[:i]), default=0) for i, p in enumerate(ids)]
    assert min(hits[1:]) >= 2  # the system prompt spans at least two full blocks
    st = llm.cache_stats()
    assert st.prefix_hit_tokens == 16 * sum(hits)
    assert st.used_blocks == sum(-(-len(p) // 16) for p in ids) - sum(hits)  # shared blocks stored once
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    for i, p in enumerate(ids):  # and every answer is transformers' own
        assert outs[f"q{i}"].outputs[0].token_ids == hf_greedy(hf_f32, p, 6)[0]
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_that_can_never_fit_fails_alone_and_the_others_are_served(prompts, hf_f32_greedy, mode):
    # 10 blocks: the beams' prompt fits, but not 8 beams as they grow (a gang: they move together);
    # 16 parallel samples run a few at a time (each sample alone fits) and all finish
    llm = make_pressed_llm(10, mode, "64MiB", max_model_len=160)
    engine = llm.llm_engine
    engine.add_request("wide", prompts[1], SamplingParams(n=16, temperature=0.8, seed=3, max_tokens=8, ignore_eos=True))
    engine.add_request("beams", prompts[3], BeamSearchParams(beam_width=8, max_tokens=100, ignore_eos=True))
    engine.add_request("small", prompts[4], greedy(8))
    outs = {}
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert not engine.has_unfinished_requests()  # nothing hangs, nothing livelocks between swap-out and in
    assert outs["beams"].error.startswith("request 'beams' can never fit: its 8 sequences need")
    assert outs["wide"].error is None and [len(c.token_ids) for c in outs["wide"].outputs] == [8] * 16
    assert outs["wide"].metrics["num_preemptions"] > 0
    assert outs["small"].error is None and outs["small"].outputs[0].token_ids == hf_f32_greedy[4][0][:8]
    assert_clean(llm)


@pytest.mark.parametrize("mode", [None, "recompute", "swap"])
def test_parallel_samples_finish_where_one_sample_fits_preempted_one_by_one(prompts, hf_f32, mode):
    """vLLM's outcome: n = 3 samples of 40 tokens on a 41-token prompt in 10 blocks of 16 (they need
    3 + 3 x 3 = 12 blocks at the end together). As a gang this failed after 24 tokens; as independent
    samples the newest one gives way, comes back through the prefix cache or the CPU pool, and all
    three end with transformers' tokens. The counts are those of a model-free replay."""
    prompt = (prompts[7] * 2)[:41]
    llm = make_pressed_llm(10, mode, "32MiB")
    out = llm.generate([prompt], greedy(40, n=3), use_tqdm=False)[0]
    expected = hf_greedy(hf_f32, prompt, 40)[0]
    assert out.error is None and [c.token_ids for c in out.outputs] == [expected] * 3
    sched = llm.llm_engine.scheduler
    model = replay(llm.llm_engine, [("r0", prompt, 3, expected)])
    assert sched.num_preemptions == model.num_preemptions == out.metrics["num_preemptions"] > 0
    assert sched.num_swapped_out == model.num_swapped_out and (model.num_swapped_out > 0) == (mode == "swap")
    assert_clean(llm)


def test_impossible_parameters_are_refused_up_front_naming_the_field(prompts):
    llm = make_llm(num_kv_blocks=32, max_num_batched_tokens=8, max_num_seqs=6)
    engine = llm.llm_engine
    cases = [
        (SamplingParams(n=16), "n=16: its 16 sequences run in the same step, but max_num_seqs=6"),
        (SamplingParams(n=6, max_tokens=4), None),
        (BeamSearchParams(beam_width=7), "beam_width=7: its 7 sequences run in the same step, but max_num_seqs=6"),
    ]
    for params, message in cases:
        if message is None:
            continue
        with pytest.raises(ValueError) as e:
            engine.add_request("x", prompts[0], params)
        assert str(e.value) == message
    llm2 = make_llm(num_kv_blocks=32, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match=r"^n=16: .* but max_num_batched_tokens=8$"):
        llm2.llm_engine.add_request("x", prompts[0], SamplingParams(n=16))
    nan = float("nan")
    for kw, field in [(dict(temperature=nan), "temperature"), (dict(prompt_logprobs=100000), "prompt_logprobs"),
                      (dict(frequency_penalty=nan), "frequency_penalty")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    assert_clean(llm)
    assert_clean(llm2)


def test_an_extreme_length_penalty_runs_and_leaves_the_batch_alone(prompts, hf_f32_greedy):
    llm = make_llm(num_kv_blocks=64)
    engine = llm.llm_engine
    engine.add_request("beam", prompts[3], BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=1e308))
    engine.add_request("plain", prompts[3], greedy(6))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["beam"].error is None and len(outs["beam"].outputs) == 2
    assert outs["plain"].outputs[0].token_ids == hf_f32_greedy[3][0][:6]
    assert_clean(llm)
