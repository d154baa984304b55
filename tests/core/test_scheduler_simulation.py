"""The model-free scheduler simulation (kvpage/tools/scheduler_sim.py) over 1,000 seeded workloads.

Each workload mixes n > 1, beam search, aborts, prefix caching on or off, both preemption modes and
tiny pools; some give requests eviction policies (StreamingLLM, H2O, Demote and its pools), some send
documents and then prompts made of them as segments. Every step checks invariants, the KV each
sequence attends to (its demoted blocks too), progress, and that only requests that cannot fit fail.
`python -m kvpage.tools.scheduler_sim --seeds 20000` is the long run.
"""

from __future__ import annotations

import pytest

from kvpage.core.eviction import Demote
from kvpage.core.scheduler import Scheduler
from kvpage.tools.scheduler_sim import Simulation, SimulationError, Workload, make_workload, simulate

CHUNK = 100


@pytest.mark.parametrize("start", range(0, 1000, CHUNK))
def test_a_thousand_random_workloads_never_hang_crash_or_leak(start):
    totals: dict[str, int] = {}
    for seed in range(start, start + CHUNK):
        for k, v in simulate(seed).items():
            totals[k] = totals.get(k, 0) + v
    assert totals["steps"] > 0 and totals["preemptions"] > 0  # the workloads do put the pool under pressure
    # ... and every hundred of them evict, demote and copy segments
    assert totals["evicted_tokens"] > 0 and totals["demoted_blocks"] > 0 and totals["segment_tokens_copied"] > 0


def _recorded(w: Workload) -> tuple[Simulation, list]:
    """A simulation of `w` that keeps every step's SchedulerOutput."""
    sim, outs = Simulation(w), []
    schedule = sim.sched.schedule

    def recorded():
        outs.append(schedule())
        return outs[-1]

    sim.sched.schedule = recorded
    return sim, outs


def _workload(requests: list[dict], **kw) -> Workload:
    base = dict(seed=1, num_blocks=16, block_size=4, num_cpu_blocks=0, enable_prefix_caching=True, preemption_mode=None,
                max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, watermark=0.0)  # fmt: skip
    return Workload(**(base | kw), requests=requests)


DOC = list(range(100, 108))  # two full blocks


@pytest.mark.parametrize(
    ("recompute_blocks", "recompute_ratio", "slot_copies", "first_runs"),
    [
        (0, 0.0, [(0, 11, 1, 3), (1, 12, 3, 3), (4, 15, 1, 3), (5, 16, 3, 3)], [(0, 3), (11, 2)]),
        (1, 0.0, [(4, 15, 1, 3), (5, 16, 3, 3)], [(0, 7), (11, 2)]),  # its first block computed in context
        (0, 0.25, [(0, 11, 1, 3), (1, 12, 3, 3), (4, 15, 1, 3), (5, 16, 3, 3)], [(0, 3), (3, 8), (11, 2)]),
    ],
)
def test_a_prompt_of_segments_copies_its_cached_document_and_two_samples_read_it(
    recompute_blocks, recompute_ratio, slot_copies, first_runs
):
    """The document runs alone first (blocks 0 and 1); the prompt [1, 2, 3] + document + [9, 9] takes
    blocks 2..5 and copies the document's KV to positions 3..10 (slot = block * 4 + offset), rotated by
    3; then two samples decode on it, each step reading every copied token back."""
    doc = dict(id="doc", prompt=DOC, width=1, beam=False, max_tokens=1, arrive=0, abort_at=None, salt=None)
    prompt = dict(id="g", prompt=[1, 2, 3] + DOC + [9, 9], segments=[3, 8, 2], recompute_blocks=recompute_blocks,
                  recompute_ratio=recompute_ratio, width=2, beam=False, max_tokens=6, arrive=2, abort_at=None,
                  salt=None)  # fmt: skip
    sim, outs = _recorded(_workload([doc, prompt]))
    result = sim.run()
    assert [o.slot_copies for o in outs if o.slot_copies] == [slot_copies]
    admitted = next(o for o in outs if o.slot_copies)
    assert [(s.num_computed, len(s.token_ids)) for s in admitted.sequences] == first_runs
    assert result["segment_tokens_copied"] == sum(n for _, _, n, _ in slot_copies)
    assert result["failed"] == 0 and sim.ended == {"doc": None, "g": None}


def test_a_demoting_request_keeps_one_block_per_precision_and_drops_the_rest():
    """Demote with one block of each (hot, int8, int4) outside a one-block window, pools of one block:
    whatever the attention mass, a step reads at most three resident blocks (the heavy one, the window,
    the block being filled) and two demoted ones, and of the six blocks old at the last step three are
    dropped. Seed 1 runs to max_tokens: a prefill step and 24 decodes."""
    policy = Demote(hot_tokens=4, int8_tokens=4, int4_tokens=4, recent_tokens=4)
    req = dict(id="r", prompt=list(range(1, 9)), width=1, beam=False, max_tokens=24, arrive=0, abort_at=None,
               salt=None, eviction=policy)  # fmt: skip
    sim, outs = _recorded(_workload([req], num_blocks=8, cold_blocks={"int8": 1, "int4": 1}))
    result = sim.run()
    entries = [s for o in outs for s in o.sequences]
    assert result["steps"] == 25 and len(entries) == 25
    assert max(len(s.block_table) for s in entries) == 3 and max(len(s.cold_blocks) for s in entries) == 2
    assert result["evicted_tokens"] == (6 - 3) * 4
    moves = [m for o in outs for m in o.demotions]
    assert len(moves) == result["demoted_blocks"] >= 2
    assert {(m[0], m[2]) for m in moves} <= {("hot", "int8"), ("hot", "int4"), ("int8", "int4")}


@pytest.mark.parametrize(
    ("field", "drop"),
    [
        ("copies", list.clear),  # copy-on-write
        ("demotions", list.clear),
        ("demotions", list.reverse),  # made out of order: a block a move frees is overwritten before it is read
        ("rotations", list.clear),  # StreamingLLM's sink copies
        ("slot_copies", list.clear),  # a prompt's segments
    ],
)
def test_the_simulation_catches_a_scheduler_that_loses_the_workers_copies(monkeypatch, field, drop):
    """The checks have teeth: a scheduler that drops (or reorders) any of the worker's copies is caught."""
    real = Scheduler.schedule

    def lossy(self):
        out = real(self)
        drop(getattr(out, field))
        return out

    monkeypatch.setattr(Scheduler, "schedule", lossy)
    for seed in range(40):
        try:
            Simulation(make_workload(seed)).run()
        except SimulationError as e:
            assert "attends to" in str(e)
            return
    pytest.fail(f"no workload noticed the lost {field}")
