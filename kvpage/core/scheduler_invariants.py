"""The scheduler's invariants: every request sits in exactly the queue its status names, with the
blocks its status implies, and the KV-cache manager holds no sequence that no request owns."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kvpage.core.invariants import check
from kvpage.core.kv_cache_manager import KVCacheManager
from kvpage.core.request import Request, RequestStatus


def check_scheduler(kv: KVCacheManager, requests: Mapping[str, Request], running: Collection[Request],
                    waiting: Collection[Request], swapped: Collection[Request]) -> None:  # fmt: skip
    queues = {RequestStatus.RUNNING: running, RequestStatus.WAITING: waiting, RequestStatus.SWAPPED: swapped}
    listed = [r for q in queues.values() for r in q]
    check(len(listed) == len({id(r) for r in listed}) == len(requests), "a request is queued twice or lost")
    held = set()
    for req in listed:
        check(req in queues[req.status], lambda: f"{req.request_id}: status {req.status} but queued elsewhere")
        check(requests.get(req.request_id) is req, lambda: f"{req.request_id}: not in the request map")
        check(all(s.index == i for i, s in enumerate(req.sequences)), lambda: f"{req.request_id}: sequence indices")
        check(bool(req.live_sequences), lambda: f"{req.request_id}: queued with no live sequence")
        check(req.status is not RequestStatus.WAITING or not req.live_sequences[0].parked,
              lambda: f"{req.request_id}: waits with its lead parked")  # fmt: skip
        for seq in req.live_sequences:
            has = kv.has_sequence(seq.key)
            check(not seq.parked or req.independent, lambda: f"{seq.key}: parked, but its request is a gang")
            if seq.parked:  # no GPU block: none, or swapped out (never while its request waits)
                check(not has or (kv.is_swapped(seq.key) and req.status is not RequestStatus.WAITING),
                      lambda: f"{seq.key}: parked with GPU blocks")  # fmt: skip
                if has:
                    held.add(seq.key)
                continue
            check(
                has == (req.status is not RequestStatus.WAITING), lambda: f"{seq.key}: blocks for status {req.status}"
            )
            check(0 <= seq.num_computed <= len(seq.token_ids), lambda: f"{seq.key}: computed count")
            if has:
                held.add(seq.key)
                check(kv.is_swapped(seq.key) == (req.status is RequestStatus.SWAPPED), lambda: f"{seq.key}: pool")
                n = kv.num_tokens(seq.key)
                check(seq.num_computed <= n <= len(seq.token_ids), lambda: f"{seq.key}: {n} slots")
                kv.check_window(seq.key, seq.num_computed)
    check(held == set(kv.seq_ids()), "the manager holds sequences no request owns")
