"""Branches the real model does not take (no GQA, q/k/v bias, RoPE scaling, a sliding window on every
layer, Qwen3's per-head q/k norm), checked against transformers on small random models saved as Hugging
Face directories and read by our loader, and the same models written as llama.cpp writes GGUFs. The
window (8 keys) is far shorter than the prompts: every chunk and decode crosses it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvpage.core.scheduler_output import SchedulerOutput
from kvpage.models import ModelConfig, load_model
from kvpage.models.config import MoE
from tests.worker.driver import assert_pool_clean, entry, greedy_generate, make_runner

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, initializer_range=0.2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}  # fmt: skip
CASES = {
    "llama-mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2-bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    "mistral-window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8)),
    "qwen3-qk-norm": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    # a window on layer 1 only (transformers: layers from max_window_layers up slide)
    "qwen2-window": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                         sliding_window=8, max_window_layers=1)),
    # q/k/v and gate/up fused in the checkpoint, a window on every layer
    "phi3-fused": ("Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # no RoPE on layer 1 ("NoPE", every second layer here)
    # windows on layer 0, each kind its own RoPE (the global one scaled), q/k norm, GeGLU, sandwich norms
    "gemma3": ("Gemma3TextConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 100000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 500.0}})),
    # a window on layer 0, attention scores and final logits soft-capped (caps small enough to bite here)
    "gemma2": ("Gemma2Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=1.5, final_logit_softcapping=3.0)),
    # a mixture of 4 experts, 2 per token, on layer 1 (layer 0 a dense MLP), renormalized top-k weights
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                         mlp_only_layers=[0])),
    # windows and RoPE on layer 0 (layer 1 global, NoPE), parallel blocks on a LayerNorm, interleaved RoPE,
    # scaled logits
    "cohere2": ("Cohere2Config", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                      layer_types=["sliding_attention", "full_attention"], logit_scale=0.5,
                                      bos_token_id=1, eos_token_id=2)),
    # chunks of 8 and RoPE (llama3-scaled), weightless q/k norms on layer 0, layer 1 global and NoPE with its
    # queries temperature-scaled (from position 3 on); a mixture of 4 experts, 2 per token, a sigmoid router
    # and a shared expert on layer 0, a dense MLP on layer 1
    "llama4": ("Llama4TextConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=16,
                                        intermediate_size_mlp=128, no_rope_layer_interval=2, attention_chunk_size=8,
                                        num_local_experts=4, num_experts_per_tok=2, moe_layers=[0], floor_scale=4,
                                        attn_scale=0.5, rope_parameters=LLAMA3)),
    # windows on layer 0, a sink per head, biases on q/k/v/o, YaRN RoPE; on both layers 4 experts, 2 per token,
    # weighted by a softmax over their logits, with biases and a SwiGLU clamped at 0.5 (it bites here)
    "gpt-oss": ("GptOssConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                                     sliding_window=8, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.5,
                                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False, "rope_theta": 1000.0,
                                                      "original_max_position_embeddings": 16})),
    "smollm3-nope": ("SmolLM3Config", dict(num_attention_heads=4, num_key_value_heads=2, no_rope_layer_interval=2,
                                           pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "rope-linear": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0})),
    "rope-llama3": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=LLAMA3)),
}  # fmt: skip


def _saved(name: str, path: Path):
    """transformers' random model of case `name`, saved in `path` as a Hugging Face directory."""
    import transformers

    config_cls, kw = CASES[name]
    cfg = getattr(transformers, config_cls)(**(SMALL | kw))
    torch.manual_seed(0)
    model_cls = {"Gemma3TextConfig": "Gemma3ForCausalLM", "Llama4TextConfig": "Llama4ForCausalLM"}.get(
        config_cls, config_cls.replace("Config", "ForCausalLM")
    )
    hf = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # (transformers starts biases at zero: a bias left out would go unseen)
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.2)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _saved(request.param, path)
    return request.param, hf, load_model(str(path), dtype="float32")


def test_config_branches_are_read(pair):
    name, _, ours = pair
    cfg = ours.config
    assert cfg.attention_bias == (name.startswith("qwen2") or name == "gpt-oss")
    assert (cfg.attn_sinks, cfg.o_proj_bias) == ((True, True) if name == "gpt-oss" else (False, False))
    assert (cfg.num_kv_heads == cfg.num_heads) == (name == "llama-mha")
    assert cfg.tie_word_embeddings == (name in ("llama-mqa", "smollm3-nope", "gemma3", "gemma2", "cohere2"))
    assert ((cfg.rope_scaling or {}).get("rope_type")) == {
        "rope-linear": "linear",
        "rope-llama3": "llama3",
        "gemma3": "linear",
        "llama4": "llama3",
        "gpt-oss": "yarn",
    }.get(name)
    assert cfg.sliding_window == (8 if name in ("mistral-window", "qwen2-window", "phi3-fused", "gemma3", "gemma2",
                                                "cohere2", "gpt-oss")
                                  else None)  # fmt: skip
    assert cfg.rope_layers == ((True, False) if name in ("smollm3-nope", "cohere2", "llama4") else None)
    assert cfg.layer_types == {"qwen2-window": ("full_attention", "sliding_attention"),
                               "llama4": ("chunked_attention", "full_attention"),
                               "gpt-oss": ("sliding_attention", "full_attention"),
                               "gemma3": ("sliding_attention", "full_attention"),
                               "gemma2": ("sliding_attention", "full_attention"),
                               "cohere2": ("sliding_attention", "full_attention")}.get(name)  # fmt: skip
    assert (cfg.layer_norm, cfg.parallel_block, cfg.rope_interleaved, cfg.logit_scale) == (
        (True, True, True, 0.5)
        if name == "cohere2"
        else (False, False, True, None)
        if name == "llama4"
        else (False, False, False, None)
    )
    assert cfg.qk_norm == (name in ("qwen3-qk-norm", "gemma3", "qwen3-moe"))
    assert cfg.moe == {"qwen3-moe": MoE(4, 2, 32, True, (False, True)),
                       "llama4": MoE(4, 2, 16, False, (True, False), router="sigmoid",
                                     shared_intermediate_size=16),
                       "gpt-oss": MoE(4, 2, 32, router="topk_softmax", bias=True,
                                      swiglu=(1.702, 0.5))}.get(name)  # fmt: skip
    assert (cfg.attention_chunk_size, cfg.qk_l2_norm, cfg.attn_temperature) == (
        (8, True, (4.0, 0.5)) if name == "llama4" else (None, False, None)
    )
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (
        (1.5, 3.0) if name == "gemma2" else (None,) * 2
    )


@pytest.mark.same_on_every_kind  # the config's part
def test_the_config_written_back_reads_as_the_same(pair):
    """`ModelConfig.to_hf` (what save_dummy_model writes) is read back by from_hf as the same config."""
    cfg = pair[2].config
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_logits_over_a_ragged_batch_match_transformers(pair):
    """One forward: a decode, a fresh prefill and a chunk with cached context, against dense transformers."""
    _, hf, ours = pair
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (30, 21, 40)]
    with torch.no_grad():
        ref = [torch.log_softmax(hf(torch.tensor([s])).logits[0].float(), -1) for s in seqs]
    runner, mgr = make_runner(ours, 32 * len(ours.config.kv_groups), 4)
    owned = {f"s{i}": s for i, s in enumerate(seqs)}  # the test owns the tokens; the manager counts them
    # earlier steps: the first 29 tokens of seq 0 and the first 25 of seq 2 are already cached
    for i, done in ((0, 29), (2, 25)):
        mgr.allocate_slots(f"s{i}", done)
        mgr.cache_blocks(f"s{i}", seqs[i], done)
        runner.execute(SchedulerOutput([entry(mgr, f"s{i}", seqs[i][:done], 0)]))
        mgr.commit()
    step = []
    for i, done in ((0, 29), (1, 0), (2, 25)):
        mgr.allocate_slots(f"s{i}", len(seqs[i]) - done)
        mgr.cache_blocks(f"s{i}", seqs[i], len(seqs[i]))
        step.append(entry(mgr, f"s{i}", seqs[i][done:], done, prompt_logprobs=True))
    out = runner.execute(SchedulerOutput(step))
    mgr.commit()
    mgr.check_invariants(owned)
    for i, done in ((0, 29), (1, 0), (2, 25)):
        torch.testing.assert_close(out.prompt_logprobs[(f"s{i}", done)], ref[i][done:], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(torch.log_softmax(out.logits_of(f"s{i}"), -1), ref[i][-1], atol=2e-4, rtol=1e-4)
        mgr.free(f"s{i}")
    assert_pool_clean(mgr)


def test_greedy_generation_matches_transformers(pair):
    _, hf, ours = pair
    prompts = [[5, 17, 42, 8, 9, 60, 3], [11] * 19, list(range(30, 60))]
    runner, mgr = make_runner(ours, 64 * len(ours.config.kv_groups), 4)
    r = greedy_generate(runner, mgr, prompts, 10, start_steps=[0, 2, 3])
    for p, got in zip(prompts, r.tokens, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
        assert got == want
    assert_pool_clean(mgr)


def test_in_batch_prefix_hit_matches_transformers(pair):
    """A prompt planned after another in the same step hits the blocks that step is writing: its
    chunk attends to KV written earlier in the same forward (every layer writes before it attends)."""
    _, hf, ours = pair
    prompts = [list(range(30, 60)), list(range(30, 50)) + [7, 7]]  # 20 tokens (5 blocks of 4) in common
    runner, mgr = make_runner(ours, 32 * len(ours.config.kv_groups), 4)
    r = greedy_generate(runner, mgr, prompts, 6)
    assert r.hit_tokens == [0, 20]
    for p, got, first in zip(prompts, r.tokens, r.first_logits, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
            logits = hf(torch.tensor([p])).logits[0, -1].float()
        assert got == want
        torch.testing.assert_close(first, logits, atol=2e-4, rtol=1e-4)
    assert_pool_clean(mgr)


# llama.cpp's architectures for these families (its Mistral GGUFs carry no window, Qwen2's windows neither; its
# SmolLM3, Cohere 2, Llama 4 and Gemma layouts are its constants: test_families_whose_layout_llama_cpp_fixes_...,
# test_llama4_loads_..., test_gemma_loads_...)
GGUF_CASES = {"llama-mha", "llama-mqa", "qwen2-bias", "qwen3-qk-norm", "rope-linear", "phi3-fused", "qwen3-moe",
              "gpt-oss", "rope-llama3"}  # fmt: skip


@pytest.mark.same_on_every_kind  # the loader's part
def test_the_same_model_written_as_gguf_loads_the_same_model(pair, tmp_path):
    """Written as llama.cpp writes a model of its family (tensor names, metadata, LLaMA's q/k row
    order), the GGUF loads as the same config and the same weights, bit for bit."""
    name, _, ours = pair
    if name not in GGUF_CASES:
        pytest.skip(f"{name}: not written by llama.cpp's converter with what this test checks")
    from tests.models.tiny_gguf import write_gguf_of

    write_gguf_of(Path(ours.source), tmp_path / "model.gguf")
    from_gguf = load_model(str(tmp_path / "model.gguf"), dtype="float32", use_cache=False)
    for field in ("architecture", "num_heads", "num_kv_heads", "head_dim", "attention_bias", "qk_norm",
                  "tie_word_embeddings", "rope_theta", "sliding_window", "layer_types", "attn_sinks",
                  "o_proj_bias"):  # fmt: skip
        assert getattr(from_gguf.config, field) == getattr(ours.config, field), field
    # llama3's RoPE scaling is a tensor there (rope_freqs: each frequency's divisor): the same frequencies
    if name == "rope-llama3":
        assert from_gguf.config.rope_scaling["rope_type"] == "factors"
        torch.testing.assert_close(from_gguf.model.rotary.inv_freq, ours.model.rotary.inv_freq, rtol=1e-6, atol=0)
    else:
        assert from_gguf.config.rope_scaling == ours.config.rope_scaling
    # (a GGUF carries no SwiGLU clamp for gpt-oss: llama.cpp's constant, where the test's model clamps lower)
    from kvpage.models.gguf_loader import GPT_OSS_SWIGLU

    moe = ours.config.moe and dataclasses.replace(ours.config.moe, swiglu=ours.config.moe.swiglu and GPT_OSS_SWIGLU)
    assert from_gguf.config.moe == moe
    assert from_gguf.config.rms_norm_eps == pytest.approx(ours.config.rms_norm_eps, rel=1e-7)  # (a float32 there)
    a, b = dict(ours.model.named_parameters()), dict(from_gguf.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.same_on_every_kind  # the loader's part
@pytest.mark.parametrize("family", ["SmolLM3", "Cohere2"])
def test_families_whose_layout_llama_cpp_fixes_load_from_gguf(family, tmp_path):
    """llama.cpp's GGUFs of SmolLM3 and Cohere 2 carry no layer layout (its code drops RoPE on every fourth
    SmolLM3 layer, slides on three Cohere 2 layers of four): four-layer models of transformers' defaults
    load from such a GGUF as the same config and the same weights as from their directories."""
    import transformers

    from tests.models.tiny_gguf import write_gguf_of

    kw = dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = getattr(transformers, f"{family}Config")(**(SMALL | kw | {"num_hidden_layers": 4}))
    if family == "Cohere2":
        cfg.sliding_window, cfg.logit_scale = 8, 0.5
    torch.manual_seed(0)
    getattr(transformers, f"{family}ForCausalLM")(cfg).save_pretrained(tmp_path)
    write_gguf_of(tmp_path, tmp_path / "model.gguf")
    ours, from_gguf = (
        load_model(str(tmp_path), dtype="float32"),
        load_model(str(tmp_path / "model.gguf"), dtype="float32", use_cache=False),
    )
    assert ours.config.rope_layers == (True, True, True, False)
    from kvpage.models.gguf_loader import read_gguf

    read = read_gguf(tmp_path / "model.gguf")[0]  # (the file's own reading, before the conversion's config.json)
    for field in ("architecture", "rope_layers", "layer_types", "sliding_window", "layer_norm", "parallel_block",
                  "rope_interleaved", "logit_scale", "rope_theta", "tie_word_embeddings"):  # fmt: skip
        assert getattr(from_gguf.config, field) == getattr(read, field) == getattr(ours.config, field), field
    a, b = dict(ours.model.named_parameters()), dict(from_gguf.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


GEMMA_GGUF = {
    # a window on layer 0 of 2, both soft caps
    "Gemma2": dict(num_hidden_layers=2, sliding_window=8, attn_logit_softcapping=1.5, final_logit_softcapping=3.0),
    # windows on layers 0-4 of 6, the global layers' RoPE scaled (the local ones' base llama.cpp's 10,000)
    "Gemma3Text": dict(num_hidden_layers=6, sliding_window=8, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}  # fmt: skip


@pytest.mark.same_on_every_kind  # the loader's part
@pytest.mark.parametrize("family", sorted(GEMMA_GGUF))
def test_gemma_loads_from_gguf_as_llama_cpp_writes_it(family, tmp_path):
    """llama.cpp's Gemma GGUFs hold each norm as 1 + w, a SentencePiece vocabulary, the window and the caps; the
    window pattern (1 of 2, 5 of 6), the local RoPE base and the query scale are its constants. Gemma models of
    transformers' layouts (random norms) load from such a GGUF as the same config and the same weights, bit for bit,
    as from their directories."""
    import transformers

    from tests.models.tiny_gguf import write_gguf_of

    kw = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16)
    cfg = getattr(transformers, f"{family}Config")(**(SMALL | kw | GEMMA_GGUF[family]))
    torch.manual_seed(0)
    hf = getattr(transformers, f"{family.removesuffix('Text')}ForCausalLM")(cfg)
    with torch.no_grad():  # (transformers starts Gemma's norms at 0: 1 + w would be 1 everywhere)
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    write_gguf_of(tmp_path, tmp_path / "model.gguf")
    ours = load_model(str(tmp_path), dtype="float32")
    from_gguf = load_model(str(tmp_path / "model.gguf"), dtype="float32", use_cache=False)
    sliding = 5 if family == "Gemma3Text" else 1
    assert ours.config.layer_types == ("sliding_attention",) * sliding + ("full_attention",)
    for field in ("architecture", "layer_types", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
                  "query_pre_attn_scalar", "qk_norm", "sandwich_norms", "embed_scale", "hidden_act", "rope_theta",
                  "local_rope_theta", "rope_scaling", "tie_word_embeddings", "bos_token_id"):  # fmt: skip
        assert getattr(from_gguf.config, field) == getattr(ours.config, field), field
    a, b = dict(ours.model.named_parameters()), dict(from_gguf.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert from_gguf.tokenizer.eos_token_ids == [1, 5]  # <eos>, and <end_of_turn> found by its text


@pytest.mark.same_on_every_kind  # the loader's part
def test_bamba_loads_from_gguf_as_llama_cpp_writes_it(tmp_path):
    """llama.cpp writes Bamba as its granitehybrid: KV heads per layer (0 on the Mamba layers), the mixer's sizes,
    q/k rows permuted as LLaMA's (whole heads, though RoPE turns half), A as -exp(A_log), the convolution, D and
    the gated norm reshaped. It loads as the same config and weights (A_log, read back as log(-A), within float32's
    rounding: exp gives A back to an ulp); a Granite 4 hybrid (no RoPE, multipliers) is refused by name."""
    import transformers
    from gguf import GGUFReader

    from kvpage.models.gguf_loader import config_from_metadata
    from tests.models.tiny_gguf import write_gguf_of

    cfg = transformers.BambaConfig(**(SMALL | dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=4,
        mamba_n_groups=2, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)))  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.BambaForCausalLM(cfg)
    with torch.no_grad():  # (transformers starts these at constants)
        for n, p in hf.named_parameters():
            if n.endswith(("norm.weight", "dt_bias", "D", "A_log", "conv1d.bias")):
                p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    write_gguf_of(tmp_path, tmp_path / "model.gguf")
    ours = load_model(str(tmp_path), dtype="float32")
    from_gguf = load_model(str(tmp_path / "model.gguf"), dtype="float32", use_cache=False)
    for field in ("architecture", "layer_types", "mamba", "rotary_dim", "num_kv_heads", "head_dim", "rope_theta",
                  "tie_word_embeddings", "intermediate_size"):  # fmt: skip
        assert getattr(from_gguf.config, field) == getattr(ours.config, field), field
    assert ours.config.rotary_dim == 8 and ours.config.mamba.num_groups == 2
    a, b = dict(ours.model.named_parameters()), dict(from_gguf.model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith("A_log"):
            # (A is near -1 or below: an ulp of A is about 1e-7 in A_log, whatever A_log's own size)
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=2.5e-7 * a[name].exp().max().item())
            torch.testing.assert_close(-torch.exp(b[name]), -torch.exp(a[name]), rtol=2.5e-7, atol=0)
        else:
            assert torch.equal(a[name], b[name]), name
    # through the engine, from the GGUF: greedy tokens as transformers' (a prompt across two 16-token blocks)
    from kvpage import LLM, SamplingParams

    llm = LLM(str(tmp_path / "model.gguf"), dtype="float32", num_kv_blocks=16, block_size=16)
    prompt = [(i * 7) % 90 + 3 for i in range(21)]
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    with torch.no_grad():
        want = hf.eval().generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt) :].tolist()  # fmt: skip
    assert got.token_ids == want
    assert_pool_clean(llm.llm_engine.kv_manager)
    reader = GGUFReader(str(tmp_path / "model.gguf"))
    from kvpage.models.gguf_loader import _metadata

    meta = _metadata(reader)
    with pytest.raises(ValueError, match="Granite 4 hybrid.*embedding_scale"):
        config_from_metadata(meta | {"granitehybrid.embedding_scale": 12.0}, {t.name for t in reader.tensors})
    with pytest.raises(ValueError, match="Granite 4 hybrid.*no RoPE"):
        config_from_metadata(meta | {"granitehybrid.rope.scaling.finetuned": False}, {t.name for t in reader.tensors})


@pytest.mark.same_on_every_kind  # the loader's part
@pytest.mark.parametrize(("arch", "layers", "scalar"), [("gemma2", 46, 144), ("gemma2", 42, 256), ("gemma3", 62, 168),
                                                        ("gemma3", 34, 256)])  # fmt: skip
def test_gemma_query_scale_follows_llama_cpps_rule_for_27b(arch, layers, scalar):
    """A GGUF carries no query scale: llama.cpp scales by 1/sqrt(head_dim) but on the 27B models (46 / 62 layers,
    whose published query_pre_attn_scalar is hidden / heads: 144 and 168)."""
    from kvpage.models.gguf_loader import config_from_metadata

    hidden, heads, head_dim = {46: (4608, 32, 128), 62: (5376, 32, 128)}.get(layers, (2560, 8, 256))
    meta = {f"{arch}.{k}": v for k, v in dict(
        block_count=layers, embedding_length=hidden, feed_forward_length=4 * hidden, context_length=8192,
        **{"attention.head_count": heads, "attention.head_count_kv": heads // 2, "attention.key_length": head_dim,
           "attention.layer_norm_rms_epsilon": 1e-6, "attention.sliding_window": 4096}).items()}  # fmt: skip
    meta |= {"general.architecture": arch, "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>"]}
    cfg = config_from_metadata(meta, {"token_embd.weight"})
    assert cfg.query_pre_attn_scalar == scalar
    s, f = "sliding_attention", "full_attention"
    assert cfg.layer_types[:6] == ((s,) * 5 + (f,) if arch == "gemma3" else (s, f) * 3)


@pytest.mark.same_on_every_kind  # the loader's part
def test_llama4_loads_from_gguf_with_llama_cpps_constants(tmp_path):
    """llama.cpp's Llama 4 GGUFs carry the mixture's sizes and step, and llama3's RoPE as a tensor; the chunk
    (8,192), the NoPE interval (4) and the temperature (8,192, 0.1) are its constants: a four-layer model with
    transformers' defaults for those loads as the same config, frequencies and weights."""
    import transformers

    from tests.models.tiny_gguf import write_gguf_of

    cfg = transformers.Llama4TextConfig(**(SMALL | CASES["llama4"][1] | {
        "num_hidden_layers": 4, "attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1,
        "no_rope_layer_interval": 4, "moe_layers": None, "interleave_moe_layer_step": 2}))  # fmt: skip
    torch.manual_seed(0)
    transformers.Llama4ForCausalLM(cfg).save_pretrained(tmp_path)
    write_gguf_of(tmp_path, tmp_path / "model.gguf")
    ours = load_model(str(tmp_path), dtype="float32")
    from_gguf = load_model(str(tmp_path / "model.gguf"), dtype="float32", use_cache=False)
    assert ours.config.layer_types == ("chunked_attention",) * 3 + ("full_attention",)
    for field in ("architecture", "layer_types", "attention_chunk_size", "rope_layers", "rope_interleaved",
                  "qk_l2_norm", "attn_temperature", "moe", "intermediate_size", "rope_theta"):  # fmt: skip
        assert getattr(from_gguf.config, field) == getattr(ours.config, field), field
    torch.testing.assert_close(from_gguf.model.rotary.inv_freq, ours.model.rotary.inv_freq, rtol=1e-6, atol=0)
    a, b = dict(ours.model.named_parameters()), dict(from_gguf.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.same_on_every_kind  # the loader's part
def test_gpt_oss_experts_in_mxfp4_load_as_gguf_dequantizes_them(tmp_path):
    """gpt-oss's GGUFs hold the experts in MXFP4: each expert matrix loads as the gguf library dequantizes
    the file's blocks (the float model's values, rounded to MXFP4), everything else as it was."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from tests.models.tiny_gguf import write_gguf_of

    _saved("gpt-oss", tmp_path)
    write_gguf_of(tmp_path, tmp_path / "model.gguf", expert_type=Q.MXFP4)
    a = dict(load_model(str(tmp_path), dtype="float32").model.named_parameters())
    b = dict(load_model(str(tmp_path / "model.gguf"), dtype="float32", use_cache=False).model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            i = a[name].shape[1] // 2  # (gate and up: each quantized as its own tensor)
            parts = (a[name][:, :i], a[name][:, i:]) if name.endswith("gate_up_proj") else (a[name],)
            want = torch.cat([torch.from_numpy(dequantize(quantize(p.numpy(), Q.MXFP4), Q.MXFP4)) for p in parts], 1)
            assert torch.equal(b[name], want) and not torch.equal(b[name], a[name]), name
        else:
            assert torch.equal(a[name], b[name]), name


@pytest.mark.same_on_every_kind  # the loader's part
def test_fused_projections_shard_as_the_same_weights_split(tmp_path):
    """Phi-3's checkpoint fuses q/k/v and gate/up: each tensor-parallel rank's weights are those the same
    checkpoint with the projections split (every other family's names) gives it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kvpage.distributed.shard import Shard
    from kvpage.models.loader import split_fused

    fused, split = tmp_path / "fused", tmp_path / "split"
    _saved("phi3-fused", fused)
    cfg = load_model(str(fused), dtype="float32").config
    shutil.copytree(fused, split)
    weights = load_file(str(fused / "model.safetensors"))
    assert any(".qkv_proj." in n for n in weights) and any(".gate_up_proj." in n for n in weights)
    save_file({n: t.contiguous() for n, t in split_fused(weights.items(), cfg)}, str(split / "model.safetensors"))
    for rank in (0, 1):
        a, b = (dict(load_model(str(d), dtype="float32", shard=Shard(rank, 2)).model.named_parameters())
                for d in (fused, split))  # fmt: skip
        assert a["layers.0.self_attn.qkv_proj.weight"].shape[0] == (4 + 2 * 2) * 16 // 2  # this rank's heads
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dummy_weights_are_seeded_and_shaped():
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)  # fmt: skip
    a, b, c = load_model(cfg, seed=3), load_model(cfg, seed=3), load_model(cfg, seed=4)
    pa, pb, pc = (dict(m.model.named_parameters()) for m in (a, b, c))
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["layers.0.self_attn.qkv_proj.weight"], pc["layers.0.self_attn.qkv_proj.weight"])
    assert pa["layers.1.self_attn.qkv_proj.weight"].shape == (32 + 2 * 16, 32)
    assert a.tokenizer is None and a.source == "dummy"


@pytest.mark.same_on_every_kind  # the loader's part
def test_a_mixture_of_experts_refuses_what_it_does_not_split_naming_the_field(tmp_path):
    from kvpage.distributed.shard import Shard
    from kvpage.errors import ParameterError

    _saved("qwen3-moe", tmp_path)
    with pytest.raises(ParameterError) as e:
        load_model(str(tmp_path), dtype="float32", weight_dtype="int8")
    assert e.value.param == "weight_dtype" and "mixture of experts" in str(e.value)
    with pytest.raises(ParameterError) as e:
        Shard(0, 2).local_config(load_model(str(tmp_path), dtype="float32").config)
    assert e.value.param == "tensor_parallel_size"
