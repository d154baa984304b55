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
