"""State-space layers (issue 45 part 3): Bamba, Mamba-2 mixers on two layers of four and full attention
with RoPE on half of each head on the others, against transformers on its own random model (SmolLM2's
tokenizer). The mixers' state lives in their KV-cache group's blocks (core/kv_spec.RecurrentState,
models/mamba.py): a ragged batch's logits, greedy tokens under recompute and swap preemption in a pool
that holds one sequence but not three, a prefix hit resuming from a block's state snapshot, beams and
samples forking it; every run ends with the pool free and every group's invariants holding."""

from __future__ import annotations

import pytest
import torch

from kvpage import LLM, BeamSearchParams, SamplingParams
from kvpage.core.kv_spec import FULL, RecurrentState, max_live_blocks
from kvpage.core.scheduler_output import SchedulerOutput
from kvpage.errors import ParameterError
from kvpage.models import load_model
from tests.engine.helpers import assert_clean
from tests.engine.test_sliding_window import PROMPTS, _want, _want_beams, greedy_recording, held_blocks, saved_hf
from tests.worker.driver import assert_pool_clean, entry, make_runner

BS = 16


@pytest.fixture(scope="module")
def bamba(tmp_path_factory, smollm2):
    """A Bamba of 4 layers (attention on 1 and 3), whose state (4 heads of 32, 4 states, a 4-tap
    convolution over 136 channels) fits a page of 16-token blocks (2 kv heads of 16 dims)."""
    import transformers

    cfg = transformers.BambaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=4,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, initializer_range=0.3, max_position_embeddings=4096,
    )  # fmt: skip
    return saved_hf(tmp_path_factory.mktemp("bamba"), smollm2.tokenizer, "BambaForCausalLM", cfg)


def test_a_ragged_batch_equals_transformers(bamba):
    """One forward: a decode, a fresh prefill and a chunk resuming from a cached state, each against
    transformers' logits over the whole sequence."""
    path, hf = bamba
    ours = load_model(path, dtype="float32")
    assert ours.config.layer_specs == (RecurrentState(), FULL) * 2 and ours.config.rotary_dim == 8
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (35, 21, 50)]
    with torch.no_grad():
        ref = [torch.log_softmax(hf(torch.tensor([s])).logits[0].float(), -1) for s in seqs]
    runner, mgr = make_runner(ours, 40, BS)
    for i, done in ((0, 34), (2, 19)):  # earlier steps: seq 0's first 34 tokens, seq 2's first 19
        mgr.allocate_slots(f"s{i}", done)
        mgr.cache_blocks(f"s{i}", seqs[i], done)
        runner.execute(SchedulerOutput([entry(mgr, f"s{i}", seqs[i][:done], 0)]))
        mgr.commit()
    step = []
    for i, done in ((0, 34), (1, 0), (2, 19)):
        mgr.allocate_slots(f"s{i}", len(seqs[i]) - done)
        mgr.cache_blocks(f"s{i}", seqs[i], len(seqs[i]))
        step.append(entry(mgr, f"s{i}", seqs[i][done:], done, prompt_logprobs=True))
    out = runner.execute(SchedulerOutput(step))
    mgr.commit()
    mgr.check_invariants({f"s{i}": s for i, s in enumerate(seqs)})
    for i, done in ((0, 34), (1, 0), (2, 19)):
        torch.testing.assert_close(out.prompt_logprobs[(f"s{i}", done)], ref[i][done:], atol=2e-4, rtol=1e-4)
        mgr.free(f"s{i}")
    assert_pool_clean(mgr)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_hits_beams_and_samples_equal_transformers_in_a_tiny_pool(bamba, mode):
    path, hf = bamba
    kw = dict(swap_space="16MiB") if mode == "swap" else {}
    llm = LLM(path, dtype="float32", num_kv_blocks=14, block_size=BS, max_num_batched_tokens=24,
              preemption_mode=mode, **kw)  # fmt: skip
    engine, kv = llm.llm_engine, llm.llm_engine.kv_manager
    assert kv.specs == (FULL, RecurrentState())
    held: list[int] = []
    got = greedy_recording(llm, 24, lambda e: held_blocks(e, held))  # (every group's invariants too)
    assert got == [_want(hf, p, 24) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # between steps a sequence's state group holds one block, its running state, whatever its length (a
    # step adds the block it writes: max_live_blocks)
    assert engine.scheduler.num_preemptions > 0 and set(held) == {1} and max_live_blocks(RecurrentState(), BS) == 2
    # the prompt alone (90 tokens), then again: 5 full blocks hit, the state after token 80 in block 4's snapshot
    llm.reset_prefix_cache()
    llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    again = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 80 and list(again.outputs[0].token_ids) == got[1]
    (beams,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=6))
    assert [c.token_ids for c in beams.outputs] == _want_beams(hf, PROMPTS[0], 2, 6)
    samples = llm.generate([PROMPTS[2]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)
    assert len({tuple(c.token_ids) for c in samples[0].outputs}) > 1
    assert_clean(llm)


def test_what_does_not_hold_the_state_names_its_field(bamba):
    path, _ = bamba
    for kw, field, words in (
        (dict(block_size=4), "block_size", "block_size >= 16"),
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype", "state-space"),
        (dict(weight_dtype="int8"), "weight_dtype", "state-space"),
        (dict(kv_eviction="streaming"), "kv_eviction", "state-space"),
        (dict(cpu_offload_memory="1MiB"), "cpu_offload_memory", "state-space"),
        (dict(verify_kv_every=4), "verify_kv_every", "state-space"),
    ):
        with pytest.raises(ParameterError) as e:
            LLM(path, dtype="float32", num_kv_blocks=16, **kw)
        assert e.value.param == field and words in str(e.value), (field, str(e.value))


def test_a_model_of_state_space_layers_only_is_one_state_group(tmp_path, smollm2):
    """No attention layer at all (a Mamba-2 stack): one KV-cache group, of states; greedy tokens and a hit
    resuming from a snapshot equal transformers', the pool free at the end."""
    import transformers

    cfg = transformers.BambaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[], mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=4,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, initializer_range=0.3, max_position_embeddings=4096,
    )  # fmt: skip
    path, hf = saved_hf(tmp_path, smollm2.tokenizer, "BambaForCausalLM", cfg)
    llm = LLM(path, dtype="float32", num_kv_blocks=8, block_size=BS, max_num_batched_tokens=24)
    assert llm.llm_engine.kv_manager.specs == (RecurrentState(),)
    got = greedy_recording(llm, 16)
    # (transformers' generate needs an attention layer for its cache: its greedy tokens by whole forwards)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        assert list(tokens) == ids[len(prompt) :]
    llm.reset_prefix_cache()
    llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    again = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)[0]  # fmt: skip
    assert again.num_cached_tokens == 80 and list(again.outputs[0].token_ids) == got[1]
    assert_clean(llm)
