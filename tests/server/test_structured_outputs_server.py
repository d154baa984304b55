"""Structured outputs through the server, with the official openai client: response_format (json_schema, strict,
and json_object), the client's `parse` with a pydantic model, vLLM's guided_* and structured_outputs in extra_body,
streamed and not, n = 2; a schema that cannot be compiled is a 400 naming the field; the pool ends free."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import assert_pool_free

pytest.importorskip("xgrammar")

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string",
        "maxLength": 20}, "population": {"type": "integer", "minimum": 0}}, "required": ["city", "country",
        "population"], "additionalProperties": False}  # fmt: skip
ASK = [{"role": "user", "content": "Give the largest city of France as JSON."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_response_format_json_schema_and_json_object(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=80, temperature=0.7, seed=3, n=2,
                                       response_format=fmt)  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), CITY)
    # (any JSON object: on the completions endpoint, as vLLM takes response_format there too)
    r = client.completions.create(model="smollm2", prompt="The answer is: ", max_tokens=60, temperature=0.9, seed=0,
                                  extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    assert_pool_free(server)


class City(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int


def test_the_clients_parse_with_a_pydantic_model(server, client):
    r = client.chat.completions.parse(model="smollm2", messages=ASK, max_tokens=80, temperature=0,
                                      response_format=City)  # fmt: skip
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.city
    assert_pool_free(server)


def test_streamed_json_reassembles_to_a_valid_document(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    stream = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=80, temperature=0,
                                            response_format=fmt, stream=True)  # fmt: skip
    chunks = [c for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), CITY)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert_pool_free(server)


def test_vllms_guided_fields_and_structured_outputs(server, client):
    def complete(**extra):
        r = client.completions.create(model="smollm2", prompt="The weather today is", max_tokens=20, temperature=0.8,
                                      seed=1, extra_body=extra)  # fmt: skip
        return r.choices[0].text

    assert complete(guided_choice=["sunny", "rainy", "cloudy"]) in ("sunny", "rainy", "cloudy")
    assert re.fullmatch(r"[0-9]{2} degrees", complete(guided_regex=r"[0-9]{2} degrees"))
    assert complete(structured_outputs={"choice": ["hot", "cold"]}) in ("hot", "cold")
    assert re.fullmatch(r"(yes|no)!", complete(guided_grammar='root ::= ("yes" | "no") "!"'))
    doc = json.loads(complete(guided_json={"type": "object", "properties": {"t": {"type": "integer", "minimum": -50,
                                           "maximum": 50}}, "required": ["t"]}))  # fmt: skip
    assert isinstance(doc["t"], int)
    assert_pool_free(server)


def test_a_constraint_that_cannot_be_compiled_is_a_400_naming_the_field(server, client):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    cases = [(dict(response_format=bad_schema), "response_format"),
             (dict(extra_body={"guided_regex": "(open"}), "guided_regex"),
             (dict(extra_body={"guided_choice": []}), "guided_choice"),
             (dict(extra_body={"structured_outputs": {"grammar": "root ::= nowhere"}}), "structured_outputs.grammar"),
             (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice")]  # fmt: skip
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=5, **kw)
        assert e.value.body["param"] == field, (kw, e.value.body)
    assert_pool_free(server)
