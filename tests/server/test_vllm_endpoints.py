"""vLLM's auxiliary endpoints a migrating client calls: /tokenize and /detokenize (the engine's own
tokenizer and chat template), /version, /load (generation requests in flight)."""

from __future__ import annotations

import json

import httpx
import openai

from kvpage import __version__
from tests.server.conftest import assert_pool_free

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_tokenize_counts_as_the_engine_does_and_detokenize_inverts_it(server):
    tok = server.engine.tokenizer
    r = post(server, "/tokenize", {"model": "smollm2", "prompt": "The quick brown fox", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("The quick brown fox") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.engine.max_model_len
    assert body["token_strs"] == ["The", "Ġquick", "Ġbrown", "Ġfox"]  # the vocabulary's pieces, as vLLM's
    back = post(server, "/detokenize", {"model": "smollm2", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "The quick brown fox"}
    chat = post(server, "/tokenize", {"model": "smollm2", "messages": MESSAGES}).json()
    c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    answer = c.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=1, temperature=0)
    assert chat["count"] == answer.usage.prompt_tokens  # the chat template applied exactly as for a completion
    bare = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][: bare["count"]] == bare["tokens"]
    prefill = [*MESSAGES, {"role": "assistant", "content": "Sure,"}]
    open_reply = post(server, "/tokenize", {"messages": prefill, "add_generation_prompt": False,
                                            "continue_final_message": True}).json()  # fmt: skip
    closed = post(server, "/tokenize", {"messages": prefill, "add_generation_prompt": False}).json()
    assert open_reply["tokens"] == tok.encode_chat(prefill, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(open_reply["tokens"], skip_special_tokens=False).endswith("Sure,")
    assert open_reply["count"] < closed["count"]  # the final message left open: no end of turn after it
    assert_pool_free(server)


def test_bad_tokenize_requests_are_400s_or_404s_naming_the_field(server):
    cases = [("/tokenize", {"model": "smollm2"}, 400, "prompt"),
             ("/tokenize", {"model": "smollm2", "prompt": "a", "messages": MESSAGES}, 400, "prompt"),
             ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "nope"),
             ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
             ("/detokenize", {"model": "smollm2", "tokens": [10**9]}, 400, "tokens"),
             ("/detokenize", {"model": "smollm2", "tokens": ["a"]}, 400, "tokens")]  # fmt: skip
    for path, body, status, needle in cases:
        r = post(server, path, body)
        assert r.status_code == status and needle in r.json()["error"]["message"], (body, r.text)


def test_version_and_load(server):
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}
    assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    body = {"model": "smollm2", "prompt": "Count: 1, 2,", "max_tokens": 64, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert httpx.get(f"{server.url}/load").json() == {"server_load": 1}
        assert sum(1 for _ in lines) > 64
    assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    assert_pool_free(server)


def test_behind_a_path_prefix_proxy_root_path_routes_checks_keys_and_counts_as_before():
    from tests.server.conftest import start_server, stop_server

    s = start_server(api_key="k", server_kw={"root_path": "/kv"})
    try:  # requests arrive as the proxy forwards them: the prefix stripped
        assert httpx.get(f"{s.url}/health").status_code == 200  # open without a key, as without the prefix
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
        c = openai.OpenAI(base_url=s.base_url, api_key="k", max_retries=0, timeout=60)
        assert c.completions.create(model="smollm2", prompt="Hi", max_tokens=2, temperature=0).choices[0].text
        spec = httpx.get(f"{s.url}/openapi.json", headers={"Authorization": "Bearer k"}).json()
        assert httpx.get(f"{s.url}/openapi.json").status_code == 401
        assert spec["servers"] == [{"url": "/kv"}]  # what a generated client puts in front
        key = {"Authorization": "Bearer k"}
        assert httpx.get(f"{s.url}/load", headers=key).json() == {"server_load": 0}
        # or as a client calling it directly with the prefix (a proxy that does not strip it): the same routes
        direct = openai.OpenAI(base_url=f"{s.url}/kv/v1", api_key="k", max_retries=0, timeout=60)
        assert [m.id for m in direct.models.list()] == ["smollm2"]
        assert direct.completions.create(model="smollm2", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
        assert (
            httpx.get(f"{s.url}/kv/v1/models").status_code == 401 and httpx.get(f"{s.url}/kv/health").status_code == 200
        )
        assert httpx.get(f"{s.url}/kv/kv/v1/models", headers=key).status_code == 404  # once, not twice
        assert_pool_free(s, headers=key)
    finally:
        stop_server(s)


def test_orca_load_headers_report_the_cache_and_the_queue(server):
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 1}
    text = httpx.post(f"{server.url}/v1/completions", json=body, headers={"endpoint-load-metrics-format": "text"})
    value = text.headers["endpoint-load-metrics"]
    assert value.startswith("TEXT ") and "named_metrics.kv_cache_usage_perc=" in value
    assert "named_metrics.num_requests_waiting=" in value
    as_json = httpx.post(f"{server.url}/v1/completions", json=body, headers={"endpoint-load-metrics-format": "JSON"})
    kind, _, payload = as_json.headers["endpoint-load-metrics"].partition(" ")
    named = json.loads(payload)["named_metrics"]
    assert kind == "JSON" and 0 <= named["kv_cache_usage_perc"] <= 1 and named["num_requests_waiting"] >= 0
    assert "endpoint-load-metrics" not in httpx.post(f"{server.url}/v1/completions", json=body).headers
    assert_pool_free(server)


def test_a_request_without_a_model_goes_to_the_served_one(server):
    """vLLM's: `model` may be left out (curl users do); another model's name is still a 404."""
    chat = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == "smollm2"
    done = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert done.status_code == 200 and done.json()["model"] == "smollm2"
    assert post(server, "/v1/completions", {"model": "gpt-9", "prompt": "Hi"}).status_code == 404
    assert_pool_free(server)
