"""Bad input gets a 4xx naming the problem; disconnects abort; the server keeps serving; /metrics moves."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json

import httpx
import openai
import pytest

from tests.server.conftest import assert_pool_free, scrape, start_server, stop_server, wait_idle

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


def test_a_body_far_over_the_limit_gets_its_413_not_a_broken_connection(server):
    """The openai client sees the 413 that names the limit (an error, not a broken connection), with a
    Content-Length or without one."""
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="smollm2", prompt=["A " * 300_000] * 2, max_tokens=4)  # 1.2 MB
    assert e.value.status_code == 413 and e.value.body["code"] == "body_too_large"

    def chunks():  # no Content-Length: the limit is found while reading
        yield b'{"model": "smollm2", "prompt": "'
        for _ in range(64):
            yield b"A " * 8192
        yield b'"}'

    def refused(_):  # many at once (vLLM's test_healthcheck_response_time): each still reads its 413
        try:
            client.completions.create(model="smollm2", prompt=["A " * 300_000] * 2, max_tokens=4)
        except openai.APIStatusError as e:
            return e.status_code
        except openai.APIConnectionError as e:
            return repr(e)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert list(pool.map(refused, range(32))) == [413] * 32

    r = httpx.post(f"{server.base_url}/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)  # fmt: skip
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
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


VLLM_NAMES = [  # vllm:X in vLLM is kvpage:X here, same type, unit and meaning, with the model_name label
    "kvpage:num_requests_running", "kvpage:num_requests_waiting", "kvpage:kv_cache_usage_perc",
    "kvpage:prompt_tokens_total", "kvpage:generation_tokens_total", "kvpage:num_preemptions_total",
    "kvpage:prefix_cache_queries_total", "kvpage:prefix_cache_hits_total",
    "kvpage:time_to_first_token_seconds_count", "kvpage:inter_token_latency_seconds_count",
    "kvpage:e2e_request_latency_seconds_count", "kvpage:request_prompt_tokens_count",
    "kvpage:request_generation_tokens_count",
    'kvpage:request_success_total{finished_reason="stop"}', 'kvpage:request_success_total{finished_reason="length"}',
    'kvpage:request_success_total{finished_reason="abort"}',
]  # fmt: skip
OWN_NAMES = ['kvpage:kv_cache_blocks{state="free"}', 'kvpage:kv_cache_blocks{state="used"}',
             'kvpage:kv_cache_blocks{state="cached"}', 'kvpage:kv_cache_blocks{state="shared"}',
             "kvpage:prefix_cache_hit_rate", "kvpage:num_requests_swapped", 'kvpage:kv_cache_bytes{state="total"}',
             'kvpage:kv_cache_bytes{state="used"}', "kvpage:cpu_tier_hits_total", "kvpage:evicted_tokens_total",
             'kvpage:cpu_tier_blocks{state="total"}', 'kvpage:cpu_tier_blocks{state="cached"}',
             "kvpage:kv_cache_shared_of_used_ratio", "kvpage:kv_cache_shared_of_total_ratio"]  # fmt: skip


def test_metrics_have_vllms_names_and_units_and_move(server):
    text = httpx.get(f"{server.url}/metrics").text
    assert 'kvpage:num_requests_running{model_name="smollm2"}' in text  # the label vLLM's dashboards filter on
    before = scrape(server)
    for name in VLLM_NAMES + OWN_NAMES:
        assert name in before, name
    system = "You are a terse assistant. " * 8
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    for q in ("Say one.", "Say two."):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        assert r.choices[0].finish_reason == "length"
    stream = client.completions.create(model="smollm2", prompt="Hello", max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    usage_mid = None
    for i, _ in enumerate(stream):
        if i == 3:
            usage_mid = scrape(server)["kvpage:kv_cache_usage_perc"]
            stream.close()  # leave: an abort
            break
    wait_idle(server)
    after = scrape(server)
    assert 0 < usage_mid <= 1  # a fraction, as vLLM's, not a percentage
    assert after["kvpage:kv_cache_usage_perc"] == 0
    assert after["kvpage:kv_cache_shared_of_used_ratio"] == after["kvpage:kv_cache_shared_of_total_ratio"] == 0
    assert after["kvpage:generation_tokens_total"] >= before["kvpage:generation_tokens_total"] + 12
    assert after["kvpage:prompt_tokens_total"] > before["kvpage:prompt_tokens_total"]
    assert after["kvpage:time_to_first_token_seconds_count"] == before["kvpage:time_to_first_token_seconds_count"] + 3
    assert after["kvpage:inter_token_latency_seconds_count"] >= before["kvpage:inter_token_latency_seconds_count"] + 10
    assert after["kvpage:e2e_request_latency_seconds_count"] == before["kvpage:e2e_request_latency_seconds_count"] + 3
    for reason, more in (("length", 2), ("abort", 1), ("stop", 0)):
        key = f'kvpage:request_success_total{{finished_reason="{reason}"}}'
        assert after[key] == before[key] + more, reason
    assert after["kvpage:request_generation_tokens_sum"] == before["kvpage:request_generation_tokens_sum"] + 12
    assert after["kvpage:prefix_cache_hits_total"] > before["kvpage:prefix_cache_hits_total"]  # shared system prompt
    assert after["kvpage:prefix_cache_queries_total"] > after["kvpage:prefix_cache_hits_total"]
    assert after['kvpage:kv_cache_blocks{state="cached"}'] > 0
    st = server.engine.cache_stats()  # the bytes /metrics reports are the engine's (core/kv_bytes.py)
    assert after['kvpage:kv_cache_bytes{state="total"}'] == st.total_blocks * st.bytes_per_block > 0
    assert_pool_free(server)  # and the metrics hold nothing for the aborted request


def test_a_request_that_can_never_fit_fails_alone_and_the_server_keeps_answering():
    """`kvpage serve --num-kv-blocks 20`, a beam search 16 wide with max_tokens 300 (beams move as a
    gang, unlike parallel samples): that request gets a 400 naming why, while a request sent at the
    same time is served and later ones are too."""
    s = start_server(num_kv_blocks=20, max_model_len=320)
    try:
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)

        async def wide():
            try:
                await client.completions.create(model="smollm2", prompt="Once upon a time", n=16, max_tokens=300,
                                                temperature=0, extra_body={"ignore_eos": True,
                                                                           "use_beam_search": True})  # fmt: skip
            except openai.BadRequestError as e:
                return e
            return None

        async def small():
            return await client.completions.create(model="smollm2", prompt="The capital of France is",
                                                   max_tokens=8, temperature=0)  # fmt: skip

        async def both():
            return await asyncio.gather(wide(), small())

        err, ok = asyncio.run(both())
        assert err is not None and err.status_code == 400
        assert "can never fit: its 16 sequences need" in err.message
        assert ok.choices[0].finish_reason in ("length", "stop") and ok.choices[0].text
        assert httpx.get(f"{s.url}/health").status_code == 200
        again = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0).completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert again.choices[0].text == ok.choices[0].text
        assert_pool_free(s)
    finally:
        stop_server(s)


def test_a_scrape_under_load_sees_one_steps_state():
    """/metrics reads the snapshot the engine thread publishes after each step, never the pool and the
    queues while a step changes them: every scrape is self-consistent, and its counters never go back."""
    import threading

    s = start_server(num_kv_blocks=24, max_model_len=320, max_num_seqs=8)  # tight: 5 sequences need more
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        done = threading.Event()
        scrapes: list[dict] = []

        def scraper():  # a scrape each 20 ms: a loop with no pause would take the cores the steps need
            while not done.wait(0.02):
                scrapes.append(scrape(s))

        def one(i: int):
            client.completions.create(model="smollm2", prompt=f"Story {i}: once upon a time", max_tokens=64, n=2,
                                      temperature=1.0, seed=i, extra_body={"ignore_eos": True})  # fmt: skip

        t = threading.Thread(target=scraper)
        t.start()
        workers = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
        done.set()
        t.join(timeout=30)
        assert len(scrapes) >= 5
        block = 'kvpage:kv_cache_blocks{{state="{}"}}'.format
        busy = False
        for m in scrapes:
            used, free, total = m[block("used")], m[block("free")], m[block("total")]
            assert used + free == total and m[block("cached")] <= free and m[block("shared")] <= used
            assert m["kvpage:kv_cache_usage_perc"] == pytest.approx(used / total)
            queued = (
                m["kvpage:num_requests_running"] + m["kvpage:num_requests_waiting"] + m["kvpage:num_requests_swapped"]
            )
            assert queued > 0 or used == 0, m  # blocks are held only by requests the same scrape counts
            assert m["kvpage:prefix_cache_hits_total"] <= m["kvpage:prefix_cache_queries_total"]
            busy |= used > 0
        for name in ("kvpage:engine_steps_total", "kvpage:generation_tokens_total", "kvpage:prompt_tokens_total",
                     "kvpage:num_preemptions_total"):  # fmt: skip
            values = [m[name] for m in scrapes]
            assert values == sorted(values), name
        assert busy and scrapes[-1]["kvpage:num_preemptions_total"] > 0
        assert_pool_free(s)
    finally:
        stop_server(s)
