"""Automatic prefix caching: the chain hash -> block map (the hashes themselves: cache_key.py).

Every hit is checked against the block's stored token ids, so even a hash collision cannot hand
out the wrong KV. The map only holds blocks whose KV has been written, or is
written by the step being run (`KVCacheManager.cache_blocks` registers them). A cached block may be
free (ref count 0): it stays hittable until the block pool hands it out again, which evicts it.

Blocks are also indexed by their parent digest, so the block that follows a hit prefix can be found
when only its leading tokens match (`partial`): the prompt's next tokens then copy that block's
first slots instead of recomputing them (prefix_registry.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpage.core.block import Block
from kvpage.core.cache_key import CacheKey


class PrefixCache:
    """Maps a chain hash to the one block registered under it, and counts queries and hits."""

    __slots__ = ("_blocks", "_children", "num_query_tokens", "num_hit_tokens")

    MAX_PARTIAL_CANDIDATES = 64  # the newest children of a prefix a partial lookup compares

    def __init__(self) -> None:
        self._blocks: dict[bytes, Block] = {}
        self._children: dict[bytes | None, dict[bytes, Block]] = {}  # parent digest -> its registered children
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

    def partial(self, parent: bytes | None, token_ids: tuple[int, ...], extra_keys: tuple,
                skip: set[int]) -> tuple[Block, int] | None:  # fmt: skip
        """The registered child of `parent` (with these extra keys) whose stored tokens start with
        the longest run of `token_ids`, and that run's length (at least 1), or None. Blocks whose
        ids are in `skip` are not candidates."""
        children = self._children.get(parent)
        if not children or not token_ids:
            return None
        best, best_n = None, 0
        for i, block in enumerate(reversed(children.values())):
            if i == self.MAX_PARTIAL_CANDIDATES:
                break
            key = block.cache_key
            if key is None or key.extra_keys != extra_keys or block.block_id in skip:
                continue
            n = 0
            for a, b in zip(key.token_ids, token_ids):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = block, n
                if n == len(token_ids):
                    break
        return (best, best_n) if best is not None else None

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
        self._children.setdefault(key.parent, {})[key.digest] = block
        return True

    def evict(self, block: Block) -> None:
        """Forget `block`'s content (it is about to be overwritten)."""
        if block.cache_key is None:
            return
        key = block.cache_key
        del self._blocks[key.digest]
        siblings = self._children[key.parent]
        del siblings[key.digest]
        if not siblings:
            del self._children[key.parent]
        block.cache_key = None
