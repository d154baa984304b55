"""The engine loop every suite benchmark runs: submit requests at once, step to the end, look after each step.

After the run the bookkeeping must hold and no block may be left in use: a benchmark that leaked
would measure a pool smaller than it says.
"""

from __future__ import annotations

import time


def drive(llm, requests, on_step=None) -> tuple[list, float]:
    """Add every (prompt, params) at once and step the engine until all finish, calling on_step() after
    each step. Returns the finished RequestOutputs in request order and the seconds the steps took."""
    engine, done = llm.llm_engine, {}
    ids = [f"bench-{i}" for i in range(len(requests))]
    for rid, (prompt, params) in zip(ids, requests, strict=True):
        engine.add_request(rid, prompt, params)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        if on_step is not None:
            on_step()
    seconds = time.perf_counter() - t0
    engine.kv_manager.check_invariants()
    assert llm.cache_stats().used_blocks == 0, "a request leaked blocks"
    return [done[rid] for rid in ids], seconds


def output_tokens(outs) -> int:
    return sum(len(c.token_ids) for o in outs for c in o.outputs)
