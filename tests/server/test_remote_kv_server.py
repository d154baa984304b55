"""Two `kvpage serve --remote-kv` servers sharing a real redis-server, talked to with the official openai
client: a system prompt one computed is served by the other from the shared tier, and its client sees it
as OpenAI's `cached_tokens`; /metrics tells what the tier did."""

from __future__ import annotations

import openai
import redis

from tests.server.conftest import assert_pool_free, scrape, start_server, stop_server


def test_a_prompt_computed_on_one_server_is_a_cached_hit_on_the_other(redis_server):
    redis.Redis.from_url(redis_server.url).flushdb()
    a, b = start_server(remote_kv=redis_server.url), start_server(remote_kv=redis_server.url)
    try:
        system = "You are the help desk of the Example Water Company. Answer in one short sentence. " * 4
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "When is my bill due?"}]

        def ask(s):
            c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
            return c.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)

        first = ask(a)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert a.engine.remote.kv_store.flush()
        second = ask(b)
        full = (first.usage.prompt_tokens - 1) // 16 * 16
        assert full >= 64 and second.usage.prompt_tokens_details.cached_tokens == full
        assert second.choices[0].message.content == first.choices[0].message.content
        mb = scrape(b)
        assert mb["kvpage:remote_kv_fetched_tokens_total"] == full and mb["kvpage:remote_kv_up"] == 1
        assert mb["kvpage:remote_kv_refused_blocks_total"] == 0
        assert scrape(a)["kvpage:remote_kv_stored_tokens_total"] >= full
        for s in (a, b):
            assert_pool_free(s)
            s.engine.kv_manager.check_invariants()
    finally:
        stop_server(a)
        stop_server(b)
