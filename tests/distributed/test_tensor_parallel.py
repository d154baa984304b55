"""Tensor parallelism (kvpage/distributed) at TP=2 on seeded dummy models: 4 query / 2 KV heads (the KV
heads split) and 4 / 1 (the KV head replicated on both ranks). One TP=2 group per model for the module,
beside a TP=1 engine of the same weights; each check compares the two."""

from __future__ import annotations

import pytest

from kvpage import LLM, SamplingParams
from kvpage.distributed.shard import Shard
from tests.distributed.dummy import dummy_config, write_dummy_model
from tests.engine.helpers import assert_clean

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    ", "In 1969, the first humans landed on the Moon."]
SHARED = "You are a careful assistant. Answer briefly and cite the page you used. " * 3
KW = dict(dtype="float32", num_kv_blocks=24, max_model_len=384, swap_space="16MiB")


@pytest.fixture(scope="module", params=[(4, 2), (4, 1)], ids=["kv-split", "kv-replicated"])
def pair(request, tmp_path_factory, smollm2):
    heads, kv = request.param
    cfg = dummy_config(heads, kv)
    path = write_dummy_model(tmp_path_factory.mktemp(f"dummy{heads}x{kv}"), cfg, smollm2.tokenizer)
    one = LLM(str(path), **KW)
    two = LLM(str(path), tensor_parallel_size=2, **KW)
    yield cfg, one, two
    two.close()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def logprobs_of(out) -> list[float]:
    c = out.outputs[0]
    return [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]


def assert_same_digests(llm: LLM) -> None:
    digests = llm.llm_engine.runner.digests()
    assert len(digests) == 2 and len(set(digests)) == 1, digests


def test_greedy_tokens_and_logprobs_match_tp1(pair):
    _, one, two = pair
    params = greedy(24, logprobs=1)
    for a, b in zip(one.generate(PROMPTS, params), two.generate(PROMPTS, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(x - y) for x, y in zip(logprobs_of(a), logprobs_of(b), strict=True)) < 1e-4
    assert_same_digests(two)
    assert_clean(one)
    assert_clean(two)


def test_prefix_hits_and_preemptions_match_tp1(pair):
    """A shared prefix and a pool too small for the batch: the same hits, the same preemptions, the
    same tokens (rank 0's one KV-cache manager decides for all ranks)."""
    _, one, two = pair
    prompts = [SHARED + f"Question {i}: what is {i} plus {i}?" for i in range(6)]
    results = []
    for llm in (one, two):
        before = llm.llm_engine.snapshot
        outs = llm.generate(prompts, greedy(40))
        after = llm.llm_engine.snapshot
        results.append(([o.outputs[0].token_ids for o in outs],
                        after.cache.prefix_hit_tokens - before.cache.prefix_hit_tokens,
                        after.num_preemptions - before.num_preemptions))  # fmt: skip
    assert results[0] == results[1]
    assert results[0][2] > 0, "the pool was meant to preempt"
    assert results[0][1] > 0, "the shared prefix was meant to hit"
    assert_same_digests(two)
    assert_clean(two)


def test_parallel_samples_and_beams_match_tp1(pair):
    _, one, two = pair
    n = SamplingParams(n=3, max_tokens=12, temperature=0.8, seed=7)
    a, b = one.generate(PROMPTS[:1], n)[0], two.generate(PROMPTS[:1], n)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    from kvpage import BeamSearchParams

    beams = BeamSearchParams(beam_width=3, max_tokens=8)
    a, b = one.beam_search(PROMPTS[1:2], beams)[0], two.beam_search(PROMPTS[1:2], beams)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert_same_digests(two)
    assert_clean(two)


def test_h2o_mass_is_summed_over_ranks(pair, monkeypatch):
    """H2O evicts by attention mass summed over all heads; rank 0 holds half of them, so its masses are
    all-reduced first: every step's mass equals TP=1's, and so do the tokens."""
    _, one, two = pair
    params = greedy(80, kv_eviction="h2o:heavy_tokens=16,recent_tokens=16")
    seen = []
    for llm in (one, two):
        runner, masses = llm.llm_engine.runner, []
        execute = runner.execute

        def capture(step, execute=execute, masses=masses):
            out = execute(step)
            masses.append([out.attention_mass[k] for k in sorted(out.attention_mass, key=str)])
            return out

        monkeypatch.setattr(runner, "execute", capture)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        monkeypatch.undo()
        seen.append((tokens, masses))
    (tokens1, mass1), (tokens2, mass2) = seen
    assert tokens1 == tokens2
    assert len(mass1) == len(mass2) and any(mass1)
    for a, b in zip(mass1, mass2, strict=True):
        flat_a, flat_b = [x for m in a for x in m], [x for m in b for x in m]
        assert len(flat_a) == len(flat_b)
        assert max((abs(x - y) for x, y in zip(flat_a, flat_b, strict=True)), default=0.0) < 1e-5
    assert_same_digests(two)
    assert_clean(two)


def test_per_rank_kv_and_weights(pair):
    cfg, one, two = pair
    replication = Shard(0, 2).kv_replication(cfg)
    assert two.llm_engine.bytes_per_block * 2 == one.llm_engine.bytes_per_block * replication
    assert two.llm_engine.kv_cache.layers[0].k.shape[1] == max(1, cfg.num_kv_heads // 2)

    def size(m, part):
        return sum(p.numel() for n, p in m.named_parameters() if part in n)

    m1, m2 = one.llm_engine.runner.model, two.llm_engine.runner.model
    for part in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        split = 2 if part != "qkv_proj" or replication == 1 else None
        if split:
            assert size(m2, part) * 2 == size(m1, part), part
    assert size(m2, "embed_tokens") == size(m1, "embed_tokens")  # replicated (tied to the lm_head)


def test_decodes_take_the_fused_path_in_halves(pair, monkeypatch):
    """A rank's pure decode steps run decode_layers' two halves per layer (compiled), all-reducing between."""
    from kvpage.worker.fused_decode import FusedDecode

    _, one, two = pair
    model = two.llm_engine.runner.model
    if not FusedDecode.applies_to(model):
        pytest.skip("the compiled CPU kernels are not what runs here")
    calls, orig = [], FusedDecode._run_sharded
    monkeypatch.setattr(FusedDecode, "_run_sharded", lambda self, *a: calls.append(1) or orig(self, *a))
    a = one.generate(PROMPTS[:2], greedy(10))
    b = two.generate(PROMPTS[:2], greedy(10))
    assert calls, "no decode step of rank 0 took the fused path"
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_refusals(pair, tmp_path, monkeypatch):
    cfg, one, _ = pair
    started = []  # the ranks this process would spawn (launch.start_group): none for a refusal

    def spawn(*args, **kwargs):
        started.append(args)
        raise RuntimeError("a rank was spawned")

    monkeypatch.setattr("kvpage.distributed.launch.subprocess.Popen", spawn)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(one.llm_engine.config.model, tensor_parallel_size=3, **KW)
    assert started == [], "refused only after starting ranks"  # (read from config.json first)
    with pytest.raises(ValueError, match="deterministic=True goes with tensor_parallel_size up to 2"):
        LLM(one.llm_engine.config.model, tensor_parallel_size=4, deterministic=True, **KW)
    with pytest.raises(ValueError, match="takes device 'cuda'"):
        LLM(one.llm_engine.config.model, tensor_parallel_size=2, device="cuda:1", **KW)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(one.llm_engine.config.model, tensor_parallel_size=0, **KW)
    with pytest.raises(ValueError, match="master_addr and master_port go together"):
        LLM(one.llm_engine.config.model, tensor_parallel_size=2, master_addr="127.0.0.1", **KW)
