"""`kv_read_budget` through the server with the official `openai` client: a request's own budget on a
server started with `--kv-read-budget`, and a 400 naming the field where it cannot apply."""

from __future__ import annotations

import openai
import pytest

from kvpage.tools.perplexity import english_corpus
from tests.server.conftest import assert_pool_free, scrape, start_server, stop_server, wait_idle


@pytest.fixture(scope="module")
def bounded():
    # bounds kept, every block read unless asked; every request cold (a prefix hit rounds otherwise); in
    # deterministic mode, so that a request's bits do not depend on the batch it ran in (a budget picks blocks
    # by scores: in the default mode a last-bit difference of a batch's matmuls can pick another block)
    s = start_server(kv_read_budget=0, num_kv_blocks=96, enable_prefix_caching=False, deterministic=True)
    yield s
    stop_server(s)


def test_a_request_budget_changes_what_decodes_read_and_nothing_else(bounded):
    client = openai.OpenAI(base_url=bounded.base_url, api_key="unused", max_retries=0)
    ids = bounded.engine.tokenizer.encode(english_corpus()[:6000])[:700]

    def complete(budget):
        r = client.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True, "kv_read_budget": budget})  # fmt: skip
        return r.choices[0].logprobs.token_logprobs

    def counters():  # once the engine is idle, its last step's snapshot holds every decode
        wait_idle(bounded)
        return scrape(bounded)

    before = counters()
    full, covering = complete(0), complete(4096)
    mid = counters()
    small = complete(64)
    after = counters()
    assert covering == full  # a budget over the context reads every block
    read, ctx = "kvpage:kv_read_budget_blocks_read_total", "kvpage:kv_read_budget_blocks_in_context_total"
    # 5 decodes under each budget of a 700-token prompt: 44-45 blocks each, all read under 4096, 4 under 64
    assert mid[read] - before[read] == mid[ctx] - before[ctx] == 5 * 44 + 1
    assert after[read] - mid[read] == 5 * 4 and after[ctx] - mid[ctx] == 5 * 44 + 1
    assert small[0] == full[0] and small[1:] != full[1:]  # the prompt's token in full, the decodes within 64
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, extra_body={"kv_read_budget": 64})  # fmt: skip
    assert chat.choices[0].message.content
    for budget, why in ((16, "at least 64 tokens"), (-1, "kv_read_budget")):
        with pytest.raises(openai.BadRequestError) as e:
            complete(budget)
        assert why in str(e.value) and "kv_read_budget" in str(e.value)
    assert_pool_free(bounded)


def test_a_server_without_bounds_refuses_a_budget_by_name(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="Hello", max_tokens=2, extra_body={"kv_read_budget": 256})
    assert e.value.body["param"] == "kv_read_budget" and "keeps no key bounds" in e.value.body["message"]
    assert_pool_free(server)


def test_many_clients_with_budgets_and_an_abort_leave_the_pool_free(bounded):
    import asyncio

    ids = bounded.engine.tokenizer.encode(english_corpus()[8000:16000])
    prompts = [ids[i * 150 : i * 150 + 300] for i in range(8)]  # longer than every budget
    budgets = [64, 128, 0, 256, 64, 128, 0, 256]

    async def one(client, prompt, budget):
        r = await client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True, "kv_read_budget": budget})  # fmt: skip
        return r.choices[0].text

    async def abandoned(client):  # a stream given up after its first chunk: the engine aborts it
        stream = await client.completions.create(model="smollm2", prompt=prompts[0], max_tokens=200, stream=True,
                                                 extra_body={"ignore_eos": True, "kv_read_budget": 64})  # fmt: skip
        async for _ in stream:
            break
        await stream.close()

    async def main(together: bool):
        async with openai.AsyncOpenAI(base_url=bounded.base_url, api_key="x", max_retries=0) as client:
            if not together:
                return [await one(client, p, b) for p, b in zip(prompts, budgets, strict=True)]
            jobs = [one(client, p, b) for p, b in zip(prompts, budgets, strict=True)]
            *texts, _ = await asyncio.gather(*jobs, abandoned(client))
            return texts

    alone = asyncio.run(main(False))
    aborted = 'kvpage:request_success_total{finished_reason="abort"}'
    before = scrape(bounded).get(aborted, 0)
    assert asyncio.run(main(True)) == alone  # deterministic: a budget's choice is per sequence, whatever the batch
    assert_pool_free(bounded)
    assert scrape(bounded)[aborted] == before + 1
