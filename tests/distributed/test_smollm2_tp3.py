"""SmolLM2-135M split over three ranks (9 query / 3 KV heads: one KV head each) against one process,
float32: the same greedy tokens, log-probabilities within 1e-4, the same prefix hits and preemptions.
Slow (three ranks of the real model on the CI's two cores): `make test-slow` runs it."""

from __future__ import annotations

import os

import pytest

from kvpage import LLM, SamplingParams
from tests.engine.helpers import assert_clean

pytestmark = pytest.mark.skipif(not os.environ.get("KVPAGE_SLOW_TESTS"), reason="make test-slow runs it")


def test_smollm2_tp3_equals_tp1(prompts):
    kw = dict(dtype="float32", num_kv_blocks=20, max_model_len=320)  # small: the batch preempts
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = []
    for n in (1, 3):
        with LLM("smollm2", tensor_parallel_size=n, **kw) as llm:
            outs = llm.generate(prompts, params) + llm.generate(prompts[:3], params)  # the second: prefix hits
            snap = llm.llm_engine.snapshot
            runs.append(([o.outputs[0] for o in outs], snap.cache.prefix_hit_tokens, snap.num_preemptions))
            if n == 3:
                digests = llm.llm_engine.runner.digests()
                assert len(digests) == 3 and len(set(digests)) == 1
            assert_clean(llm)
    (one, hits1, pre1), (three, hits3, pre3) = runs
    assert [c.token_ids for c in one] == [c.token_ids for c in three]
    for a, b in zip(one, three, strict=True):
        la = [lp[t].logprob for t, lp in zip(a.token_ids, a.logprobs, strict=True)]
        lb = [lp[t].logprob for t, lp in zip(b.token_ids, b.logprobs, strict=True)]
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-4
    assert (hits1, pre1) == (hits3, pre3) and hits1 > 0 and pre1 > 0
