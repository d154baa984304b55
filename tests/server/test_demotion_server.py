"""A server started with a demoting `--kv-eviction` (core/eviction: Demote), with the official
`openai` client: long prompts run with their cold blocks demoted to int8 / int4, /metrics shows the
pools per precision and the moves, concurrent clients and an abandoned stream leave every pool free,
and a server without the pools refuses a demoting request by name."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from kvpage.tools.perplexity import english_corpus
from tests.server.conftest import assert_pool_free, scrape, start_server, stop_server, wait_idle

POLICY = "demote:hot_tokens=32,int8_tokens=64,int4_tokens=128,recent_tokens=64"


@pytest.fixture(scope="module")
def demoting():
    # every request cold: a prefix hit moves where a prompt's chunks end, and so what is demoted when
    s = start_server(kv_eviction=POLICY, num_kv_blocks=96, max_num_batched_tokens=128, enable_prefix_caching=False)
    yield s
    stop_server(s)


def test_long_prompts_demote_their_cold_blocks_and_metrics_show_the_pools(demoting):
    client = openai.OpenAI(base_url=demoting.base_url, api_key="unused", max_retries=0)
    text = english_corpus()
    prompts = [demoting.engine.tokenizer.encode(text[i * 3000 : i * 3000 + 4000])[:400] for i in range(4)]
    wait_idle(demoting)
    before = scrape(demoting)

    def complete(ids):
        r = client.completions.create(model="smollm2", prompt=ids, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        return r.choices[0].text, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(complete, prompts))
    alone = [complete(ids) for ids in prompts]
    # alone, a request is scheduled the same way every time: the same answer. Together, prompts share
    # each step's token budget, so their chunks end elsewhere and the policy scores and demotes at
    # other points (as H2O does): the answers may differ, never their length
    assert [complete(ids) for ids in prompts[:2]] == alone[:2]
    assert all(n == 12 for _, n in together + alone)
    stream = client.completions.create(model="smollm2", prompt=prompts[0], max_tokens=50, stream=True)
    next(iter(stream))
    stream.close()  # abandoned after its first chunk: aborted, its demoted blocks given back
    wait_idle(demoting)
    after = scrape(demoting)
    moved = {p: after[f'kvpage:kv_demotions_total{{precision="{p}"}}'] - before.get(
        f'kvpage:kv_demotions_total{{precision="{p}"}}', 0) for p in ("int8", "int4")}  # fmt: skip
    assert moved["int8"] >= 8 * 4 and moved["int4"] >= 8 * 4  # each 400-token prompt fills both rungs
    st = demoting.engine.cache_stats()
    for p in ("int8", "int4"):
        assert after[f'kvpage:kv_demoted_blocks{{precision="{p}",state="total"}}'] == st.demoted_total_blocks[p] > 0
        assert after[f'kvpage:kv_demoted_blocks{{precision="{p}",state="used"}}'] == 0
    assert_pool_free(demoting)


def test_a_server_without_the_pools_refuses_a_demoting_request_by_name(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="Hello", max_tokens=2, extra_body={"kv_eviction": POLICY})
    assert "kv_eviction" in e.value.body["message"] and "demoting" in e.value.body["message"]
    assert_pool_free(server)
