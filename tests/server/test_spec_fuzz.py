"""The OpenAPI document fuzzed against the live server with schemathesis (bounded: a few examples per
operation, max_tokens capped): no 5xx, every status and content type documented, every JSON answer
valid against its documented schema, invalid requests refused with a 4xx; the pool free afterwards."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.conftest import assert_pool_free  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]  # fmt: skip
GENERATION = ("/v1/completions", "/v1/chat/completions")


def _capped(case, nth: int) -> None:
    """Generation kept short: max_tokens at most 4, n at most 4; streams as generated (an SSE answer is
    checked for its status and content type), and every third case that does not say streams."""
    body = case.body
    if not isinstance(body, dict):
        return
    if "stream" not in body and nth % 3 == 0:
        body["stream"] = True
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 4)
    elif "max_tokens" not in body:
        body["max_tokens"] = 4
    body.pop("max_completion_tokens", None)
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 4:
        body["n"] = 4


def test_the_spec_holds_under_fuzzing(server):
    schema = schemathesis.openapi.from_dict(httpx.get(f"{server.url}/openapi.json", timeout=30).json())
    schema.config.update(base_url=server.url)
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {*GENERATION, "/tokenize", "/detokenize", "/v1/models", "/health"}
    calls, streamed = [], []

    def fuzz(op):
        def one(case):
            if op.path in GENERATION:
                _capped(case, len(calls))
            calls.append(op.path)
            if isinstance(case.body, dict) and case.body.get("stream") is True:
                streamed.append(op.path)
            case.call_and_validate(checks=CHECKS, timeout=60)

        strategy = op.as_strategy()
        return settings(max_examples=12, deadline=None, database=None, derandomize=True,
                        suppress_health_check=list(HealthCheck))(given(strategy)(one))  # fmt: skip

    for op in ops:
        if not op.path.startswith("/v1/kv_events"):  # (their own tests cover them)
            fuzz(op)()
    assert len(calls) >= 40
    assert streamed, "no case streamed"
    assert_pool_free(server)
