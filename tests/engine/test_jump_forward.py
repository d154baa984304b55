"""Jump-forward decoding on SmolLM2 (jump_forward=True): the text a grammar forces is appended in one step, spelled
as the model's tokenizer spells it in context (the boundary with the token sampled before it included), counted as
generated, held to max_tokens and stop strings, and unchanged by preemption (recompute) and a prefix hit."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvpage import SamplingParams
from kvpage.structured.jump_forward import forced_tokens
from kvpage.structured.params import StructuredOutputsParams
from tests.engine.helpers import assert_clean, assert_pressed_like_roomy, make_llm, make_pressed_llm

pytest.importorskip("xgrammar")

KEYS = ["customer_full_name", "shipping_address_first_line", "number_of_items_ordered"]
ORDER = {"type": "object", "properties": {KEYS[0]: {"type": "string", "maxLength": 16},
         KEYS[1]: {"type": "string", "maxLength": 20}, KEYS[2]: {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": KEYS, "additionalProperties": False}  # fmt: skip
COMPACT = {"json": ORDER, "disable_any_whitespace": True}
CHAT = [{"role": "user", "content": "Reply with JSON describing an order from a customer in Paris."}]


@pytest.fixture(scope="module")
def llm():
    return make_llm(num_kv_blocks=256, jump_forward=True)


def _matcher(engine, rid: str, regex: str, sampled: list[int]):
    structured = engine.structured
    structured.start(rid, structured.submit(StructuredOutputsParams(regex=regex)).result())
    (m,) = structured.matchers(rid).sync([(0, sampled)])
    return m


def test_forced_text_is_spelled_as_the_tokenizer_spells_it_at_the_boundary(llm):
    engine = llm.llm_engine
    tok = engine.tokenizer
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    regex = r'\{"customer_full_name":"[a-z]+"\}'
    (brace_quote,) = enc('{"')
    # `{"` sampled: the forced rest is spelled together with it (the tokenizer keeps `{"` whole), its last
    # token left to the model
    m = _matcher(engine, "a", regex, [brace_quote])
    assert forced_tokens(m, brace_quote, tok) == enc('{"customer_full_name":"')[1:-1]
    # `{` sampled: the tokenizer would merge it with the `"` that follows; `{` stands, the rest spelled alone
    (brace,) = enc("{")
    m = _matcher(engine, "b", regex, [brace])
    got = forced_tokens(m, brace, tok)
    assert got == enc('"customer_full_name":"')[:-1] and tok.decode([brace, *got]) == '{"customer_full_name'
    assert engine.structured.matchers("b").sync([(0, [brace, *got])])  # the grammar takes them; the matcher
    # that found them did not move (sync fed them to it now)
    m = _matcher(engine, "c", r"(yes|no)", [])  # nothing forced
    assert forced_tokens(m, enc("y")[0], tok) == []
    for rid in "abc":
        engine.structured.forget(rid)


def test_forced_keys_come_in_one_step_each_spelled_as_the_tokenizer_does(llm):
    engine = llm.llm_engine
    tok = engine.tokenizer
    steps, generated = engine.num_steps, engine.num_generation_tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=COMPACT)
    samples = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=100, structured_outputs=COMPACT)
    outs = [o for r in llm.chat([CHAT, CHAT], [greedy, samples], use_tqdm=False) for o in r.outputs]
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), ORDER)
        ids = o.token_ids
        for key in KEYS:  # each key's tokens are the tokenizer's own spelling of it
            want = tok.encode(key, add_special_tokens=False)
            assert any(ids[i : i + len(want)] == want for i in range(len(ids))), (key, o.text)
    total = sum(len(o.token_ids) for o in outs)
    assert engine.num_generation_tokens - generated == total
    assert engine.num_steps - steps < max(len(o.token_ids) for o in outs) * 2 // 3  # (tokens per step > 1.5)
    assert_clean(llm)


def test_forced_tokens_obey_max_tokens_and_stop_strings(llm):
    cut = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=COMPACT)
    stop = SamplingParams(temperature=0.0, max_tokens=100, stop=["address"], structured_outputs=COMPACT)
    a, b = (r.outputs[0] for r in llm.chat([CHAT, CHAT], [cut, stop], use_tqdm=False))
    assert a.finish_reason == "length" and len(a.token_ids) == 4
    assert b.finish_reason == "stop" and b.stop_reason == "address" and b.text.endswith('"shipping_')
    assert_clean(llm)


def test_no_jump_for_a_request_that_wants_logprobs(llm):
    engine = llm.llm_engine
    steps = engine.num_steps
    params = SamplingParams(temperature=0.0, max_tokens=100, logprobs=1, structured_outputs=COMPACT)
    out = llm.chat([CHAT], params, use_tqdm=False)[0].outputs[0]
    assert engine.num_steps - steps == len(out.token_ids) and len(out.logprobs) == len(out.token_ids)
    assert_clean(llm)


def test_preemption_and_a_prefix_hit_change_nothing(llm):
    """Recompute replays the forced tokens as a prompt does (swap moves blocks, whatever filled them: the
    structured-output tests run both modes)."""
    mode = "recompute"
    params = SamplingParams(temperature=0.0, max_tokens=70, structured_outputs=COMPACT)
    chats = [[{"role": "user", "content": f"Reply with JSON describing order number {i}."}] for i in range(4)]
    assert_pressed_like_roomy(llm, make_pressed_llm(8, mode, jump_forward=True), chats, params)
