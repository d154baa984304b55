"""Each family beyond LLaMA through the whole engine against transformers, on a tiny random model of
transformers' own config class with SmolLM2's tokenizer: greedy tokens with prefill chunks of 24
straddling the window (32 keys, blocks of 16) in a pool that holds one sequence but not three (recompute
or swap preemption, by family), transformers' beams, and parallel samples forking every group's tables;
each run ends with the pool free and every group's invariants holding. (Mistral, Qwen2's window, Gemma 3
and Llama 4 run in test_sliding_window.py.)"""

from __future__ import annotations

import pytest
import torch

from kvpage import LLM, BeamSearchParams, SamplingParams
from tests.engine.helpers import assert_clean
from tests.engine.test_sliding_window import PROMPTS, _want, _want_beams, greedy_recording

W, BS = 32, 16
SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.3, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)  # fmt: skip
SLIDE_FULL = ["sliding_attention", "full_attention"]
# family: (config class, model class, its own keys, blocks in the pool, preemption mode)
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=W, query_pre_attn_scalar=16,
                                                         attn_logit_softcapping=5.0, final_logit_softcapping=8.0),
               16, "swap"),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(sliding_window=W, layer_types=SLIDE_FULL, logit_scale=0.5),
                16, "recompute"),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(head_dim=16, sliding_window=W, intermediate_size=32,
                                                          num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0),
                16, "swap"),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32, norm_topk_prob=True),
                  12, "recompute"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2), 12, "swap"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=W), 8, "recompute"),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_through_the_engine_equals_transformers_under_preemption_beams_and_samples(family, tmp_path, smollm2):
    import transformers

    config_cls, model_cls, own, blocks, mode = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(**(SHAPE | own))
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # (transformers starts biases at zero)
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path)
    smollm2.tokenizer.save(tmp_path)
    kw = dict(swap_space="16MiB") if mode == "swap" else {}
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=blocks, block_size=BS, max_num_batched_tokens=24,
              preemption_mode=mode, **kw)  # fmt: skip
    got = greedy_recording(llm, 24)  # (every group's invariants after every step)
    assert got == [_want(hf, p, 24) for p in PROMPTS]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    (beams,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=6))
    assert [c.token_ids for c in beams.outputs] == _want_beams(hf, PROMPTS[0], 2, 6)
    samples = llm.generate([PROMPTS[2]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)
    assert len({tuple(c.token_ids) for c in samples[0].outputs}) > 1
    assert_clean(llm)
