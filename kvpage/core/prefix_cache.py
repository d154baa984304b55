"""Automatic prefix caching: content hashes of full blocks and the hash -> block map.

A full block is named by a chain hash, so a block only matches when everything before it matches:

    h0 = H(None, tokens[0:B],  extra0)      extra0 holds the request's cache_salt, if any
    h1 = H(h0,   tokens[B:2B], ())
    h2 = H(h1,   tokens[2B:3B], ())

H is SHA-256, and every hit is still checked against the block's stored token ids, so even a
collision cannot hand out the wrong KV. The map only holds blocks whose KV has been written, or is
written by the step being run (`KVCacheManager.cache_blocks` registers them). A cached block may be
free (ref count 0): it stays hittable until the block pool hands it out again, which evicts it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpage.core.block import Block

ExtraKeys = tuple[str | int, ...]


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: ExtraKeys = ()) -> bytes:
    """SHA-256 of (parent hash, token ids, extra keys), in a fixed, unambiguous encoding."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else b"\x00" * 32)
    h.update(len(token_ids).to_bytes(4, "little"))
    tokens = array("q", token_ids)
    if sys.byteorder != "little":
        tokens.byteswap()
    h.update(tokens.tobytes())
    h.update(json.dumps(list(extra_keys)).encode() if extra_keys else b"[]")  # every block but a salted first
    return h.digest()


def extra_keys_for(block_index: int, cache_salt: str | None) -> ExtraKeys:
    """The salt enters the first block only; the chain carries it into every later block."""
    if block_index == 0 and cache_salt is not None:
        return ("salt", cache_salt)
    return ()


@dataclass(slots=True, frozen=True)
class CacheKey:
    """Everything that names a full block's content; kept on the block while it is registered."""

    digest: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: ExtraKeys = ()

    def is_consistent(self) -> bool:
        return hash_block(self.parent, self.token_ids, self.extra_keys) == self.digest


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
