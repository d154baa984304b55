"""The OpenAPI document at /openapi.json, made to describe the server as it answers: the error
responses it really sends (OpenAI's error body, 400 for every invalid request: never FastAPI's 422),
/metrics as Prometheus text. Ranges come from the request models (protocol.py) as JSON Schema's
minimum / maximum / exclusiveMinimum, and the rules the server checks beyond a field's type (non-empty
prompts and stop strings, token ids of this model's vocabulary, fields that go only with another: see the
request models' descriptions) are stated in JSON Schema where it can say them and in words where not."""

from __future__ import annotations

import copy

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvpage.server.protocol import ErrorResponse
from kvpage.server.responses import RESPONSES

ERRORS = {
    400: "an invalid request (the message names the field), or one that can never fit",
    401: "a missing or wrong API key (with --api-key)",
    404: "another model than the one served, or no such endpoint",
    408: "the request body took longer than --body-timeout to arrive",
    413: "the request body is larger than --max-body-bytes",
    503: "the server is shutting down, or its engine died",
}
POSTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


RULES_400 = (
    "an invalid request, the message naming the field: a wrong type or a value out of range; an empty "
    "prompt or stop string; a token id outside the vocabulary; logit_bias keys that are not token ids; "
    "stream_options without stream: true; top_logprobs without logprobs: true; continue_final_message "
    "with add_generation_prompt; logprobs, prompt_logprobs or logit_bias with use_beam_search; a prompt "
    "(chat: messages) plus max_tokens (or max_completion_tokens) past the context (code "
    "context_length_exceeded, param the field at fault); more prompts than "
    "--max-prompts-per-request; or a request that can never fit the KV cache"
)


def install_openapi(app: FastAPI, vocab_size: int | None = None) -> None:
    """`vocab_size`: the served model's, stated as every token id's maximum."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes, servers=app.servers)
        spec = copy.deepcopy(spec)  # (its schemas may share dicts with the request models')
        _token_ids(spec, vocab_size)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error.pop("$defs", {}))
        schemas["ErrorResponse"] = error
        body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for model in {*RESPONSES.values()}:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        for path, ops in spec.get("paths", {}).items():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                if path in RESPONSES:
                    ok = responses.setdefault("200", {"description": "OK"})
                    content = {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{RESPONSES[path].__name__}"}}
                    }
                    if path in ("/v1/completions", "/v1/chat/completions"):
                        content["text/event-stream"] = {  # (before OpenAPI 3.2, `schema` is one event)
                            "schema": {
                                "type": "object",
                                "description": "with stream: true, server-sent events: each `data` a JSON chunk "
                                "of the response, the last `data: [DONE]`",
                                "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                               "id": {"type": "string"}, "retry": {"type": "integer"}},
                                "required": ["data"],
                            }
                        }  # fmt: skip
                    ok["content"] = content
                responses.pop("422", None)
                codes = list(ERRORS) if path in POSTS else [401, 404, 503] if path != "/health" else [503]
                for code in codes:
                    about = RULES_400 if code == 400 and path in ("/v1/completions", "/v1/chat/completions") else None
                    responses.setdefault(str(code), {"description": about or ERRORS[code], "content": body})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        metrics = spec.get("paths", {}).get("/metrics", {}).get("get")
        if metrics is not None:
            metrics["responses"]["200"] = {"description": "Prometheus text exposition format",
                                           "content": {"text/plain": {"schema": {"type": "string"}}}}  # fmt: skip
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]


def _token_ids(node, vocab_size: int | None) -> None:
    """Every schema marked as a token id (protocol.TOKEN_ID) gets the vocabulary's maximum."""
    if isinstance(node, dict):
        if node.pop("x-kvpage-token-id", False) and vocab_size:
            node["maximum"] = vocab_size - 1
        for v in node.values():
            _token_ids(v, vocab_size)
    elif isinstance(node, list):
        for v in node:
            _token_ids(v, vocab_size)
