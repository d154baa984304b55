"""A Mistral-style model, every layer reading a sliding window of 32 keys (16-token blocks), through the
engine: greedy tokens equal transformers' on prompts shorter and far longer than the window, while each
sequence holds no more blocks than the window needs (core/layer_window.py); prefix hits resume past
released blocks; preemption by recompute or swap in a tiny pool changes nothing. At the end, a Qwen2 with
its window on the upper layer only. Tiny random models (saved as Hugging Face directories with SmolLM2's
tokenizer)."""

from __future__ import annotations

import pytest
import torch

from kvpage import LLM, BeamSearchParams, SamplingParams
from kvpage.core.kv_spec import FULL, ChunkedLocal, SlidingWindow, max_live_blocks
from kvpage.errors import ParameterError
from kvpage.models.config import ModelConfig
from kvpage.models.loader import save_dummy_model
from kvpage.server.metrics import Metrics
from tests.engine.helpers import assert_clean

W, BS = 32, 16


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, smollm2):
    cfg = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=4096, architecture="mistral",
                      sliding_window=W, bos_token_id=1, eos_token_ids=[2])  # fmt: skip
    path = save_dummy_model(tmp_path_factory.mktemp("mistral"), cfg, smollm2.tokenizer, seed=0, scale=5.0)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.sliding_window == W and type(hf).__name__ == "MistralForCausalLM"
    return str(path), hf


def _want_beams(hf, prompt: list[int], width: int, n: int) -> list[list[int]]:
    """transformers' `width` beams of `n` new tokens each on the same weights (no length penalty)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
            length_penalty=1.0,
        )
    return out[:, len(prompt) :].tolist()


def greedy_recording(llm, max_tokens: int, record=None) -> list[list[int]]:
    """Greedy tokens of PROMPTS (ignoring EOS), the scheduler's invariants checked after every step (every
    group's tables, each window's bound) and `record(engine)` called then."""
    engine = llm.llm_engine
    step = engine.step

    def checked_step():
        out = step()
        engine.scheduler.check_invariants()
        if record is not None:
            record(engine)
        return out

    engine.step = checked_step
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        engine.step = step


def held_blocks(engine, held: list[int], groups=slice(1, None)) -> None:
    """Into `held`: how many blocks each later group's table holds for each running sequence with no slot
    ahead of its tokens (between steps: what a window, chunk or state keeps)."""
    kv = engine.kv_manager
    for req in engine.scheduler.running:
        held.extend(len(t.resident) for s in req.live_sequences if kv.num_tokens(s.key) == s.num_computed
                    for t in kv._tables_of(s.key)[groups])  # fmt: skip


def saved_hf(path, tokenizer, model_cls: str, cfg) -> tuple[str, object]:
    """transformers' own random `model_cls` of `cfg` (seed 0), saved in `path` with `tokenizer`: (path, model)."""
    import transformers

    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).eval()
    hf.save_pretrained(path)
    tokenizer.save(path)
    return str(path), hf


def _want(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


PROMPTS = [list(range(100, 120)), [(i * 7) % 5000 + 3 for i in range(90)], [(i * 13) % 3000 + 5 for i in range(61)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def test_greedy_equals_transformers_and_each_sequence_holds_only_its_window(mistral):
    path, hf = mistral
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=BS)
    kv = llm.llm_engine.kv_manager
    assert kv.layer_spec == SlidingWindow(W) and llm.llm_engine.model_config.max_position_embeddings == 4096
    held, step = [], llm.llm_engine.step

    def recording_step():
        out = step()
        held.append(max((len(kv._table(s).resident) for s in kv.seq_ids()), default=0))
        return out

    llm.llm_engine.step = recording_step
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.step = step
    assert got == [_want(hf, p, 40) for p in PROMPTS]
    # after the prompts' step, a decoding sequence holds at most ceil(32 / 16) + 1 blocks
    assert max(held[1:]) <= max_live_blocks(SlidingWindow(W), BS) == 3
    # the 90-token prompt again: its first blocks were released, the blocks of its last window are still
    # cached: 5 full blocks hit and the first 9 tokens of the next copied (all but the last token)
    again = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 89 and list(again.outputs[0].token_ids) == got[1]
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_a_tiny_pool_changes_nothing(mistral, mode):
    path, hf = mistral
    kw = dict(swap_space="16MiB") if mode == "swap" else {}
    # 8 blocks of 16: 128 tokens, less than the 90-token prompt and its 60 tokens (a window's sequence
    # holds its window only, so the pool does not cap max_model_len), and too few for all three at once
    llm = LLM(path, dtype="float32", num_kv_blocks=8, block_size=BS, preemption_mode=mode, **kw)
    assert llm.llm_engine.scheduler.max_model_len == 4096
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [_want(hf, p, 60) for p in PROMPTS]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_clean(llm)


def test_features_that_do_not_go_with_a_window_name_their_field(mistral):
    path, _ = mistral
    with pytest.raises(ParameterError) as e:
        LLM(path, dtype="float32", num_kv_blocks=16, kv_eviction="streaming:sink_tokens=4,window_tokens=28")
    assert e.value.param == "kv_eviction" and "window (or a chunk) of 32 tokens" in str(e.value)
    llm = LLM(path, dtype="float32", num_kv_blocks=16)
    with pytest.raises(ParameterError) as e:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, kv_eviction="h2o:heavy_tokens=16,recent_tokens=16"),
                     use_tqdm=False)  # fmt: skip
    assert e.value.param == "kv_eviction"
    assert_clean(llm)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, smollm2):
    """Qwen2 with its window on the upper layer only (use_sliding_window, max_window_layers=1)."""
    cfg = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=4096, architecture="qwen2",
                      attention_bias=True, sliding_window=W, layer_types=("full_attention", "sliding_attention"),
                      bos_token_id=1, eos_token_ids=[2])  # fmt: skip
    path = save_dummy_model(tmp_path_factory.mktemp("qwen2"), cfg, smollm2.tokenizer, seed=1, scale=5.0)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.config.sliding_window == W
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    return str(path), hf


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_windows_on_some_layers_equal_transformers_with_hits_and_preemption(qwen2, mode):
    """Mixed kinds: a KV-cache group per kind, each sequence a block table in each: the full layer's
    holds every block, the sliding layer's only its window's (each layer reads its own keys)."""
    path, hf = qwen2
    kw = dict(swap_space="16MiB") if mode == "swap" else {}
    # 16 blocks of 16: each sequence fits (at most 150 tokens: 10 full-attention blocks and 3 of the window's;
    # every block of both, as one group of full attention held them, would be 20), the three together do not
    llm = LLM(path, dtype="float32", num_kv_blocks=16, block_size=BS, preemption_mode=mode, **kw)
    engine, kv = llm.llm_engine, llm.llm_engine.kv_manager
    assert kv.specs == (FULL, SlidingWindow(W)) and [layer.window for layer in engine.kv_cache.layers] == [0, W]
    assert engine.kv_cache.pages[0].k.data_ptr() == engine.kv_cache.layers[1].k.data_ptr()  # one page slot
    held, step = [], engine.step

    def recording_step():
        out = step()
        held.append(max((len(kv._tables_of(s)[1].resident) for s in kv.seq_ids() if not kv.is_swapped(s)), default=0))
        return out

    engine.step = recording_step
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        engine.step = step
    assert got == [_want(hf, p, 60) for p in PROMPTS]
    assert engine.scheduler.num_preemptions > 0
    assert max(held) <= max_live_blocks(SlidingWindow(W), BS) == 3  # between steps, whatever the length
    llm.reset_prefix_cache()
    # the prompt alone (12 blocks, the window's first 4 released after its step, none reused yet), then again:
    # its 5 full blocks hit in the full group, blocks 3 and 4 in the window's (what a query at 80 reads)
    llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    again = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 80 and list(again.outputs[0].token_ids) == got[1]
    assert_clean(llm)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, smollm2):
    """Gemma 3's text model, five sliding layers to one global (transformers' own random model): six
    KV-cache groups of one layer, the global one's table holding every block, each sliding one its window's."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=W, query_pre_attn_scalar=16, max_position_embeddings=4096,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], initializer_range=0.3, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return saved_hf(tmp_path_factory.mktemp("gemma3"), smollm2.tokenizer, "Gemma3ForCausalLM", cfg)


def test_gemma3_five_windows_to_one_global_layer_equal_transformers_in_a_tiny_pool(gemma3):
    """Chunks of 32 tokens straddle the window; 40 blocks hold each sequence alone, not the three at once
    (recompute preemption); every sliding group holds at most its window's bound between steps."""
    path, hf = gemma3
    llm = LLM(path, dtype="float32", num_kv_blocks=40, block_size=BS, max_num_batched_tokens=32,
              preemption_mode="recompute")  # fmt: skip
    engine, kv = llm.llm_engine, llm.llm_engine.kv_manager
    assert kv.specs == (FULL,) + (SlidingWindow(W),) * 5 and engine.kv_cache.layer_groups == [1, 2, 3, 4, 5, 0]
    held, step = [], engine.step

    def recording_step():
        out = step()
        engine.scheduler.check_invariants()  # (every group's tables, and each window's bound: check_window)
        text = Metrics(engine, "g").render().decode()  # (/metrics: each group's blocks, from the last step)
        st = engine.snapshot.cache
        assert all(f'kvpage:kv_group_blocks{{group="{g}",kind="{k}",model_name="g"}} {float(n)}' in text
                   for g, (k, n) in enumerate(zip(st.group_kinds, st.group_blocks, strict=True)))  # fmt: skip
        metered.append(sum(st.group_blocks))
        for req in engine.scheduler.running:  # the sliding groups of a sequence with no slot ahead of its tokens
            held.extend(len(t.resident) for s in req.live_sequences if kv.num_tokens(s.key) == s.num_computed
                        for t in kv._tables_of(s.key)[1:])  # fmt: skip
        return out

    engine.step = recording_step
    metered: list[int] = []
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        engine.step = step
    assert got == [_want(hf, p, 40) for p in PROMPTS]
    assert engine.scheduler.num_preemptions > 0 and max(held) == max_live_blocks(SlidingWindow(W), BS) == 3
    assert len(engine.snapshot.cache.group_kinds) == 6 and max(metered) > 0
    # the prompt alone, then again: its 3 full blocks hit in the global group, blocks 1 and 2 in each window's
    llm.reset_prefix_cache()
    llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    again = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 48 and list(again.outputs[0].token_ids) == got[2]
    assert_clean(llm)


def test_gemma3_beams_and_samples_fork_every_group(gemma3):
    """Beams fork every group's tables and free them as beams die (transformers' beams on the same
    weights); parallel samples share the prompt's blocks in every group. (Each beam copies its shared
    last block in each of the six groups: a pool of 40 blocks holds no three beams of this prompt.)"""
    path, hf = gemma3
    llm = LLM(path, dtype="float32", num_kv_blocks=96, block_size=BS)
    (beams,) = llm.beam_search([PROMPTS[2]], BeamSearchParams(beam_width=3, max_tokens=10))
    assert [c.token_ids for c in beams.outputs] == _want_beams(hf, PROMPTS[2], 3, 10)
    samples = llm.generate([PROMPTS[1]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12), use_tqdm=False)
    assert len({tuple(c.token_ids) for c in samples[0].outputs}) > 1
    assert_clean(llm)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, smollm2):
    """Llama 4's text model (transformers' own random model): chunked attention (chunks of 32) on three
    layers of four, the fourth global and NoPE, experts on every other layer: four KV-cache groups of one
    layer, the global one's table holding every block, each chunked one its current chunk's."""
    import transformers

    cfg = transformers.Llama4TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=W, num_local_experts=4,
        interleave_moe_layer_step=2, floor_scale=16, attn_scale=0.5, max_position_embeddings=4096,
        initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return saved_hf(tmp_path_factory.mktemp("llama4"), smollm2.tokenizer, "Llama4ForCausalLM", cfg)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_llama4_chunked_layers_equal_transformers_in_a_tiny_pool(llama4, mode):
    """Chunks of 32 tokens straddled by prefill chunks of 24; 24 blocks hold one sequence, not three at once;
    each chunked group holds no more than its bound between steps, and a hit resumes inside a chunk."""
    path, hf = llama4
    kw = dict(swap_space="16MiB") if mode == "swap" else {}
    llm = LLM(path, dtype="float32", num_kv_blocks=24, block_size=BS, max_num_batched_tokens=24,
              preemption_mode=mode, **kw)  # fmt: skip
    engine, kv = llm.llm_engine, llm.llm_engine.kv_manager
    assert kv.specs == (FULL,) + (ChunkedLocal(W),) * 3 and engine.kv_cache.layer_groups == [1, 2, 3, 0]
    assert [layer.chunk for layer in engine.kv_cache.layers] == [W, W, W, 0]
    held: list[int] = []
    got = greedy_recording(llm, 40, lambda e: held_blocks(e, held))
    assert got == [_want(hf, p, 40) for p in PROMPTS]
    assert engine.scheduler.num_preemptions > 0 and max(held) == max_live_blocks(ChunkedLocal(W), BS) == 2
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # the prompt alone (90 tokens), then again: its 5 full blocks hit in the global group, block 4 in each
    # chunked one (a query at 80 reads its chunk from 64; blocks 0-3 were released behind it)
    llm.reset_prefix_cache()
    llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    again = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 80 and list(again.outputs[0].token_ids) == got[1]
    assert_clean(llm)


def test_features_of_one_kv_cache_group_name_their_field(qwen2):
    path, _ = qwen2
    for kw, field in (
        (dict(cpu_offload_memory="1MiB"), "cpu_offload_memory"),
        (dict(verify_kv_every=4), "verify_kv_every"),
    ):
        with pytest.raises(ParameterError) as e:
            LLM(path, dtype="float32", num_kv_blocks=16, **kw)
        assert e.value.param == field and "2 KV-cache groups" in str(e.value)


def test_a_prompt_longer_than_the_pool_runs_chunk_by_chunk(mistral, gemma3):
    """Layers that release behind a window take slots for the tokens a step runs, not the whole prompt
    (which every window's group would hold until its last chunk): a 300-token prompt runs in a pool of
    8 blocks of 16 on Mistral's window, and a 200-token one in 32 blocks on Gemma 3 (its global layer's
    group holds every block: 13, its five windows 3 each), where admitting it whole would take 78."""
    long = [(i * 11) % 5000 + 3 for i in range(300)]
    for (path, hf), blocks, prompt in ((mistral, 8, long), (gemma3, 32, long[:200])):
        llm = LLM(path, dtype="float32", num_kv_blocks=blocks, block_size=BS, max_num_batched_tokens=32)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        assert out.error is None and list(out.outputs[0].token_ids) == _want(hf, prompt, 8)
        assert_clean(llm)


def test_an_int8_kv_cache_quantizes_every_groups_blocks(qwen2):
    """int8 KV with a table per group: every page tensor holds int8 values and their scales, each layer's
    view the same storage; greedy tokens stay those of the float32 cache for the first steps."""
    path, _ = qwen2
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", num_kv_blocks=32, block_size=BS).generate(
        PROMPTS, params, use_tqdm=False)]  # fmt: skip
    llm = LLM(path, dtype="float32", num_kv_blocks=32, block_size=BS, kv_cache_dtype="int8")
    cache = llm.llm_engine.kv_cache
    assert all(p.k.dtype == torch.int8 and p.k_scale is not None for p in cache.pages)
    assert cache.layers[1].k_scale.data_ptr() == cache.pages[0].k_scale.data_ptr()
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert_clean(llm)
