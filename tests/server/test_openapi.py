"""/openapi.json describes the server as it answers: ranges as JSON Schema keywords, the error
responses it sends (OpenAI's body; 400, never 422), /metrics as text."""

from __future__ import annotations

import httpx


def _keys(x, found: set) -> set:
    if isinstance(x, dict):
        for k, v in x.items():
            found.add(k)
            _keys(v, found)
    elif isinstance(x, list):
        for v in x:
            _keys(v, found)
    return found


def test_the_spec_states_ranges_errors_and_content_types(server):
    spec = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    assert not _keys(spec, set()) & {"ge", "le", "gt", "lt"}  # pydantic's words, not JSON Schema's
    req = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    top_p = next(s for s in req["top_p"]["anyOf"] if s.get("type") == "number")
    assert top_p["exclusiveMinimum"] == 0 and top_p["maximum"] == 1
    temperature = next(s for s in req["temperature"]["anyOf"] if s.get("type") == "number")
    assert temperature["minimum"] == 0 and temperature["maximum"] == 2
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"200", "400", "401", "404", "408", "413"} <= set(responses)
        ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorResponse")
    error = spec["components"]["schemas"]["ErrorResponse"]
    assert error["required"] == ["error"] and "ErrorDetail" in spec["components"]["schemas"]
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": "smollm2", "prompt": "hi", "top_p": 0}, timeout=30)
    assert bad.status_code == 400 and set(bad.json()) == {"error"}  # what the spec says: exclusiveMinimum 0
    edges = {"model": "smollm2", "prompt": "hi", "top_p": 1, "temperature": 2, "max_tokens": 1}
    ok = httpx.post(f"{server.url}/v1/completions", json=edges, timeout=30)
    assert ok.status_code == 200  # the spec's bounds are the server's, both ends included where it says so


def test_every_answer_is_what_the_spec_says_it_is(server):
    from kvpage.server import responses as r

    spec = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    for path, model in r.RESPONSES.items():
        op = next(iter(spec["paths"][path].values()))
        ref = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model.__name__}" and model.__name__ in spec["components"]["schemas"]

    def post(path, body):
        resp = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()

    base = {"model": "smollm2", "max_tokens": 3, "temperature": 0}
    chat = {**base, "messages": [{"role": "user", "content": "Hi"}]}
    for body in ({**base, "prompt": "The sky is"}, {**base, "prompt": ["a", "b"], "logprobs": 2, "echo": True},
                 {**base, "prompt": [1, 2, 3], "return_token_ids": True, "prompt_logprobs": 1, "n": 2,
                  "temperature": 1.0, "seed": 3}):  # fmt: skip
        r.CompletionResponse.model_validate(post("/v1/completions", body))
    for body in (chat, {**chat, "logprobs": True, "top_logprobs": 2}, {**chat, "return_token_ids": True,
                                                                       "prompt_logprobs": 1}):  # fmt: skip
        r.ChatCompletionResponse.model_validate(post("/v1/chat/completions", body))
    r.ModelList.model_validate(httpx.get(f"{server.url}/v1/models").json())
    r.TokenizeResponse.model_validate(post("/tokenize", {"prompt": "hi", "return_token_strs": True}))
    r.DetokenizeResponse.model_validate(post("/detokenize", {"tokens": [1, 2]}))
    for path, model in (("/health", r.Health), ("/version", r.Version), ("/load", r.ServerLoad)):
        model.model_validate(httpx.get(f"{server.url}{path}").json())


def test_the_rules_only_the_server_checked_are_in_the_spec_and_hold(server):
    """Each rule the spec now states, and a request that breaks it: 400 naming the field."""
    spec = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    schemas = spec["components"]["schemas"]
    req, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    vocab = server.engine.model_config.vocab_size
    prompt = {s["type"] + str(s.get("items", {}).get("type")): s for s in req["prompt"]["anyOf"]}
    assert prompt["stringNone"]["minLength"] == 1 and prompt["arraystring"]["items"]["minLength"] == 1
    assert prompt["arrayinteger"]["items"] == {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    assert prompt["arrayinteger"]["minItems"] == 1 and prompt["arrayarray"]["items"]["items"]["maximum"] == vocab - 1
    stop = {s["type"]: s for s in req["stop"]["anyOf"]}
    assert stop["string"]["minLength"] == 1 and stop["array"]["maxItems"] == 4
    bias = next(s for s in req["logit_bias"]["anyOf"] if s["type"] == "object")
    assert bias["propertyNames"] == {"pattern": "^[0-9]+$"} and bias["additionalProperties"]["maximum"] == 100
    assert next(s for s in req["stop_token_ids"]["anyOf"] if s["type"] == "array")["items"]["maximum"] == vocab - 1
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == vocab - 1
    assert "stream: true" in req["stream_options"]["description"]
    assert "logprobs: true" in chat["top_logprobs"]["description"]
    assert "add_generation_prompt: false" in chat["continue_final_message"]["description"]
    assert "context_length_exceeded" in spec["paths"]["/v1/completions"]["post"]["responses"]["400"]["description"]
    assert "x-kvpage-token-id" not in str(spec)
    base = {"model": "smollm2", "max_tokens": 1}
    for path, body, param in [
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [vocab]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x1": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [vocab]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ("/detokenize", {"tokens": [vocab]}, "tokens"),
    ]:
        r = httpx.post(f"{server.url}{path}", json={**base, **body}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param or param in r.json()["error"]["message"], (body, r.text)
