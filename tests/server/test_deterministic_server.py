"""`kvpage serve --deterministic --verify-kv-every N`: 16 concurrent clients get the same bits (text,
token logprobs, top logprobs) as each request sent alone, also when half of them are held to a JSON schema
(structured outputs leave the free rows' bits alone), and the cache checks run between steps."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai

from tests.server.conftest import assert_pool_free, scrape, start_server, stop_server

SYSTEM = "You are a terse assistant."


def _messages(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Give me a word that rhymes with {i}."}]


def _key(r) -> tuple:
    c = r.choices[0]
    lp = [(t.token, t.logprob, tuple((a.token, a.logprob) for a in t.top_logprobs)) for t in c.logprobs.content]
    return c.message.content, tuple(lp)


def test_sixteen_concurrent_clients_get_the_bits_each_request_gets_alone():
    s = start_server(dtype="bfloat16", deterministic=True, verify_kv_every=4, num_kv_blocks=128, max_model_len=512)
    try:
        kw = dict(model="smollm2", max_tokens=8, temperature=0.9, logprobs=True, top_logprobs=2)
        sync = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=120)
        alone = [_key(sync.chat.completions.create(messages=_messages(i), seed=i, **kw)) for i in range(16)]

        async def main():
            async with openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=120) as client:
                return await asyncio.gather(
                    *(client.chat.completions.create(messages=_messages(i), seed=i, **kw) for i in range(16))
                )

        together = [_key(r) for r in asyncio.run(main())]
        assert together == alone
        assert len({t for t, _ in alone}) > 1  # sixteen different answers, not one repeated

        # half of the sixteen held to a JSON schema: every one valid, the free half's bits unchanged
        schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12}}, "required": ["word"],
                  "additionalProperties": False}  # fmt: skip
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}

        async def mixed():
            async with openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=120) as client:
                return await asyncio.gather(*(client.chat.completions.create(
                    messages=_messages(i), seed=i, **(kw | {"max_tokens": 24, "response_format": fmt} if i % 2
                                                      else kw)) for i in range(16)))  # fmt: skip

        half = asyncio.run(mixed())
        assert [_key(r) for r in half[::2]] == alone[::2]
        for r in half[1::2]:
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        m = scrape(s)
        assert m["kvpage:kv_verify_blocks_total"] > 0 and m["kvpage:kv_verify_mismatches_total"] == 0
        assert_pool_free(s)
    finally:
        stop_server(s)
