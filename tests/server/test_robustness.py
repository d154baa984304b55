"""Bad input gets a 4xx naming the problem; disconnects abort; the server keeps serving; /metrics moves."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import assert_pool_free, wait_idle

OK_CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/v1/chat/completions", b'{"model": "smollm2", "messages": [', 400, "not valid JSON"),
        ("/v1/chat/completions", {**OK_CHAT, "model": "gpt-9"}, 404, "gpt-9"),
        ("/v1/completions", {"model": "smollm2", "prompt": "word " * 2000, "max_tokens": 4}, 400, "context length"),
        ("/v1/completions", {"model": "smollm2", "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
        ("/v1/chat/completions", {**OK_CHAT, "n": 1000}, 400, "n"),
        ("/v1/chat/completions", {**OK_CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/chat/completions", {**OK_CHAT, "temperature": -1}, 400, "temperature"),
        ("/v1/chat/completions", {"model": "smollm2", "max_tokens": 4}, 400, "messages"),
        ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ("/v1/completions", {"model": "smollm2", "prompt": [10**9], "max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"model": "smollm2", "prompt": "x" * 100_000}, 413, "larger than"),
    ],
)
def test_bad_input_gets_a_clear_4xx_and_the_server_goes_on(server, path, body, status, needle):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    ok = httpx.post(f"{server.url}/v1/chat/completions", json=OK_CHAT, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    assert_pool_free(server)


def test_client_disconnect_mid_stream_frees_its_blocks(server):
    body = {"model": "smollm2", "prompt": "Count slowly from one to one thousand:", "max_tokens": 500,
            "stream": True, "extra": 1, "ignore_eos": True}  # fmt: skip
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines += 1
            if lines >= 3:
                break  # leave mid-stream
        assert server.engine.cache_stats().used_blocks > 0
    wait_idle(server, timeout=30)
    assert server.engine.num_generation_tokens  # it did run
    assert_pool_free(server)


def metric_values(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) + "}"
                                 if sample.labels else "")  # fmt: skip
            out[key] = sample.value
    return out


def test_metrics_parse_and_move(server):
    before = metric_values(httpx.get(f"{server.url}/metrics").text)
    for name in ("kvpage:kv_cache_usage_perc", "kvpage:kv_cache_blocks{state=free}",
                 "kvpage:kv_cache_blocks{state=used}",
                 "kvpage:kv_cache_blocks{state=cached}", "kvpage:kv_cache_blocks{state=shared}",
                 "kvpage:prefix_cache_hit_rate", "kvpage:num_requests_running", "kvpage:num_requests_waiting",
                 "kvpage:num_requests_swapped", "kvpage:num_preemptions_total", "kvpage:prompt_tokens_total",
                 "kvpage:generation_tokens_total", "kvpage:time_to_first_token_seconds_count",
                 "kvpage:inter_token_latency_seconds_count"):  # fmt: skip
        assert name in before, name
    system = "You are a terse assistant. " * 8
    for q in ("Say one.", "Say two."):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "smollm2", "messages": msgs,
                                                                 "max_tokens": 6}, timeout=60)  # fmt: skip
        assert r.status_code == 200
    after = metric_values(httpx.get(f"{server.url}/metrics").text)
    assert after["kvpage:generation_tokens_total"] > before["kvpage:generation_tokens_total"]
    assert after["kvpage:prompt_tokens_total"] > before["kvpage:prompt_tokens_total"]
    assert after["kvpage:time_to_first_token_seconds_count"] >= before["kvpage:time_to_first_token_seconds_count"] + 2
    assert after["kvpage:inter_token_latency_seconds_count"] > before["kvpage:inter_token_latency_seconds_count"]
    assert after["kvpage:prefix_cache_hits_total"] > before["kvpage:prefix_cache_hits_total"]  # shared system prompt
    assert after["kvpage:kv_cache_blocks{state=cached}"] > 0
    assert_pool_free(server)
