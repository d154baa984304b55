"""What a layer's KV cache must keep, and the groups of layers whose sequences share block tables.

A layer kind is known by which keys a query at position p reads (transformers' masks):

    FullAttention          keys 0 .. p
    SlidingWindow(W)       keys p - W + 1 .. p        (kv > q - W: W keys, the query's own included)
    ChunkedLocal(C)        keys p // C * C .. p        (its own chunk of C tokens)
    RecurrentState         the state after p tokens    (a state-space layer: Mamba-2's conv and SSM state)

A recurrent layer reads no keys but a fixed-size state: its group's block i holds the state after the
last token written into block i (the snapshot at the block's end once the block is full, the running
state while it is the last, partial one), so it follows the rules of a window of two tokens: the token
at p reads the state in the block of token p - 1, blocks before that one are released, and a prefix hit
of k blocks needs block k - 1 only. A full block's state never changes again (it is cached and shared
like a KV block); a shared partial one is copied before a sibling writes to it, as KV is.

`first_visible(p)` never decreases with p, so once `n` tokens are computed no later query reads a key
before `first_visible(n)`: the blocks wholly before it can be released (`num_releasable`), and a
prefix hit of `h` tokens needs only the blocks from `first_visible(h)` on (`needed_from`).

Layers of one spec form groups of equal size (`group_layers`); each sequence has one block table per
group, all over one pool of block ids. A block id names one page: the same slot in each of the
group's layers' tensors (`KVGroup.slot_of`), so every group's block costs the same bytes and one free
list serves them all (vLLM's hybrid allocator works this way). SmolLM2's 30 full-attention layers are
one group of 30: the same blocks as before groups existed.

No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class FullAttention:
    kind: ClassVar[str] = "full"

    def first_visible(self, pos: int) -> int:
        return 0

    def describe(self) -> str:
        return "full attention"


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    window: int  # keys a query reads, its own included (transformers' `sliding_window`)
    kind: ClassVar[str] = "sliding"

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(f"a sliding window needs a window of at least 1 token, got {self.window!r}")

    def first_visible(self, pos: int) -> int:
        return max(0, pos - self.window + 1)

    def describe(self) -> str:
        return f"sliding window of {self.window} tokens"


@dataclass(frozen=True, slots=True)
class ChunkedLocal:
    chunk: int  # a query reads the keys of its own chunk of `chunk` tokens (Llama 4's attention_chunk_size)
    kind: ClassVar[str] = "chunked"

    def __post_init__(self) -> None:
        if not isinstance(self.chunk, int) or isinstance(self.chunk, bool) or self.chunk < 1:
            raise ValueError(f"chunked attention needs chunks of at least 1 token, got {self.chunk!r}")

    def first_visible(self, pos: int) -> int:
        return pos // self.chunk * self.chunk

    def describe(self) -> str:
        return f"chunks of {self.chunk} tokens"


@dataclass(frozen=True, slots=True)
class RecurrentState:
    kind: ClassVar[str] = "state"

    def first_visible(self, pos: int) -> int:
        return max(0, pos - 1)  # the state left by the token before

    def describe(self) -> str:
        return "a recurrent state (a snapshot at each block's end)"


LayerSpec = FullAttention | SlidingWindow | ChunkedLocal | RecurrentState
FULL = FullAttention()


def num_releasable(spec: LayerSpec, num_computed: int, block_size: int) -> int:
    """Leading blocks no query after the first `num_computed` tokens reads: wholly before
    `first_visible(num_computed)`."""
    return spec.first_visible(num_computed) // block_size


def needed_from(spec: LayerSpec, num_tokens: int, block_size: int) -> int:
    """The first block a sequence of `num_tokens` computed tokens still needs (the blocks before it
    may be holes): what a prefix hit of `num_tokens` tokens must find from."""
    return num_releasable(spec, num_tokens, block_size)


def max_live_blocks(spec: LayerSpec, block_size: int, num_new_tokens: int = 1) -> int | None:
    """The most blocks a sequence of this spec holds while a step computes `num_new_tokens` tokens
    after releasing what its computed tokens no longer need; None: no bound (full attention). A
    window's keys from `first_visible(n)` to the step's last token span W - 1 + k tokens starting
    anywhere in a block: (L - 2) // B + 2 blocks for L tokens. A chunk starts where chunks do, so
    its count repeats every lcm(C, B) tokens: counted over one such period."""
    if isinstance(spec, FullAttention):
        return None
    bs, k = block_size, num_new_tokens
    if isinstance(spec, SlidingWindow | RecurrentState):  # (a state: a window of two tokens)
        return ((spec.window if isinstance(spec, SlidingWindow) else 2) - 1 + k - 2) // bs + 2
    period = spec.chunk * bs // math.gcd(spec.chunk, bs)
    return max(-(-(n + k) // bs) - num_releasable(spec, n, bs) for n in range(period))


def longest_hit(spec: LayerSpec, present: Sequence[bool], block_size: int, upto: int | None = None) -> int:
    """The most leading full blocks k (k <= upto) such that a sequence could resume after k blocks:
    every block from `needed_from(k * block_size)` to k is `present`. Full attention: the leading
    run; a window: the last such k, searched from the right (holes before it are fine)."""
    upto = len(present) if upto is None else min(upto, len(present))
    if isinstance(spec, FullAttention):
        k = 0
        while k < upto and present[k]:
            k += 1
        return k
    for k in range(upto, 0, -1):
        start = needed_from(spec, k * block_size, block_size)
        if all(present[start:k]):
            return k
    return 0


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers of one spec that share block tables: `layers[j]` keeps its KV in tensor slot j."""

    index: int
    spec: LayerSpec
    layers: tuple[int, ...]

    def slot_of(self, layer: int) -> int:
        return self.layers.index(layer)


MAX_PADDING = 0.05  # the share of a model's layers a page may leave unused (group_layers)


def group_layers(specs: Sequence[LayerSpec], max_padding: float = MAX_PADDING) -> tuple[KVGroup, ...]:
    """The groups of a model whose layer i has spec `specs[i]`: the layers of each spec in order, cut
    into groups of one size (the page: one tensor slot per layer of a group), a spec whose count the size
    does not divide ending with a smaller group, its page partly unused. The size is the largest, up to the
    fewest layers any spec has, whose unused slots stay within `max_padding` of the layers: vLLM takes the
    fewest count and pads, which leaves a Gemma 3 27B (10 global layers, 52 local) 8 slots of 62 unused in
    every block (groups of 10); groups of 5 leave 3. Full-attention groups first (a prefix hit is searched
    over them first), then by first layer."""
    if not specs:
        raise ValueError("a model needs at least one layer")
    by_spec: dict[LayerSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    counts = [len(v) for v in by_spec.values()]
    size = next(s for s in range(min(counts), 0, -1) if sum(-c % s for c in counts) <= max_padding * len(specs))
    cut = [layers[s : s + size] for layers in by_spec.values() for s in range(0, len(layers), size)]
    cut.sort(key=lambda layers: (not isinstance(specs[layers[0]], FullAttention), layers[0]))
    return tuple(KVGroup(g, specs[layers[0]], tuple(layers)) for g, layers in enumerate(cut))


def page_layers(groups: Sequence[KVGroup]) -> int:
    """Tensor slots per block id: the largest group's layer count."""
    return max(len(g.layers) for g in groups)


def layer_specs(num_layers: int, *, sliding_window: int | None = None, layer_types: Sequence[str] | None = None,
                attention_chunk_size: int | None = None) -> tuple[LayerSpec, ...]:  # fmt: skip
    """Each layer's spec from a config's facts: transformers' `layer_types` ("full_attention",
    "sliding_attention", "chunked_attention") where the config has them, else one spec for every
    layer (a window when `sliding_window` is set)."""
    if layer_types is None:
        spec: LayerSpec = SlidingWindow(sliding_window) if sliding_window else FULL
        return (spec,) * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types names {len(layer_types)} layers but the model has {num_layers}")
    out: list[LayerSpec] = []
    for i, t in enumerate(layer_types):
        if t == "full_attention":
            out.append(FULL)
        elif t == "sliding_attention":
            if not sliding_window:
                raise ValueError(f"layer {i} is sliding_attention but the config sets no sliding_window")
            out.append(SlidingWindow(sliding_window))
        elif t in ("linear_attention", "mamba"):  # (Bamba's and Mamba-2's name for a state-space layer)
            out.append(RecurrentState())
        elif t == "chunked_attention":
            if not attention_chunk_size:
                raise ValueError(f"layer {i} is chunked_attention but the config sets no attention_chunk_size")
            out.append(ChunkedLocal(attention_chunk_size))
        else:
            raise ValueError(f"layer {i}: layer type {t!r} is not supported (full_attention, sliding_attention, "
                             "chunked_attention, linear_attention)")  # fmt: skip
    return tuple(out)
