"""A Redis server as the shared KV tier's store, through the `redis` client.

Reads are synchronous (the scheduler waits for a prompt's blocks: one round trip per `fetch_chunk`
blocks, bounded by `timeout`). Writes go to a bounded queue that one thread drains in pipelined
batches, so a step never waits on the server; a full queue or a failed batch drops writes (counted:
a dropped block is only a later miss). Errors come out as OSError, as the tier expects.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Sequence

import redis

log = logging.getLogger("kvpage.remote_kv")


class RedisStore:
    def __init__(self, url: str, *, timeout: float = 1.0, max_queued: int = 1024, ttl: int | None = None) -> None:
        self.url = url
        self.ttl = ttl  # seconds a block lives there (None: until the server's own eviction policy)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._queue: queue.Queue[list[tuple[str, bytes]] | None] = queue.Queue(maxsize=max_queued)
        self._dropped = 0
        self._writer = threading.Thread(target=self._drain, name="kvpage-remote-kv-writer", daemon=True)
        self._writer.start()

    @property
    def num_dropped(self) -> int:
        return self._dropped

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        try:
            return self._client.mget(list(keys))
        except redis.RedisError as e:
            raise ConnectionError(str(e)) from None

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        try:
            self._queue.put_nowait(list(items))
        except queue.Full:
            self._dropped += len(items)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write was sent or dropped (tests, benchmarks); False on timeout."""
        q = self._queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: not q.unfinished_tasks, timeout)

    def _drain(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                pipe = self._client.pipeline(transaction=False)
                for key, value in batch:
                    pipe.set(key, value, ex=self.ttl)
                pipe.execute()
            except redis.RedisError as e:
                self._dropped += len(batch)  # type: ignore[arg-type]
                log.debug("remote KV tier: %d writes dropped (%s)", len(batch), e)  # type: ignore[arg-type]
            finally:
                self._queue.task_done()

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._writer.join(timeout=2.0)
        self._client.close()
