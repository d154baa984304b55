"""The GPU's KV budget by hand (the profiling itself needs a GPU: tests/engine/test_gpu.py)."""

from __future__ import annotations

import pytest

from kvpage import LLM
from kvpage.config import EngineConfig
from kvpage.worker.gpu_memory import kv_cache_budget

GiB = 2**30


def test_budget_is_the_share_less_other_processes_and_the_peak():
    # 80 GiB device, 90%: 72 GiB; another process holds 2, weights + the largest step peak at 6
    assert kv_cache_budget(80 * GiB, 2 * GiB, 6 * GiB, 0.9) == int(80 * GiB * 0.9) - 8 * GiB
    assert kv_cache_budget(10 * GiB, 0, 1 * GiB, 1.0) == 9 * GiB


def test_nothing_left_is_a_clear_error():
    with pytest.raises(ValueError, match="leaves no memory for the KV cache"):
        kv_cache_budget(16 * GiB, 10 * GiB, 5 * GiB, 0.9)


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, True, "0.9"])
def test_utilization_out_of_range_names_the_field(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=bad)


def test_an_unknown_device_names_the_field():
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        LLM("smollm2", device="tpu")
