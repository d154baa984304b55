"""Structured outputs through the engine on SmolLM2: every output of a constrained request validates (JSON schemas
checked with jsonschema, regexes with re, choices, an EBNF grammar), with n = 4 samples and beams, under recompute
and swap preemption in a tiny pool and with a prefix hit (the same tokens as without), beside free rows (whose
tokens do not change); bad constraints fail alone, naming the field; the pool ends clean."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvpage import BeamSearchParams, SamplingParams
from kvpage.errors import ParameterError
from tests.engine.helpers import assert_clean, assert_pressed_like_roomy, make_llm, make_pressed_llm

pytest.importorskip("xgrammar")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "format": "email"}, "role": {"enum": ["admin", "user", "guest"]},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2}},
    "required": ["name", "age", "role"], "additionalProperties": False}  # fmt: skip
SCHEMAS = {
    "nested, arrays, enums, optional, formats": PERSON,
    "numbers and a nested object": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
        "where": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number"}}, "required": ["lat", "lon"]}, "visited": {"type": "boolean"}},
        "required": ["city", "where", "visited"]},
    "an array of objects": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
        "tag": {"type": "string", "pattern": "^[a-z]{2,6}$"}}, "required": ["id", "tag"]}, "minItems": 1,
        "maxItems": 2},
}  # fmt: skip
CHAT = [{"role": "user", "content": "Reply with JSON describing a person who lives in Paris."}]


@pytest.fixture(scope="module")
def llm():
    return make_llm(num_kv_blocks=256)


def _json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_output_of_a_json_schema_validates_greedy_and_four_samples(llm, name):
    schema = SCHEMAS[name]
    params = [
        SamplingParams(temperature=0.0, max_tokens=120, structured_outputs={"json": schema}),
        SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=120, structured_outputs={"json": schema}),
    ]
    for out in llm.chat([CHAT, CHAT], params, use_tqdm=False):  # fmt: skip
        for o in out.outputs:
            assert o.finish_reason == "stop", o.text
            _json(o.text, schema)
    assert_clean(llm)


# vLLM's test grammar, in Lark's syntax (vLLM takes it beside EBNF; xgrammar reads it)
LARK_SQL = """
start: select_statement
select_statement: "SELECT" column "from" table "where" condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""


def _compact_object(text: str) -> bool:
    """A JSON object with no whitespace outside its strings."""
    return isinstance(json.loads(text), dict) and not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', "", text))


def test_regex_choice_grammar_and_any_json_object(llm):
    cases = [({"regex": r"[A-Z]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[A-Z]{3}-[0-9]{4}", t)),
             ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
             ({"grammar": 'root ::= num ("+" num)? ("*" num)?\nnum ::= [1-9] [0-9]?'},
              lambda t: re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)?(\*[1-9][0-9]?)?", t)),
             ({"grammar": LARK_SQL}, lambda t: re.fullmatch(r"SELECTcol_[12]fromtable_[12]wherecol_[12]=[12]", t)),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
             ({"json_object": True, "disable_any_whitespace": True}, _compact_object)]  # fmt: skip
    for spec, ok in cases:
        for seed in (0, 1):
            params = SamplingParams(temperature=0.9, seed=seed, max_tokens=60, structured_outputs=spec)
            out = llm.generate(["The answer is: "], params, use_tqdm=False)
            o = out[0].outputs[0]
            assert o.finish_reason == "stop" and ok(o.text), (spec, o.text)
    assert_clean(llm)


def test_beams_are_each_constrained(llm):
    out = llm.generate(["A person as JSON: "], BeamSearchParams(beam_width=3, max_tokens=80,
                                                                structured_outputs={"json": PERSON}))  # fmt: skip
    done = [o for o in out[0].outputs if o.finish_reason == "stop"]
    assert done, [o.text for o in out[0].outputs]
    for o in done:
        _json(o.text, PERSON)
    assert_clean(llm)


def test_free_rows_beside_constrained_ones_do_not_change(llm):
    free = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
             "maximum": 99}}, "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip
    # (compact JSON: with free whitespace, a 135M model on a raw prompt can run on in blanks)
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={
        "json": small, "disable_any_whitespace": True})  # fmt: skip
    mixed = llm.generate(prompts + prompts, [free] * 3 + [constrained] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for o in mixed[3:]:
        assert o.outputs[0].finish_reason == "stop" and " " not in o.outputs[0].text
        _json(o.outputs[0].text, small)
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_a_prefix_hit_change_nothing(llm, mode):
    """In a pool too small for the batch (sequences preempted, their matchers rebuilt from their tokens) the
    constrained outputs are the big pool's, token for token; run again, the prompts hit the cache: the same."""
    params = SamplingParams(temperature=0.0, max_tokens=70, structured_outputs={"json": PERSON})
    chats = [[{"role": "user", "content": f"Reply with JSON describing person number {i}."}] for i in range(4)]
    assert_pressed_like_roomy(llm, make_pressed_llm(9, mode), chats, params)


def test_bad_constraints_fail_alone_naming_the_field(llm):
    engine = llm.llm_engine
    typo = {"type": "object", "properties": {"a": {"type": "strin"}}}
    for spec, field in [({"json": typo}, "structured_outputs.json"),
                        ({"regex": "(unclosed"}, "structured_outputs.regex"),
                        ({"grammar": "root ::= missing_rule"}, "structured_outputs.grammar"),
                        ({"choice": []}, "structured_outputs.choice"),
                        ({"regex": "a", "choice": ["b"]}, "structured_outputs")]:  # fmt: skip
        with pytest.raises(ParameterError) as e:
            engine.add_request("bad", "x", SamplingParams(structured_outputs=spec))
        assert e.value.param == field, (spec, e.value)
    assert not engine.has_unfinished_requests()
    # (a request aborted while its grammar compiles leaves nothing behind)
    engine.add_request("aborted", "x", SamplingParams(structured_outputs={"json": {"type": "object", "properties": {
        "k": {"type": "string", "pattern": "^[a-z]{1,40}$"}}}}))  # fmt: skip
    engine.abort_request("aborted")
    assert_clean(llm)


def test_ignore_eos_still_ends_where_the_grammar_does(llm):
    choice = {"choice": ["yes", "no"]}
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, structured_outputs=choice)
    out = llm.generate(["Pick: "], params, use_tqdm=False)[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.text in ("yes", "no")
    assert_clean(llm)


def test_the_bitmask_unpacks_bit_for_bit():
    """xgrammar's int32 words (bit j of word w: token 32 w + j, the sign bit included) as one bool per token."""
    import torch

    from kvpage.structured.grammars import unpack_bitmask

    words = torch.randint(-(2**31), 2**31 - 1, (3, 40), dtype=torch.int32)
    vocab = 40 * 32 - 5  # (the last word's top bits beyond the vocabulary dropped)
    want = [[bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(3)]
    assert unpack_bitmask(words, vocab).tolist() == want


def test_logprobs_of_a_constrained_row_are_finite_numbers(llm):
    """The allowed tokens' log-probabilities sum to one; a forbidden token among the top ones reads -9999 (vLLM's
    figure), never -inf (which JSON cannot carry)."""
    import math

    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=3, structured_outputs={"choice": ["yes", "no"]})
    o = llm.generate(["Answer: "], params, use_tqdm=False)[0].outputs[0]
    seen = [[lp.logprob for lp in pos.values()] for pos in o.logprobs]
    for values in seen:
        assert all(math.isfinite(v) for v in values)
        assert sum(math.exp(v) for v in values if v > -9999.0) <= 1.0 + 1e-5
    # (past the first token of "yes" or "no" one token is allowed: the rest of the top three are forbidden)
    assert any(values.count(-9999.0) == 2 for values in seen[1:]), seen
    assert_clean(llm)
