"""The name of a full block's content: a chain hash, so a block only matches when everything before
it matches:

    h0 = H(None, tokens[0:B],  extra0)      extra0 holds the request's cache_salt, if any, and the
                                            KV-cache group past the first (kv_spec.py)
    h1 = H(h0,   tokens[B:2B], ())
    h2 = H(h1,   tokens[2B:3B], ())

H is SHA-256 over a fixed, unambiguous encoding. A registered block carries its `CacheKey`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

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


def block_digests(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, group: int = 0):
    """The chain digests of `token_ids`' full blocks, in order (lazily: a lookup may stop early)."""
    parent = None
    for i in range(len(token_ids) // block_size):
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block(parent, chunk, extra_keys_for(i, cache_salt, group))
        yield parent


def extra_keys_for(block_index: int, cache_salt: str | None, group: int = 0) -> ExtraKeys:
    """The salt and the group enter the first block only; the chain carries them into every later
    block. Group 0's digests are those of a model with one group (a block of another group holds
    other layers' KV: never the same content)."""
    if block_index:
        return ()
    salt = ("salt", cache_salt) if cache_salt is not None else ()
    return (*salt, "group", group) if group else salt


@dataclass(slots=True, frozen=True)
class CacheKey:
    """Everything that names a full block's content; kept on the block while it is registered."""

    digest: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: ExtraKeys = ()
    group: int = 0  # the KV-cache group whose layers' KV the block holds (named by the chain's first block too)

    def is_consistent(self) -> bool:
        return hash_block(self.parent, self.token_ids, self.extra_keys) == self.digest
