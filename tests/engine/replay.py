"""Replays an engine run on the bare scheduler, to know exactly what the scheduler must have done.

Given each request's prompt, its width and the tokens every sequence generated (greedy, so known in
advance from transformers), a model-free `Scheduler` with the engine's settings is driven with the
same decisions the engine makes. The counts it ends with (preemptions, swaps) are the exact counts
the engine must report: a test can then assert equality instead of "at least five".
"""

from __future__ import annotations

from kvpage.core import KVCacheManager
from kvpage.core.request import Request
from kvpage.core.scheduler import Scheduler
from kvpage.core.step_update import RequestUpdate, SeqUpdate


def replay(engine, requests: list[tuple[str, list[int], int, list[int]]]) -> Scheduler:
    """requests: (id, prompt, n, tokens every one of its n greedy samples generates), added at once."""
    real = engine.kv_manager
    cfg = engine.config
    kv = KVCacheManager(real.pool.num_total, real.block_size, num_cpu_blocks=real.cpu_pool.num_total,
                        enable_prefix_caching=real.enable_prefix_caching, watermark=cfg.watermark)  # fmt: skip
    assert kv.watermark_blocks == real.watermark_blocks
    sched = Scheduler(kv, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                      max_model_len=engine.max_model_len, preemption_mode=cfg.preemption_mode)  # fmt: skip
    plans = {}
    for i, (rid, prompt, n, tokens) in enumerate(requests):
        sched.add_request(Request(rid, list(prompt), i, width=n, independent=n > 1))  # samples, as the engine's
        plans[rid] = (n, tokens)
    while sched.has_unfinished():
        out = sched.schedule()
        updates: dict[str, RequestUpdate] = {}
        for s in out.sequences:
            if not s.return_logits:
                continue
            rid, index = s.seq_id
            n, tokens = plans[rid]
            req = sched.requests[rid]
            seq = req.sequences[index]
            t = len(seq.output_token_ids)
            done = "length" if t + 1 >= len(tokens) else None
            upd = updates.setdefault(rid, RequestUpdate(rid))
            upd.sequences.append(SeqUpdate(index, tokens[t], None, done))
            if n > 1 and len(req.sequences) == 1 and t == 0:
                upd.sequences += [SeqUpdate(i, tokens[0], 0, done) for i in range(1, n)]
        sched.update_from_output(out, updates)
        sched.check_invariants()
    return sched
