"""Key-value servers behind the shared KV tier (kvpage/core/remote_tier.py): `open_store(url)`."""

from __future__ import annotations

from kvpage.core.remote_tier import KVStore


def open_store(url: str) -> KVStore:
    """The store a `--remote-kv` URL names: redis://HOST:PORT[/DB] (rediss:// with TLS)."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme in ("redis", "rediss"):
        from kvpage.kvstore.redis_store import RedisStore

        return RedisStore(url)
    raise ValueError(f"remote_kv must be a redis://HOST:PORT URL, got {url!r}")
