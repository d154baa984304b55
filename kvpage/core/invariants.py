"""Bookkeeping checks: each component recomputes its own state from scratch; `check_all` runs them.

Every component of the KV-cache manager (block pools, the prefix registry, the CPU tier, the swap
space, the eviction windows, the block tables) has a `check_invariants` that raises InvariantError
when a counter or a link disagrees with what it summarises. The engine tests end with them; the
property machines and the scheduler simulation run them after every step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class InvariantError(AssertionError):
    """Bookkeeping is inconsistent (a bug in kvpage, never a user error)."""


def check(ok: bool, message: str | Callable[[], str]) -> None:
    """Raise InvariantError unless `ok`. Messages built in loops come as lambdas (building them all
    would dominate the scheduler simulation)."""
    if not ok:
        raise InvariantError(message if isinstance(message, str) else message())


def check_all(checks: Iterable[Callable[[], None]]) -> None:
    """Run each component's check, in order (the first that fails raises)."""
    for run in checks:
        run()
