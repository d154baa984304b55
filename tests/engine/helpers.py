from __future__ import annotations

from kvpage import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_llm(**kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_kv_blocks", 128)
    return LLM("smollm2", **kw)


def make_pressed_llm(num_kv_blocks: int, mode: str | None, swap_space: str = "64MiB", **kw) -> LLM:
    """A tiny pool; `mode` forces a preemption mode ("swap" also gets a CPU pool), None keeps the default."""
    kw.setdefault("max_model_len", num_kv_blocks * 16)
    if mode is not None:
        kw["preemption_mode"] = mode
    if mode == "swap":
        kw["swap_space"] = swap_space
    return make_llm(num_kv_blocks=num_kv_blocks, **kw)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **GREEDY, **kw)


def assert_clean(llm: LLM) -> None:
    """Every engine test ends here: no request left, the pool fully free, the bookkeeping consistent."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
    st = llm.cache_stats()
    assert st.used_blocks == 0 and st.cpu_used_blocks == 0 and st.free_blocks == st.total_blocks
    assert all(p.num_free == p.num_total for p in engine.kv_manager.eviction.cold.values())  # demoted blocks
    sched = engine.scheduler
    assert not sched.running and not sched.waiting and not sched.swapped and not sched.requests


def assert_pressed_like_roomy(roomy: LLM, small: LLM, chats: list, params: SamplingParams) -> None:
    """`small` (a pool that preempts) answers `chats` token for token as `roomy` does, and again from its
    prefix cache; it ends clean."""
    want = [o.outputs[0].token_ids for o in roomy.chat(chats, params, use_tqdm=False)]
    got = small.chat(chats, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == want
    again = small.chat(chats[:1], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == want[0]
    assert_clean(small)
