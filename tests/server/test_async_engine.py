"""AsyncEngine without HTTP: every output reaches its handler, in order, though a step's outputs are
held until the next forward begins (the hand-off, kvpage/server/async_engine.py)."""

from __future__ import annotations

import asyncio

from kvpage.config import EngineConfig
from kvpage.engine.llm_engine import LLMEngine
from kvpage.sampling_params import SamplingParams
from kvpage.server.async_engine import AsyncEngine
from kvpage.worker.step_hooks import StepHook
from tests.worker.driver import assert_pool_clean


class _Forwards(StepHook):
    """As each forward begins (after the hand-off's hook): the outputs the engine thread still holds,
    and how many steps had ended."""

    def __init__(self, aengine: AsyncEngine, ended: list) -> None:
        self.aengine, self.ended, self.at_forward = aengine, ended, []

    def before_forward(self) -> None:
        self.at_forward.append((len(self.aengine._held), len(self.ended)))


def test_every_output_arrives_in_order_and_each_step_is_handed_out_before_the_next_forward():
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=256))
    steps: list[str] = []  # the request ids of each output, as on_output (the engine thread) sees them
    aengine = AsyncEngine(engine, on_output=lambda out: steps.append(out.request_id))
    forwards = _Forwards(aengine, steps)
    engine.add_step_hook(forwards)  # after the hand-off's hook: it sees what was handed out
    aengine.start()
    prompt = [1, 504, 3458, 282, 260, 2254]
    greedy = {n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 9)}

    async def run(rid: str, n: int):
        return [out async for out in aengine.generate(rid, prompt, greedy[n])]

    async def both():
        return await asyncio.gather(run("short", 3), run("long", 9))

    try:
        short, long_ = asyncio.run(asyncio.wait_for(both(), 60))
    finally:
        aengine.shutdown()
    for outs, n in ((short, 3), (long_, 9)):
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, n + 1))  # one a step, none lost
        assert [o.finished for o in outs] == [False] * (n - 1) + [True]
    assert short[-1].outputs[0].token_ids == long_[-1].outputs[0].token_ids[:3]  # the same greedy tokens
    # every forward began with nothing held back, though steps had ended with outputs before it
    assert [held for held, _ in forwards.at_forward] == [0] * len(forwards.at_forward)
    assert len(forwards.at_forward) >= 9 and forwards.at_forward[-1][1] >= 8
    assert steps.count("short") == 3 and steps.count("long") == 9
    assert_pool_clean(engine.kv_manager)
