"""Tool calls through the server with the official openai client: tool_choice "required" and a named function
(the output constrained to the calls' JSON), "auto" found by the server's Hermes parser, "none"; streamed as
OpenAI streams them (delta.tool_calls by index); a two-turn conversation with the tool's result sent back; bad
choices are a 400 naming tool_choice. The parsers for the three template families, on their texts."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from kvpage.server.tool_calls import parse_hermes, parse_llama3_json, parse_mistral
from tests.server.conftest import assert_pool_free

pytest.importorskip("xgrammar")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]  # fmt: skip


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _check(call, tool) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_required_and_a_named_function(server, client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=120, temperature=0)  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
    for call in c.message.tool_calls:
        _check(call, WEATHER if call.function.name == "get_weather" else TIME)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                       max_tokens=60, temperature=0)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    _check(call, TIME)
    assert r.choices[0].finish_reason == "tool_calls"
    assert_pool_free(server)


def test_a_two_turn_conversation_with_the_tools_result(server, client):
    first = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0)  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}]  # fmt: skip
    second = client.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], tool_choice="none",
                                            max_tokens=20, temperature=0)  # fmt: skip
    c = second.choices[0]
    assert c.message.content and not c.message.tool_calls and c.finish_reason in ("stop", "length")
    # (the tool's answer is in the prompt the model read)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10
    assert_pool_free(server)


def test_auto_finds_hermes_calls_and_leaves_plain_answers_alone(server, client):
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    pattern = re.escape(forced)  # (the answer forced into Hermes' format by a regex: the parser finds the call)
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="auto",
                                       max_tokens=60, temperature=0, extra_body={"guided_regex": pattern})  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    _check(c.message.tool_calls[0], WEATHER)
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    plain = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=12,
                                           temperature=0)  # fmt: skip
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    assert_pool_free(server)


def _streamed_calls(stream) -> dict:
    """A stream's content pieces, calls (by index: id, name, arguments, how many pieces) and finish reason."""
    calls: dict[int, dict] = {}
    content, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": "", "pieces": 0})
                assert (d.id is not None) == (entry["id"] == ""), "the id comes once, first"
                entry["id"] += d.id or ""
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
                entry["pieces"] += 1
            finish = choice.finish_reason or finish
    return {"content": content, "calls": calls, "finish": finish}


def test_streamed_calls_come_by_index(server, client):
    stream = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required",
                                            max_tokens=120, temperature=0, stream=True)  # fmt: skip
    got = _streamed_calls(stream)
    calls, finish = got["calls"], got["finish"]
    assert finish == "tool_calls" and calls and not got["content"]
    for entry in calls.values():
        assert entry["name"] == "get_weather" and entry["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(entry["arguments"]), WEATHER["function"]["parameters"])
        assert entry["pieces"] > 3  # the arguments streamed piece by piece, as they were generated
    assert_pool_free(server)


def test_auto_streams_the_content_before_a_call_then_the_call(server, client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    pattern = re.escape("Let me look that up.\n" + call)
    stream = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=80, stream=True,
                                            temperature=0, extra_body={"guided_regex": pattern})  # fmt: skip
    calls = _streamed_calls(stream)
    assert calls["finish"] == "tool_calls" and "".join(calls["content"]) == "Let me look that up.\n"
    assert len(calls["content"]) > 1  # (sent as it came, before the call began)
    (entry,) = calls["calls"].values()
    assert entry["name"] == "get_weather" and json.loads(entry["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert_pool_free(server)


def test_bad_tool_choices_are_a_400_naming_it(server, client):
    cases = [dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
             dict(tool_choice="required"),
             dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})]  # fmt: skip
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=5, **kw)
        assert e.value.body["param"] in ("tool_choice", "response_format"), (kw, e.value.body)
    assert_pool_free(server)


def test_the_parsers_on_their_families_texts():
    args = {"city": "Paris", "unit": "celsius"}
    text = f'Let me check.\n<tool_call>\n{json.dumps({"name": "get_weather", "arguments": args})}\n</tool_call>\n' \
           f'<tool_call>{json.dumps({"name": "get_time", "arguments": {"timezone": "CET"}})}</tool_call>'  # fmt: skip
    content, calls = parse_hermes(text)
    assert content == "Let me check." and [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", args), ("get_time", {"timezone": "CET"})]  # fmt: skip
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert parse_hermes("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    content, calls = parse_llama3_json('<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(args)
                                       + '}; {"name": "get_time", "parameters": {"timezone": "UTC"}}')  # fmt: skip
    assert content is None and [n for n, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1]) == args
    assert parse_llama3_json("The weather is fine.") == ("The weather is fine.", [])
    content, calls = parse_mistral('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(args) + "}]")
    assert content == "Sure." and calls[0][0] == "get_weather" and json.loads(calls[0][1]) == args
    assert parse_mistral("[TOOL_CALLS] oops")[1] == []


def test_the_stream_scanners_on_every_split_of_their_texts():
    """Fed in pieces of any size, the calls of a "required" answer stream whole (names once, arguments that
    join to the call's parameters, quotes and braces inside strings included); "auto" sends the content before a
    call's marker, holding back what may begin it."""
    import random

    from kvpage.server.tool_stream import AutoContent, NamedCall, RequiredCalls

    text = ('[ {"name": "get_weather", "parameters": {"city": "Pa\\"ris}{", "unit": "celsius", "n": [1, {"a": 2}]}}, '
            '{"name":"get_time","parameters":{"timezone":"CET"}}]')  # fmt: skip
    want = [(c["name"], c["parameters"]) for c in json.loads(text)]
    rng = random.Random(0)
    for _ in range(100):
        scanner, calls, i = RequiredCalls(), {}, 0
        while i < len(text):
            k = rng.randint(1, 7)
            for d in scanner.feed(text[i : i + k]):
                entry = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                entry["name"] += d["function"].get("name", "")
                entry["arguments"] += d["function"]["arguments"]
            i += k
        assert [(calls[j]["name"], json.loads(calls[j]["arguments"])) for j in sorted(calls)] == want
    cases = [("hermes", 'Checking.\n<tool_call>{"name": "x", "arguments": {}}</tool_call>', "Checking.\n", True),
             ("hermes", "a <tool answer, <tool_cal", "a <tool answer, <tool_cal", False),
             ("mistral", 'ok [TOOL_CALLS][{"name": "x", "arguments": {}}]', "ok ", True),
             ("llama3_json", ' {"name": "x", "parameters": {}}', "", True),
             ("llama3_json", "<|python_tag|>{}", "", True),
             ("llama3_json", "Hello {there}", "Hello {there}", False)]  # fmt: skip
    for parser, answer, content, held in cases:
        for _ in range(20):
            auto, got, i = AutoContent(parser), "", 0
            while i < len(answer):
                i += rng.randint(1, 5)
                got += auto.feed(answer[:i])
            assert auto.held == held and (got if held else got + auto.rest(answer)) == content, (parser, answer)
    named = NamedCall("f")
    first, second = named.feed('{"a"'), named.feed(": 1}")
    assert first[0]["function"] == {"name": "f", "arguments": '{"a"'} and first[0]["id"].startswith("chatcmpl-tool-")
    assert second == [{"index": 0, "function": {"arguments": ": 1}"}}]


@pytest.mark.parametrize(
    ("choice", "n"), [("required", 24), ({"type": "function", "function": {"name": "get_weather"}}, 8)]
)
def test_calls_cut_by_the_length_come_as_far_as_they_came_streamed_or_not(server, client, choice, n):
    kw = dict(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=n, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    streamed = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert whole.finish_reason == streamed["finish"] == "length" and whole.message.content is None
    (call,) = whole.message.tool_calls
    (entry,) = streamed["calls"].values()
    assert call.function.name == entry["name"] == "get_weather"
    assert call.function.arguments == entry["arguments"] and call.function.arguments.startswith("{")
    with pytest.raises(ValueError):  # (cut: not yet JSON)
        json.loads(call.function.arguments)
    assert_pool_free(server)
