"""Latency summaries of the fleet's router and event stream (p50 / p99), for /metrics and the simulation."""

from __future__ import annotations

from collections.abc import Iterable


def quantile(values: Iterable[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank; 0.0 when there are none)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0
