"""vLLM's chat extensions for prefilling the assistant's reply: `continue_final_message` (with
`add_generation_prompt` false) continues the final message instead of starting a new turn; chat `echo`
puts that message's text first; `add_generation_prompt` false leaves the assistant header out."""

from __future__ import annotations

import httpx
import openai

from tests.server.conftest import assert_pool_free

PREFILL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]  # fmt: skip
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def test_continue_final_message_continues_the_prefilled_reply(server):
    c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    tok = server.engine.tokenizer
    ids = tok.encode_chat(PREFILL, add_generation_prompt=False, continue_final_message=True)
    closed = tok.encode_chat(PREFILL, add_generation_prompt=False)
    assert closed[: len(ids)] == ids and len(closed) > len(ids)  # the same text, its end of turn left off
    r = c.chat.completions.create(model="smollm2", messages=PREFILL, max_tokens=6, temperature=0, extra_body=CONTINUE)
    assert r.usage.prompt_tokens == len(ids)
    same = c.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == same.choices[0].text  # exactly those tokens, continued
    assert r.choices[0].message.role == "assistant"
    echoed = c.chat.completions.create(model="smollm2", messages=PREFILL, max_tokens=6, temperature=0,
                                       extra_body={**CONTINUE, "echo": True})  # fmt: skip
    assert echoed.choices[0].message.content == "The capital of France is" + r.choices[0].message.content
    stream = c.chat.completions.create(model="smollm2", messages=PREFILL, max_tokens=6, temperature=0, stream=True,
                                       extra_body={**CONTINUE, "echo": True})  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == echoed.choices[0].message.content
    fresh = c.chat.completions.create(model="smollm2", messages=PREFILL[:1], max_tokens=6, temperature=0)
    assert fresh.usage.prompt_tokens == len(tok.encode_chat(PREFILL[:1]))
    bare = c.chat.completions.create(model="smollm2", messages=PREFILL[:1], max_tokens=1, temperature=0,
                                     extra_body={"add_generation_prompt": False})  # fmt: skip
    assert bare.usage.prompt_tokens == len(tok.encode_chat(PREFILL[:1], add_generation_prompt=False))
    assert bare.usage.prompt_tokens < fresh.usage.prompt_tokens
    assert_pool_free(server)


def test_continue_final_message_with_a_generation_prompt_is_a_400_naming_it(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"model": "smollm2", "messages": PREFILL, "continue_final_message": True})  # fmt: skip
    assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"]
