"""The model-free scheduler simulation (kvpage/tools/scheduler_sim.py) over 1,000 seeded workloads.

Each workload mixes n > 1, beam search, aborts, prefix caching on or off, both preemption modes and
tiny pools; every step checks invariants, the KV each sequence attends to, progress, and that only
requests that cannot fit fail. `python -m kvpage.tools.scheduler_sim --seeds 20000` is the long run.
"""

from __future__ import annotations

import pytest

from kvpage.tools.scheduler_sim import Simulation, SimulationError, make_workload, simulate

CHUNK = 100


@pytest.mark.parametrize("start", range(0, 1000, CHUNK))
def test_a_thousand_random_workloads_never_hang_crash_or_leak(start):
    totals = {"steps": 0, "failed": 0, "preemptions": 0}
    for seed in range(start, start + CHUNK):
        for k, v in simulate(seed).items():
            totals[k] += v
    assert totals["steps"] > 0 and totals["preemptions"] > 0  # the workloads do put the pool under pressure


def test_the_simulation_catches_a_scheduler_that_forgets_to_copy_on_write(monkeypatch):
    """The checks have teeth: a scheduler that drops its copy-on-write pairs is caught at once."""
    from kvpage.core.scheduler import Scheduler

    real = Scheduler.schedule

    def no_copies(self):
        out = real(self)
        out.copies.clear()
        return out

    monkeypatch.setattr(Scheduler, "schedule", no_copies)
    caught = 0
    for seed in range(40):
        try:
            Simulation(make_workload(seed)).run()
        except SimulationError as e:
            assert "attends to" in str(e)
            caught += 1
    assert caught > 0
