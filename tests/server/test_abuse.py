"""What an abusive or careless client can do, and what it cannot: abandoned requests end, one
request cannot hold the batch, keys are checked first, half-sent bodies time out, tenants'
prefix caches stay apart."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
import openai
import pytest

from kvpage.config import EngineConfig
from kvpage.engine.llm_engine import LLMEngine
from kvpage.server.app import build_app
from tests.server.conftest import assert_pool_free, scrape, start_server, stop_server, wait_idle

LONG = {"model": "smollm2", "max_tokens": 800, "min_tokens": 800, "ignore_eos": True}


def test_a_non_streaming_request_whose_client_left_is_aborted(server):
    before = scrape(server)
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=1.0)
    for i in range(4):
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(model="smollm2", prompt=f"Story number {i}:", max_tokens=800,
                                      extra_body={"min_tokens": 800, "ignore_eos": True})  # fmt: skip
    wait_idle(server, timeout=20)  # 4 x 800 tokens would take far longer than this
    after = scrape(server)
    assert after["kvpage:generation_tokens_total"] - before["kvpage:generation_tokens_total"] < 4 * 800
    key = 'kvpage:request_success_total{finished_reason="abort"}'
    assert after[key] == before[key] + 4
    assert_pool_free(server)


def test_prompts_per_request_are_capped_and_all_abort_when_the_client_leaves():
    s = start_server(app_kw={"max_prompts_per_request": 8})
    try:
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "smollm2", "prompt": ["hi"] * 9}, timeout=30)
        assert r.status_code == 400 and "at most 8 prompts" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "prompt"
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.url}/v1/completions", json={**LONG, "prompt": [f"Tale {i}:" for i in range(8)]}, timeout=1)
        wait_idle(s, timeout=20)
        assert s.engine.num_generation_tokens < 8 * 800
        assert_pool_free(s)
    finally:
        stop_server(s)


def test_one_request_with_many_prompts_does_not_hold_up_the_next():
    """A batch of at most 4 sequences: a 12-prompt request runs two at a time, so a request sent
    after it is scheduled beside it and answered long before it ends (without the window it waited
    behind all 12)."""
    s = start_server(max_num_seqs=4)
    try:
        done: list[str] = []

        async def big(client):
            await client.post("/v1/completions", json={"model": "smollm2", "prompt": [f"Tale {i}:" for i in range(12)],
                                                       "max_tokens": 8, "ignore_eos": True})  # fmt: skip
            done.append("big")

        async def small(client):
            await asyncio.sleep(0.5)
            r = await client.post("/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 4})
            assert r.status_code == 200
            done.append("small")

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=300) as client:
                await asyncio.gather(big(client), small(client))

        asyncio.run(main())
        assert done == ["small", "big"]
        # a width the engine can never run is a 400 before a stream starts, not a 200 with an error event
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "smollm2", "prompt": "Hi", "n": 8, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "max_num_seqs=4" in r.text
        assert_pool_free(s)
    finally:
        stop_server(s)


def test_api_keys_guard_every_path_but_health_and_are_checked_before_the_body():
    s = start_server(api_key=["alice-key", "bob-key"], num_kv_blocks=32, max_model_len=256)
    try:
        for path in ("/docs", "/openapi.json", "/metrics", "/v1/models"):
            r = httpx.get(f"{s.url}{path}")
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
            assert httpx.get(f"{s.url}{path}", headers={"Authorization": "Bearer bob-key"}).status_code == 200, path
        assert httpx.get(f"{s.url}/health").status_code == 200
        # a body that never comes: the key is refused at once, not after the body timeout
        with socket.create_connection(("127.0.0.1", s.server.config.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")  # fmt: skip
            assert sock.recv(4096).startswith(b"HTTP/1.1 401")
        for key in ("alice-key", "bob-key"):
            c = openai.OpenAI(base_url=s.base_url, api_key=key, max_retries=0)
            assert c.completions.create(model="smollm2", prompt="hi", max_tokens=2).choices[0].text is not None
    finally:
        stop_server(s)


def test_an_empty_api_key_is_refused():
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=16, max_model_len=128))
    with pytest.raises(ValueError, match="must not be empty"):
        build_app(engine, api_key="")
    with pytest.raises(ValueError, match="must not be empty"):
        build_app(engine, api_key=["good", ""])
    for argv, env in ((["--api-key", ""], {}), ([], {"KVPAGE_API_KEY": ""})):
        r = subprocess.run([sys.executable, "-m", "kvpage.cli", "serve", *argv], capture_output=True, text=True,
                           timeout=120, env={**os.environ, **env})  # fmt: skip
        assert r.returncode == 1 and "must not be empty" in r.stderr, r.stderr


def test_a_half_sent_body_times_out():
    s = start_server(app_kw={"body_timeout": 1.0}, num_kv_blocks=32, max_model_len=256)
    try:
        with socket.create_connection(("127.0.0.1", s.server.config.port), timeout=15) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\"")  # fmt: skip
            reply = b""
            for _ in range(50):  # the body timeout is 1 s: a reply well within 50 rounds of 0.3 s
                if b"\r\n\r\n" in reply:
                    break
                time.sleep(0.3)
                with contextlib.suppress(OSError):
                    sock.sendall(b" ")  # a byte now and then: still no complete body
                sock.settimeout(0.3)
                with contextlib.suppress(TimeoutError):
                    reply += sock.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408")
        assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        stop_server(s)


def _hits(s, key: str) -> float:
    return scrape(s, {"Authorization": f"Bearer {key}"})["kvpage:prefix_cache_hits_total"]


def test_prefix_caches_are_kept_apart_per_key_and_per_cache_salt():
    s = start_server(api_key=["alice", "bob"], app_kw={"salt_cache_per_key": True})
    try:
        secret = "My password is hunter2 and my bank is First National, account " * 4

        def ask(key, prompt=secret, **extra):
            c = openai.OpenAI(base_url=s.base_url, api_key=key, max_retries=0)
            c.completions.create(model="smollm2", prompt=prompt, max_tokens=1, extra_body=extra)

        ask("alice")
        h0 = _hits(s, "bob")
        ask("bob")  # bob guesses alice's prompt: no hit to see
        assert _hits(s, "bob") == h0
        ask("alice")  # alice's own prompt again: her cache hits
        h1 = _hits(s, "alice")
        assert h1 > h0
        ask("alice", cache_salt="tab-2")  # a salt of her own keeps even her requests apart
        assert _hits(s, "alice") == h1
        ask("alice", cache_salt="tab-2")
        assert _hits(s, "alice") > h1
        assert_pool_free(s, headers={"Authorization": "Bearer alice"})
    finally:
        stop_server(s)
    with pytest.raises(ValueError, match="needs API keys"):
        build_app(s.engine, salt_cache_per_key=True)


def test_huge_prompts_are_tokenized_off_the_event_loop():
    """vLLM's test_healthcheck_response_time: while the server tokenizes prompts of 150,000 words (each
    then refused: past the context), /health still answers, typically in far less than one tokenization
    takes (the bound is that ratio, measured in the same run, not a time)."""
    s = start_server(app_kw={"max_body_bytes": 1 << 20}, num_kv_blocks=32, max_model_len=256)
    try:
        text = " ".join(["A"] * 150_000)
        t0 = time.perf_counter()
        assert len(s.engine.tokenizer.encode(text)) == 150_000
        one = time.perf_counter() - t0
        body = {"model": "smollm2", "prompt": text, "max_tokens": 4}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = [pool.submit(httpx.post, f"{s.base_url}/completions", json=body, timeout=120) for _ in range(6)]
            time.sleep(0.2)
            probes = []
            while not all(a.done() for a in answers[:-1]):
                t0 = time.perf_counter()
                assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
                probes.append(time.perf_counter() - t0)
                time.sleep(0.01)
            codes = [a.result().json()["error"]["code"] for a in answers]
        assert codes == ["context_length_exceeded"] * 6
        # (tokenizing in the event loop: 2 probes got through, the slowest 2.4x one tokenization)
        assert len(probes) >= 5 and statistics.median(probes) < one / 2, (probes, one)
        assert_pool_free(s)
    finally:
        stop_server(s)
