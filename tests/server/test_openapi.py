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
