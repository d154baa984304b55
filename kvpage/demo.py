"""`kvpage demo` (what `make run` runs): the real model answering a batch of chat prompts that
share one system prompt, then where the KV-cache memory went.

The first conversation runs one step alone so that its system-prompt blocks are written and
registered; the others arrive next and find those blocks in the prefix cache.
"""

from __future__ import annotations

import time

from kvpage.core import CacheStats

SYSTEM = (
    "You are a concise assistant for engineers who run large language models in production. "
    "Answer in one or two sentences, plainly, without lists or headings, and never invent numbers."
)
QUESTIONS = [
    "What is a KV cache?",
    "Why does paging help when serving many requests?",
    "What does copy-on-write mean?",
    "Name one reason a request might be preempted.",
    "What is the capital of France?",
    "Give one tip for writing clear code.",
]


def _peak(stats: CacheStats, peak: CacheStats | None) -> CacheStats:
    return stats if peak is None or stats.used_blocks > peak.used_blocks else peak


def run_demo(model: str = "smollm2", dtype: str = "auto", max_tokens: int = 64, deterministic: bool = False) -> None:
    from kvpage import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, kv_cache_memory="128MiB", enable_prefix_caching=True, deterministic=deterministic)
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    pool = engine.kv_manager.pool
    print(f"kvpage demo: {model}, loaded in {time.perf_counter() - t0:.1f} s; {pool.num_total} KV blocks of "
          f"{pool.block_size} tokens; dtype {engine.dtype_name} ({engine.dtype_reason}); {engine.kernels}")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts = [
        tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in QUESTIONS
    ]
    t1 = time.perf_counter()
    engine.add_request("0", prompts[0], params)
    peak = None
    outputs = {o.request_id: o for o in engine.step()}
    for i, p in enumerate(prompts[1:], start=1):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o
        peak = _peak(llm.cache_stats(), peak)
    elapsed = time.perf_counter() - t1
    generated = sum(len(o.outputs[0].token_ids) for o in outputs.values())
    for i, q in enumerate(QUESTIONS):
        answer = outputs[str(i)].outputs[0].text.strip().replace("\n", " ")
        print(f"\nQ: {q}\nA: {answer}")
    final = llm.cache_stats()
    assert peak is not None
    max_len = engine.max_model_len
    prompt_lens = [len(o.prompt_token_ids) for o in outputs.values()]
    per_token = engine.bytes_per_block // engine.kv_cache.block_size  # scales included for int8 / fp8
    contiguous = len(QUESTIONS) * max_len
    static = sum(n + max_tokens for n in prompt_lens)  # reserved per request for prompt + max_tokens
    paged = peak.allocated_slots
    print(f"\n{len(QUESTIONS)} requests, {generated} tokens generated in {elapsed:.1f} s "
          f"({generated / elapsed:.1f} tokens/s); prompts of {min(prompt_lens)}-{max(prompt_lens)} tokens")  # fmt: skip
    print("KV cache at its fullest moment:")
    print(f"  blocks used      {peak.used_blocks} of {peak.total_blocks} (of which shared: {peak.shared_blocks}, "
          f"shared/used {peak.shared_of_used:.0%}); logical blocks {peak.logical_blocks}")  # fmt: skip
    print(f"  waste            {peak.waste:.1%} of allocated slots hold no token")
    print(f"  prefix cache     {final.prefix_hit_tokens} of {final.prefix_query_tokens} prompt tokens served "
          f"from cache ({final.prefix_hit_rate:.0%})")  # fmt: skip
    print(f"  memory           paged: {paged} slots = {paged * per_token / 2**20:.1f} MiB; a cache pre-allocated "
          f"to max_model_len={max_len} per request: {contiguous} slots = {contiguous * per_token / 2**20:.1f} MiB "
          f"({contiguous / paged:.0f}x more)")  # fmt: skip
    print(f"                   even reserving only prompt + max_tokens per request: {static} slots "
          f"({static / paged:.1f}x more)")  # fmt: skip
    engine.kv_manager.check_invariants()
    print(f"after the run: {final.used_blocks} blocks used, {final.cached_blocks} free blocks still cached")
