"""Weight-only quantized engines on the real model, where memory is scarce."""

from __future__ import annotations

import torch

from tests.engine.helpers import assert_clean, greedy, make_pressed_llm

N = 24


def test_int4_weights_of_a_q4_1_gguf_give_transformers_tokens_in_a_tiny_pool(prompts, hf_f32_greedy):
    """SmolLM2's GGUF is Q4_1 (output Q8_0): int4 (and int8 for the output) gives back the very values
    the float32 model holds, so greedy decoding stays transformers', with samples sharing blocks
    and being preempted."""
    llm = make_pressed_llm(14, "recompute", weight_dtype="int4")
    assert llm.llm_engine.kernels.endswith("int4 weights")
    chosen = [0, 2, 6]
    outs = llm.generate([prompts[i] for i in chosen], greedy(N, n=3), use_tqdm=False)
    for i, out in zip(chosen, outs, strict=True):
        assert out.error is None
        assert [c.token_ids for c in out.outputs] == [hf_f32_greedy[i][0][:N]] * 3
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_clean(llm)


def test_int8_weights_stay_close_to_float32(smollm2, prompts):
    from kvpage.models import load_model
    from tests.worker.driver import greedy_generate, make_runner

    int8 = load_model("smollm2", dtype="float32", weight_dtype="int8")
    for lm in (smollm2, int8):
        runner, mgr = make_runner(lm, 64, 16)
        lm_logits = greedy_generate(runner, mgr, prompts[:4], 1).first_logits
        if lm is smollm2:
            ref = lm_logits
    for a, b in zip(lm_logits, ref, strict=True):
        # int8 re-rounds the Q4_1 levels: the logits move, but the distribution barely does
        assert 0 < (a - b).abs().max() < 1.5
        assert torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="sum") < 0.02
