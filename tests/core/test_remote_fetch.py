"""The shared tier is read between steps, never inside `schedule()` (core/remote_fetch.py): a request
whose prompt misses locally waits one step while its blocks are fetched, then is admitted with them as
CPU-tier hits; a store that fails costs it the hits, never a stall. The store here is a double of the
outside server (an in-memory dict that counts calls and can fail); every part of kvpage is real."""

from __future__ import annotations

from kvpage.core import KVCacheManager
from kvpage.core.remote_tier import RemoteTier
from kvpage.core.scheduler import Scheduler
from tests.core.test_scheduler import BS, add, seqs, tok

PROMPT = list(range(100, 100 + 3 * BS + 1))  # three full blocks and one token


class StoreDouble:
    """A KVStore (core/remote_tier.py) in memory: `data` shared between replicas, `calls` counted,
    every call raising ConnectionError while `down`."""

    url = "double://"

    def __init__(self, data: dict[str, bytes]) -> None:
        self.data, self.calls, self.down = data, 0, False

    def _call(self) -> None:
        self.calls += 1
        if self.down:
            raise ConnectionError("the double is down")

    def get_many(self, keys):
        self._call()
        return [self.data.get(k) for k in keys]

    def put_many(self, items):
        self._call()
        self.data.update(items)

    @property
    def num_dropped(self) -> int:
        return 0

    def close(self) -> None:
        pass


def replica(data: dict[str, bytes]) -> tuple[Scheduler, StoreDouble, RemoteTier]:
    store = StoreDouble(data)
    remote = RemoteTier(store, "ns", retry_after=3600.0)
    kv = KVCacheManager(16, BS, watermark=0.0, num_tier_blocks=4, remote=remote)
    return Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), store, remote


def step(s: Scheduler, store: StoreDouble, remote: RemoteTier, *updates):
    """One engine step: the fetch between steps, the schedule (no store call in it), the worker's part
    of the write-through (payloads named after the block), the update."""
    s.kv.fetch_remote()
    calls = store.calls
    out = s.schedule()
    assert store.calls == calls  # the scheduler never waits on the network
    remote.store([(d, t, b"kv %d" % b) for b, d, t in out.write_through])
    s.update_from_output(out, {u.request_id: u for u in updates})
    s.check_invariants()
    return out


def test_a_request_waits_one_step_for_its_fetch_then_hits_what_another_replica_wrote():
    data: dict[str, bytes] = {}
    a, store_a, remote_a = replica(data)
    add(a, "a", PROMPT)
    first = step(a, store_a, remote_a)
    assert first.sequences == [] and store_a.calls == 0  # it waits; its blocks are asked, not yet read
    second = step(a, store_a, remote_a, tok("a", (0, 7)))
    assert store_a.calls == 2  # the fetch between the steps (nothing there), then the write-through
    assert seqs(second) == [("a", 0, PROMPT, 0, [0, 1, 2, 3], True)]
    assert sorted(data) == sorted(remote_a.key(d) for _, d, _ in second.write_through) and len(data) == 3

    b, store_b, remote_b = replica(data)
    add(b, "b", PROMPT)
    assert step(b, store_b, remote_b).sequences == []  # waits one step
    out = step(b, store_b, remote_b, tok("b", (0, 7)))
    assert store_b.calls == 1  # one read of its three blocks, between the steps
    assert out.fetched == [(0, b"kv 0"), (1, b"kv 1"), (2, b"kv 2")]  # (tier block, payload)
    assert out.restore == [(0, 0), (1, 1), (2, 2)]  # (tier block, GPU block)
    assert seqs(out) == [("b", 0, PROMPT[3 * BS :], 3 * BS, [0, 1, 2, 3], True)]
    assert remote_b.stats.hit_blocks == 3 and out.write_through == []  # read there: nothing written back


def test_a_store_that_fails_costs_the_hits_never_a_stall():
    data: dict[str, bytes] = {}
    a, store, remote = replica(data)
    store.down = True
    add(a, "a", PROMPT)
    assert step(a, store, remote).sequences == []  # asked: the store is not called in the schedule
    out = step(a, store, remote, tok("a", (0, 7)))
    assert remote.stats.errors == 1 and not remote.available  # the fetch failed, between the steps
    assert seqs(out) == [("a", 0, PROMPT, 0, [0, 1, 2, 3], True)]  # it runs at once, without hits
    assert out.write_through == []  # nothing sent to a store that is down
    add(a, "b", PROMPT[: 2 * BS] + [1, 2, 3, 4, 5])
    out = step(a, store, remote, tok("b", (0, 9)))  # the tier is down: no asking, no waiting
    assert [(q.seq_id.request_id, q.num_computed) for q in out.sequences] == [
        ("a", len(PROMPT)),
        ("b", 2 * BS),
    ]  # (a's blocks, local hits)
    assert store.calls == 1
