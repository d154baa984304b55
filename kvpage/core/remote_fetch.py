"""Fetches from the shared tier, made between steps: the scheduler never waits on the network.

A lookup (prefix_registry.py: `find`) that misses in the GPU pool and the CPU tier asks for the rest
of the prompt's leading blocks here; the request waits one step (`CachedPrefix.awaiting_fetch`), and
before the next schedule the engine calls `fetch`, which reads them from the shared tier
(remote_tier.py) and lands what it finds in the CPU tier, where the next lookup hits them:

    step n      schedule: R misses locally -> asked, R waits        (no network call)
    between     fetch: one read of R's blocks, landed in the CPU tier, pinned until step n+1 ends
    step n+1    schedule: R hits them in the CPU tier -> restored

A block asked once is not asked again for `ASK_STEPS` steps (found or not), so a request waits at
most one step for a fetch, and one whose blocks the tier does not hold runs without them; with no
fetch between steps (a driver without a network), the same rule lets it run on the next schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpage.core.cache_key import CacheKey, extra_keys_for
from kvpage.core.cpu_tier import CpuTier
from kvpage.core.remote_tier import RemoteTier

ASK_STEPS = 8  # steps a block asked for is not asked again


@dataclass(slots=True, frozen=True)
class Ask:
    """Leading blocks of one prompt to fetch: (digest, token ids) each, from table index `start`
    (whose parent digest is `parent`), under `cache_salt`."""

    start: int
    parent: bytes | None
    blocks: tuple[tuple[bytes, tuple[int, ...]], ...]
    cache_salt: str | None


class RemoteFetches:
    def __init__(self, remote: RemoteTier, tier: CpuTier) -> None:
        self.remote, self.tier = remote, tier
        self._pending: list[Ask] = []
        self._asked: dict[bytes, int] = {}  # digest -> the step it was asked at
        self._step = 0

    def ask(self, start: int, parent: bytes | None, blocks: Sequence[tuple[bytes, tuple[int, ...]]],
            cache_salt: str | None) -> bool:  # fmt: skip
        """Queue a fetch of `blocks` unless the first was asked lately or the tier is down: whether
        the caller should wait a step for it."""
        if not blocks or not self.remote.available or blocks[0][0] in self._asked:
            return False
        self._pending.append(Ask(start, parent, tuple(blocks), cache_salt))
        for digest, _ in blocks:
            self._asked[digest] = self._step
        return True

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def fetch(self) -> int:
        """Read every queued ask from the shared tier and land what it holds in the CPU tier. Returns
        the blocks landed."""
        landed = 0
        pending, self._pending = self._pending, []
        for ask in pending:
            parent = ask.parent
            for i, ((digest, chunk), payload) in enumerate(zip(ask.blocks, self.remote.fetch(ask.blocks)), ask.start):
                key = CacheKey(digest, parent, chunk, extra_keys_for(i, ask.cache_salt))
                if self.tier.lookup(digest, chunk) is None and self.tier.land(key, payload) is None:
                    break  # every tier block is pinned
                parent = digest
                landed += 1
        self.remote.note_hits(landed)
        return landed

    def end_step(self) -> None:
        """A step ended: asks older than ASK_STEPS may be made again (another replica may have
        written those blocks since)."""
        self._step += 1
        old = self._step - ASK_STEPS
        if self._asked and next(iter(self._asked.values())) <= old:
            self._asked = {d: s for d, s in self._asked.items() if s > old}
