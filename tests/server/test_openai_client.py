"""The official `openai` client against a live kvpage server on loopback."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.server.conftest import assert_pool_free, start_server, stop_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]


def test_completion_and_usage(server, client):
    tok = server.engine.tokenizer
    prompt = "The capital of France is"
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.object == "text_completion" and len(r.choices) == 1
    c = r.choices[0]
    assert c.finish_reason == "length" and c.text.strip()
    assert r.usage.prompt_tokens == len(tok.encode(prompt)) and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert_pool_free(server)


def test_chat_and_streaming_chat_reassemble_to_the_same_text(server, client):
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    full = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and text
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == text
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert_pool_free(server)


def test_n_2_seeded(server, client):
    kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=10, temperature=1.0, n=2, seed=11)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    assert_pool_free(server)


def test_stop_strings(server, client):
    base = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0)
    text = base.choices[0].text
    stop = text.strip().split()[1]  # a token a few places in
    r = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text and text.startswith(r.choices[0].text)
    assert_pool_free(server)


def test_logprobs(server, client):
    r = client.completions.create(model="smollm2", prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    c = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    assert_pool_free(server)


def test_sixteen_concurrent_streaming_clients(server):
    prompts = [f"Write one sentence about the number {i}." for i in range(16)]
    sync = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    expected = [sync.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": p}],
                                             max_tokens=12, temperature=0).choices[0].message.content
                for p in prompts]  # fmt: skip

    async def one(client, p):
        stream = await client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": p}],
                                                      max_tokens=12, temperature=0, stream=True)  # fmt: skip
        return "".join([ch.delta.content or "" async for chunk in stream for ch in chunk.choices])

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(main())
    assert got == expected
    assert_pool_free(server)


def test_api_key_is_required_when_set():
    s = start_server(api_key="sekrit", num_kv_blocks=32, max_model_len=256)
    try:
        bad = openai.OpenAI(base_url=s.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="smollm2", prompt="hi", max_tokens=2)
        good = openai.OpenAI(base_url=s.base_url, api_key="sekrit", max_retries=0)
        assert good.completions.create(model="smollm2", prompt="hi", max_tokens=2).choices[0].text is not None
        import httpx

        assert httpx.get(f"{s.url}/health").status_code == 200  # health and metrics need no key
    finally:
        stop_server(s)


def test_a_prompt_of_segments_through_the_openai_client(server, client):
    """kvpage's `segments`: each document's own KV reused where it stands; with every block
    recomputed the answer is the plain prompt's."""
    docs = ["The code for Alder is 48213. " * 6, "Rivers carry water down to the sea. " * 6, "The code for Alder is"]
    tok = server.engine.tokenizer  # (each segment is tokenized on its own: the plain prompt is their ids)
    ids = [t for i, d in enumerate(docs) for t in tok.encode(d, add_special_tokens=i == 0)]
    plain = client.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0)
    kv = server.engine.kv_manager
    copied = kv.num_segment_tokens_copied
    same = client.completions.create(model="smollm2", prompt=None, max_tokens=6, temperature=0,
                                     extra_body={"segments": docs, "recompute_blocks": 99})  # fmt: skip
    assert same.choices[0].text == plain.choices[0].text
    assert same.usage.prompt_tokens == plain.usage.prompt_tokens
    swapped = {"segments": [docs[1], docs[0], docs[2]], "recompute_blocks": 0}
    reused = client.completions.create(model="smollm2", prompt=None, max_tokens=6, temperature=0, extra_body=swapped)
    assert reused.choices[0].text and kv.num_segment_tokens_copied > copied
    # CacheBlend's selective recompute of every copied token: the plain prompt's answer again
    blended = {"segments": [docs[1], docs[0], docs[2]], "recompute_blocks": 0, "recompute_ratio": 1.0}
    ids2 = [t for i in (1, 0, 2) for t in tok.encode(docs[i], add_special_tokens=i == 1)]
    plain2 = client.completions.create(model="smollm2", prompt=ids2, max_tokens=6, temperature=0)
    again = client.completions.create(model="smollm2", prompt=None, max_tokens=6, temperature=0, extra_body=blended)
    assert again.choices[0].text == plain2.choices[0].text
    for body, field in (({"segments": []}, "segments"), ({"segments": ["a", ""]}, "segments"),
                        ({"segments": ["a"], "prompt": "b"}, "prompt"),
                        ({"segments": ["a", "b"], "recompute_blocks": -1}, "recompute_blocks"),
                        ({"segments": ["a", "b"], "recompute_ratio": 2}, "recompute_ratio"),
                        ({"segments": ["a", [10**6]]}, "segments")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="smollm2", prompt=body.pop("prompt", None), max_tokens=2, extra_body=body)
        assert field in str(e.value), (body, str(e.value))
    assert_pool_free(server)
