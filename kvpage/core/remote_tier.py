"""The shared KV tier: prefix blocks in a key-value server (Redis) that every replica reads and writes.

Below the CPU tier (cpu_tier.py). A block is written through when the step that computes its KV has
run (the worker sends it after the forward), so a prefix computed on one replica is a hit on every
other at once, not only after the first evicted it. A prompt's lookup that misses in the GPU pool
and the CPU tier asks this tier for the rest of its leading blocks; each block found is checked and
landed in a CPU-tier block, from where it is restored as a CPU-tier hit.

    key     kvpage:<namespace hash>:<chain digest hex>
    record  MAGIC | namespace | digest | token ids | payload length | CRC-32 of the payload | payload

The namespace names everything that makes two replicas' bytes interchangeable: the weights' content,
the compute and KV dtypes, the block size and the worker's block layout. A record is refused (a
miss, counted) unless its namespace, digest and token ids are the ones asked for and its payload is
whole: a corrupted block, or one written by another model under a colliding key, never reaches
attention. The payload is opaque here (the worker's bytes of the block's K, V and scales).

The server is an outside process that may be down: any error marks the tier down for
`retry_after` seconds (a warning, once per outage), during which lookups miss at once and writes
are dropped; nothing waits on it longer than the store's own timeout.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("kvpage.remote_kv")

MAGIC = b"KVPGB2"
_DIGEST = 32


class KVStore(Protocol):
    """A key-value server (kvpage/kvstore/). Errors are raised as OSError (ConnectionError, TimeoutError)."""

    url: str

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Queue writes (a writer thread sends them); never blocks the caller on the server."""
        ...

    @property
    def num_dropped(self) -> int:
        """Writes given up: the queue was full or the server failed them."""
        ...

    def close(self) -> None: ...


class RefusedBlock(ValueError):
    """A record that is not the block asked for."""


def encode_record(namespace: str, digest: bytes, token_ids: Sequence[int], payload: bytes) -> bytes:
    ns = namespace.encode()
    head = struct.pack(f"<{len(MAGIC)}sH{len(ns)}s{_DIGEST}sH{len(token_ids)}IQI", MAGIC, len(ns), ns, digest,
                       len(token_ids), *token_ids, len(payload), zlib.crc32(payload))  # fmt: skip
    return head + payload


def decode_record(record: bytes, namespace: str, digest: bytes, token_ids: Sequence[int]) -> memoryview:
    """The payload of `record` (a view, not a copy) if it is the block (namespace, digest, tokens) asked
    for and whole; else RefusedBlock. CRC-32 finds damage; the exact checks find another block."""
    view = memoryview(record)
    try:
        pos = len(MAGIC)
        if bytes(view[:pos]) != MAGIC:
            raise RefusedBlock("not a kvpage block record")
        (n,) = struct.unpack_from("<H", view, pos)
        pos += 2
        if bytes(view[pos : pos + n]).decode(errors="replace") != namespace:
            raise RefusedBlock("written by another model or KV layout")
        pos += n
        if bytes(view[pos : pos + _DIGEST]) != digest:
            raise RefusedBlock("another block's digest")
        pos += _DIGEST
        (t,) = struct.unpack_from("<H", view, pos)
        pos += 2
        tokens = struct.unpack_from(f"<{t}I", view, pos)
        pos += 4 * t
        if tuple(tokens) != tuple(token_ids):
            raise RefusedBlock("its token ids are not the prompt's")
        length, checksum = struct.unpack_from("<QI", view, pos)
        pos += 12
    except struct.error as e:
        raise RefusedBlock(f"truncated record ({e})") from None
    payload = view[pos:]
    if len(payload) != length or zlib.crc32(payload) != checksum:
        raise RefusedBlock("its payload is damaged")
    return payload


@dataclass(slots=True)
class RemoteStats:
    hit_blocks: int = 0  # blocks found and landed in the CPU tier
    stored_blocks: int = 0  # blocks sent to the server
    refused_blocks: int = 0  # records that failed the check
    errors: int = 0  # failed calls to the server (each marks the tier down for a while)
    up: bool = True


class RemoteTier:
    def __init__(
        self,
        store: KVStore,
        namespace: str,
        *,
        retry_after: float = 5.0,
        fetch_chunk: int = 8,
        max_known: int = 1 << 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv_store = store
        self.namespace = namespace
        self._prefix = f"kvpage:{hashlib.sha256(namespace.encode()).hexdigest()[:16]}:"
        self.retry_after = retry_after
        self.fetch_chunk = fetch_chunk
        self.stats = RemoteStats()
        self._down_until = 0.0
        self._clock = clock
        self._known: OrderedDict[bytes, None] = OrderedDict()  # digests this process wrote or read there
        self._max_known = max_known

    def key(self, digest: bytes) -> str:
        return self._prefix + digest.hex()

    @property
    def available(self) -> bool:
        return self._clock() >= self._down_until

    def knows(self, digest: bytes) -> bool:
        """Whether the server is known to hold this block (written or read by this process)."""
        return digest in self._known

    def fetch(self, blocks: Sequence[tuple[bytes, tuple[int, ...]]]) -> list[memoryview]:
        """Payloads of the leading `blocks` (digest, token ids) the server holds, each checked; stops at
        the first missing or refused one."""
        out: list[memoryview] = []
        if not blocks or not self.available:
            return out
        for start in range(0, len(blocks), self.fetch_chunk):
            chunk = blocks[start : start + self.fetch_chunk]
            records = self._call(self.kv_store.get_many, [self.key(d) for d, _ in chunk])
            if records is None:
                return out
            for (digest, tokens), record in zip(chunk, records, strict=True):
                if record is None:
                    self._known.pop(digest, None)  # gone (the server evicted it): written again when computed
                    return out
                try:
                    out.append(decode_record(record, self.namespace, digest, tokens))
                except RefusedBlock as e:
                    self.stats.refused_blocks += 1
                    log.warning("remote KV tier: block %s refused: %s", digest.hex()[:16], e)
                    return out
                self._remember(digest)
        return out

    def store(self, blocks: Sequence[tuple[bytes, tuple[int, ...], bytes]]) -> None:
        """Write (digest, token ids, payload) blocks through (queued; the store's thread sends them)."""
        if not blocks or not self.available:
            return
        items = [(self.key(d), encode_record(self.namespace, d, t, p)) for d, t, p in blocks]
        if self._call(self.kv_store.put_many, items) is not None:
            self.stats.stored_blocks += len(blocks)
            for d, _, _ in blocks:
                self._remember(d)

    def note_hits(self, num_blocks: int) -> None:
        self.stats.hit_blocks += num_blocks

    def _remember(self, digest: bytes) -> None:
        self._known[digest] = None
        self._known.move_to_end(digest)
        if len(self._known) > self._max_known:
            self._known.popitem(last=False)

    def _call(self, fn, arg):
        try:
            result = fn(arg)
        except OSError as e:
            self.stats.errors += 1
            if self.stats.up:
                log.warning("remote KV tier %s unreachable (%s): skipped, retrying every %.0f s",
                            self.kv_store.url, e, self.retry_after)  # fmt: skip
            self.stats.up = False
            self._down_until = self._clock() + self.retry_after
            return None
        if not self.stats.up:
            log.warning("remote KV tier %s is back", self.kv_store.url)
            self.stats.up = True
        return result if result is not None else True

    def close(self) -> None:
        self.kv_store.close()
