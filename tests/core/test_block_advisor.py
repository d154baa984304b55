"""The block-size advisor (`kvpage blocks`, `block_size="auto"`): its cost model by hand, and the engine
taking its advice."""

import json

import pytest

from kvpage import LLM
from kvpage.config import EngineConfig
from kvpage.core.block_advisor import advise, histogram_from, seed_rule, simulate
from tests.engine.helpers import assert_clean, greedy


def test_the_cost_prices_waste_blocks_and_the_unshared_prefix_by_hand():
    hist = {100: 3, 300: 1}  # 600 tokens
    c = simulate(hist, 64, block_cost=10)
    # 3 x 2 + 5 = 11 blocks = 704 slots; waste 104/704; cost 704 + 10 x 11
    assert (c.blocks, c.slots, c.shared_slots, c.cost) == (11, 704, 0, 814) and c.waste == pytest.approx(104 / 704)
    c = simulate(hist, 32, block_cost=10, shared_prefix=70, shared_count=4)
    # 4 x 3 + 10 = 22 blocks; the 70-token prefix's 2 whole blocks stored once: 3 sharers x 2 fewer blocks
    assert (c.blocks, c.slots, c.shared_slots, c.cost) == (16, 704, 192, 16 * 32 + 160)


def test_advice_is_clamped_to_the_seeds_range_and_follows_the_per_block_cost():
    hist = {1000: 10}
    assert seed_rule(1000) == 128
    assert advise(hist).best.block_size in (64, 128, 256)
    assert advise(hist, block_cost=0, min_block_size=1).best.block_size == 8  # pure waste: the largest exact size
    assert advise(hist, block_cost=1000).best.block_size == 256  # blocks very dear: the largest allowed
    assert advise({40: 5}, block_cost=0).best.block_size == 64  # never below the seed's 64 unless asked
    with pytest.raises(ValueError, match="min_block_size"):
        advise(hist, min_block_size=48)
    with pytest.raises(ValueError, match="positive"):
        advise({0: 1})


def test_histograms_come_as_mappings_strings_or_jsonl(tmp_path):
    f = tmp_path / "lengths.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [100, {"length": 100}, {"prompt_len": 250, "output_len": 50}]))
    assert (
        histogram_from(str(f)) == {100: 2, 300: 1} == histogram_from("100:2,300:1") == histogram_from({100: 2, 300: 1})
    )
    with pytest.raises(ValueError, match="LENGTH:COUNT"):
        histogram_from("lots")


def test_auto_needs_lengths_and_lengths_need_auto():
    with pytest.raises(ValueError, match="block_size='auto' needs block_size_lengths"):
        EngineConfig(block_size="auto")
    with pytest.raises(ValueError, match="block_size_lengths is read only with block_size='auto'"):
        EngineConfig(block_size=16, block_size_lengths="100:1")
    with pytest.raises(ValueError, match="block_size_lengths: .*LENGTH:COUNT"):
        EngineConfig(block_size="auto", block_size_lengths="many")
    cfg = EngineConfig(block_size="auto", block_size_lengths="1000:10", kv_cache_memory="64MiB")
    assert cfg.block_size == cfg.block_size_advice.best.block_size and cfg.num_kv_blocks is None  # memory given


def test_the_engine_takes_the_advice_block_size_and_pool_and_stays_exact(prompts, hf_f32_greedy):
    """Four prompts with 48 new tokens each: the advised block size and exactly the advised pool (every
    sequence at once, nothing spare), greedy tokens equal to transformers' at that block size."""
    four = prompts[:4]
    lengths = ",".join(f"{len(p) + 48}:1" for p in four)
    advice = advise(histogram_from(lengths))
    llm = LLM("smollm2", dtype="float32", block_size="auto", block_size_lengths=lengths, watermark=0.0)
    st = llm.cache_stats()
    assert st.block_size == advice.best.block_size >= 64 and st.total_blocks == advice.best.blocks
    outs = llm.generate(four, greedy(48), use_tqdm=False)
    for out, (expected, _) in zip(outs, hf_f32_greedy, strict=False):  # (the oracle holds 32 tokens)
        assert len(out.outputs[0].token_ids) == 48 and out.outputs[0].token_ids[:32] == expected[:32]
    assert_clean(llm)
