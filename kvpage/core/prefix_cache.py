"""Automatic prefix caching: the chain hash -> block map (the hashes themselves: cache_key.py).

Every hit is checked against the block's stored token ids, so even a hash collision cannot hand
out the wrong KV. The map only holds blocks whose KV has been written, or is
written by the step being run (`KVCacheManager.cache_blocks` registers them). A cached block may be
free (ref count 0): it stays hittable until the block pool hands it out again, which evicts it.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpage.core.block import Block
from kvpage.core.cache_key import CacheKey


class PrefixCache:
    """Maps a chain hash to the one block registered under it, and counts queries and hits."""

    __slots__ = ("_blocks", "num_query_tokens", "num_hit_tokens")

    def __init__(self) -> None:
        self._blocks: dict[bytes, Block] = {}
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def items(self) -> Iterator[tuple[bytes, Block]]:
        return iter(self._blocks.items())

    def lookup(self, digest: bytes, token_ids: tuple[int, ...]) -> Block | None:
        """The block registered under `digest`, only if its stored tokens are exactly `token_ids`."""
        block = self._blocks.get(digest)
        if block is None or block.cache_key is None or block.cache_key.token_ids != token_ids:
            return None
        return block

    def chain(self, block: Block) -> list[Block] | None:
        """The registered blocks from the first of `block`'s prefix down to `block` itself, or None
        when one of them is no longer registered (its tokens are then unknown here)."""
        out = [block]
        while out[-1].cache_key is not None and out[-1].cache_key.parent is not None:
            parent = self._blocks.get(out[-1].cache_key.parent)
            if parent is None:
                return None
            out.append(parent)
        if out[-1].cache_key is None:
            return None
        return out[::-1]

    def register(self, block: Block, key: CacheKey) -> bool:
        """Register `block` under `key`. False (and nothing changes) when another block already
        holds that content: the duplicate simply stays unregistered and is reused as a plain block."""
        if key.digest in self._blocks or block.cache_key is not None:
            return False
        block.cache_key = key
        self._blocks[key.digest] = block
        return True

    def evict(self, block: Block) -> None:
        """Forget `block`'s content (it is about to be overwritten)."""
        if block.cache_key is None:
            return
        del self._blocks[block.cache_key.digest]
        block.cache_key = None
