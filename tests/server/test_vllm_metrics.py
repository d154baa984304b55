"""The metric families a vLLM dashboard or autoscaler reads, and `--metrics-prefix vllm` that names
them as vLLM does."""

from __future__ import annotations

import httpx
import openai

from tests.server.conftest import assert_pool_free, scrape, start_server, stop_server, wait_idle


def test_the_phase_param_and_step_histograms_count_each_request(server):
    c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    before = scrape(server)
    r = c.completions.create(model="smollm2", prompt="One, two,", n=2, max_tokens=5, temperature=0.8, seed=1,
                             extra_body={"ignore_eos": True})  # fmt: skip
    wait_idle(server)
    after = scrape(server)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert grew(f"kvpage:request_{phase}_time_seconds_count") == 1
    assert grew("kvpage:request_params_n_sum") == 2 and grew("kvpage:request_params_max_tokens_sum") == 5
    steps = grew("kvpage:iteration_tokens_total_count")
    # vLLM's count: the prompt's tokens (computed once for both samples) plus every token sampled
    assert steps >= 5 and grew("kvpage:iteration_tokens_total_sum") == r.usage.prompt_tokens + 2 * 5
    assert after['kvpage:num_requests_waiting_by_reason{reason="capacity"}'] == 0
    info = [k for k in after if k.startswith("kvpage:cache_config_info")]
    assert len(info) == 1 and 'block_size="16"' in info[0] and 'num_gpu_blocks="256"' in info[0]
    assert 'enable_prefix_caching="True"' in info[0]
    assert_pool_free(server)


def test_metrics_prefix_vllm_names_every_family_as_vllm_does():
    s = start_server(app_kw={"metrics_prefix": "vllm"})
    try:
        c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
        c.completions.create(model="smollm2", prompt="Hi", max_tokens=2, temperature=0)
        text = httpx.get(f"{s.url}/metrics").text
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
        assert not [n for n in names if n.startswith("kvpage:")]
        for name in (
            "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc",
            "vllm:prompt_tokens_total",
            "vllm:time_to_first_token_seconds_count",
            "vllm:request_queue_time_seconds_count",
        ):
            assert name in names, name
    finally:
        stop_server(s)
