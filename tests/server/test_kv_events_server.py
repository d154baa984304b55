"""/v1/kv_events on a real server: what a router outside the process reads. The digests are the
ones any process computes from the prompt's tokens with the core's hash (no per-process seed)."""

from __future__ import annotations

import httpx
import openai

from kvpage.core.cache_key import extra_keys_for, hash_block
from tests.server.conftest import assert_pool_free, wait_idle


def chain(tokens, block_size, salt=None):
    out, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size], extra_keys_for(i, salt))
        out.append(parent.hex())
    return out


def test_a_router_reads_the_blocks_a_prompt_left_and_resumes_where_it_stopped(server):
    first = httpx.get(f"{server.url}/v1/kv_events", params={"since": 0}, timeout=30).json()
    seen, bs = first["seq"], first["block_size"]
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    prompt = list(range(2000, 2000 + 3 * bs + 5))  # three full blocks and a partial one
    client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0)
    client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": "t1"}
    )
    wait_idle(server)
    r = httpx.get(f"{server.url}/v1/kv_events", params={"since": seen}, timeout=30).json()
    assert not r["gap"] and r["batches"] and all(b["seq"] > seen for b in r["batches"])
    assert [b["seq"] for b in r["batches"]] == list(range(seen + 1, r["seq"] + 1))  # numbered without holes
    stored = [e for b in r["batches"] for e in b["events"] if e["type"] == "BlockStored"]
    digests = {h for e in stored for h in e["block_hashes"]}
    assert set(chain(prompt, bs)) <= digests and set(chain(prompt, bs, "t1")) <= digests  # salted: other digests
    by_hash = {e["block_hashes"][0]: e for e in stored}
    second = by_hash[chain(prompt, bs)[1]]
    assert second["parent_block_hash"] == chain(prompt, bs)[0] and second["token_ids"] == prompt[bs : 2 * bs]
    assert second["medium"] == "gpu" and second["block_size"] == bs
    snap = httpx.get(f"{server.url}/v1/kv_events/snapshot", timeout=30).json()
    assert snap["seq"] == r["seq"] and set(chain(prompt, bs)) <= {e["block_hashes"][0] for e in snap["blocks"]}
    again = httpx.get(f"{server.url}/v1/kv_events", params={"since": r["seq"]}, timeout=30).json()
    assert again == {"seq": r["seq"], "gap": False, "block_size": bs, "batches": []}
    bad = httpx.get(f"{server.url}/v1/kv_events", params={"since": -1}, timeout=30)
    assert bad.status_code == 400 and "since" in bad.text
    assert_pool_free(server)


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(server):
    """OpenAI's usage.prompt_tokens_details.cached_tokens, read with the official client: 0 for a
    prompt never seen, its full blocks (never its last token) the second time, streaming or not; a
    repeated chat all of its prompt but the last token (the first one's tail block is copied)."""
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    bs = server.engine.kv_events.block_size
    prompt = list(range(7000, 7000 + 3 * bs + 1))  # the last token is never served from cache: 3 blocks hit
    cold = client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0)
    warm = client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == 3 * bs and warm.usage.prompt_tokens == len(prompt)
    stream = client.completions.create(model="smollm2", prompt=[prompt, prompt[:-1] + [9999]], max_tokens=2,
                                       temperature=0, stream=True, stream_options={"include_usage": True})  # fmt: skip
    last = [chunk for chunk in stream][-1]
    assert last.usage.prompt_tokens_details.cached_tokens == 2 * 3 * bs  # both prompts share those blocks
    system = "You are the terse help desk of a library. " * 6
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "When do you open?"}]
    client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, temperature=0)
    chat = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, temperature=0)
    # the first chat's partly filled last block stayed cached (a tail): all but the last token is served
    assert chat.usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens - 1 > bs
    assert_pool_free(server)
