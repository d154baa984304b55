"""Usage in streams as vLLM sends it: `stream_options.continuous_usage_stats` (every chunk carries the
usage so far) and `--enable-force-include-usage` (a final usage chunk, asked for or not)."""

from __future__ import annotations

import openai

from tests.server.conftest import assert_pool_free, start_server, stop_server

MESSAGES = [{"role": "user", "content": "Count to five."}]


def test_continuous_usage_stats_count_up_to_the_final_usage(server):
    c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for stream in (c.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=8, temperature=0, stream=True,
                                        stream_options=opts, extra_body={"ignore_eos": True}),
                   c.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0,
                                             stream=True, stream_options=opts)):  # fmt: skip
        chunks = list(stream)
        assert all(ch.usage is not None for ch in chunks)
        counts = [ch.usage.completion_tokens for ch in chunks]
        assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens > 0
        assert not chunks[-1].choices  # the final usage chunk, as without continuous stats
        assert len({ch.usage.prompt_tokens for ch in chunks}) == 1
    plain = list(c.completions.create(model="smollm2", prompt="1, 2,", max_tokens=3, temperature=0, stream=True,
                                      stream_options={"include_usage": True}))  # fmt: skip
    assert [ch.usage is not None for ch in plain] == [False] * (len(plain) - 1) + [True]
    assert_pool_free(server)


def test_force_include_usage_ends_every_stream_with_usage():
    s = start_server(app_kw={"force_include_usage": True})
    try:
        c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
        chunks = list(c.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4, temperature=0,
                                                stream=True))  # fmt: skip
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        assert all(ch.usage is None for ch in chunks[:-1])
        assert_pool_free(s)
    finally:
        stop_server(s)
