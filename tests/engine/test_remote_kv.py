"""The shared KV tier through the whole engine, on a real redis-server: a prompt one engine computed is
served to another from the server (the same tokens as transformers'); a damaged block is refused and
recomputed; a server that is down or dies mid-run is skipped with a warning and nothing else changes."""

from __future__ import annotations

import logging

import pytest
import redis

from tests.engine.helpers import assert_clean, greedy, make_llm
from tests.redis_server import free_port, start_redis, stop_redis

N = 12


def engine(url: str, **kw):
    return make_llm(remote_kv=url, **kw)


def tokens_of(llm, prompt, n=N) -> list[int]:
    return list(llm.generate([prompt], greedy(n), use_tqdm=False)[0].outputs[0].token_ids)


def flushed(llm) -> None:
    assert llm.llm_engine.remote.kv_store.flush()  # the writer thread sent everything


@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_a_prompt_computed_by_one_engine_is_served_to_another(prompts, hf_f32_greedy, redis_server, kind):
    redis.Redis.from_url(redis_server.url).flushdb()
    prompt = prompts[6]
    full_blocks = (len(prompt) - 1) // 16
    assert full_blocks >= 2
    a = engine(redis_server.url, kv_cache_dtype=kind)
    first = tokens_of(a, prompt)
    flushed(a)
    assert a.llm_engine.remote.stats.stored_blocks >= full_blocks
    b = engine(redis_server.url, kv_cache_dtype=kind)
    out = b.generate([prompt], greedy(N), use_tqdm=False)[0]
    assert out.num_cached_tokens == full_blocks * 16  # every full block but the last token's, from a's KV
    assert b.llm_engine.remote.stats.hit_blocks == full_blocks and b.cache_stats().tier_hit_tokens == full_blocks * 16
    assert list(out.outputs[0].token_ids) == first
    if kind == "auto":  # float32 KV: the oracle's tokens
        assert first == hf_f32_greedy[6][0][:N]
    for llm in (a, b):
        assert_clean(llm)
        llm.llm_engine.kv_manager.check_invariants()


def test_a_damaged_block_is_refused_and_recomputed(prompts, hf_f32_greedy, redis_server):
    server = redis.Redis.from_url(redis_server.url)
    server.flushdb()
    prompt = prompts[6]
    a = engine(redis_server.url)
    tokens_of(a, prompt)
    flushed(a)
    keys = sorted(server.keys(b"kvpage:*"))
    assert len(keys) >= 2
    for key in keys:  # every block's KV with one byte changed
        record = server.get(key)
        server.set(key, record[:-7] + bytes([record[-7] ^ 0x40]) + record[-6:])
    b = engine(redis_server.url)
    out = b.generate([prompt], greedy(N), use_tqdm=False)[0]
    rs = b.llm_engine.remote.stats
    assert rs.refused_blocks == 1 and rs.hit_blocks == 0 and out.num_cached_tokens == 0
    assert list(out.outputs[0].token_ids) == hf_f32_greedy[6][0][:N]
    assert_clean(b)
    server.close()


def test_a_server_that_is_down_is_skipped_with_a_warning(prompts, hf_f32_greedy, caplog):
    caplog.set_level(logging.WARNING, logger="kvpage.remote_kv")
    llm = engine(f"redis://127.0.0.1:{free_port()}")  # nothing listens there
    llm.llm_engine.remote.retry_after = 3600.0  # not asked again within this test, however slow the machine
    assert tokens_of(llm, prompts[6]) == hf_f32_greedy[6][0][:N]
    rs = llm.llm_engine.remote.stats
    assert not rs.up and rs.errors == 1 and rs.hit_blocks == 0  # asked once, then skipped at once
    assert any("unreachable" in r.getMessage() for r in caplog.records)
    assert_clean(llm)


def test_a_server_that_dies_mid_run_changes_nothing_but_the_hits(prompts, hf_f32_greedy, caplog):
    caplog.set_level(logging.WARNING, logger="kvpage.remote_kv")
    r = start_redis()
    try:
        llm = engine(r.url)
        assert tokens_of(llm, prompts[6]) == hf_f32_greedy[6][0][:N]
        flushed(llm)
        assert llm.llm_engine.remote.stats.up
    finally:
        stop_redis(r)
    llm.llm_engine.remote.retry_after = 3600.0
    assert tokens_of(llm, prompts[2]) == hf_f32_greedy[2][0][:N]  # its lookup and writes fail: skipped
    rs = llm.llm_engine.remote.stats
    assert not rs.up and rs.errors == 1  # the first failure marks it down; nothing after it waits on it
    assert any("unreachable" in rec.getMessage() for rec in caplog.records)
    assert_clean(llm)
    llm.llm_engine.kv_manager.check_invariants()
