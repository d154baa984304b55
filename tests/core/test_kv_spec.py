"""Layer specs and KV-cache groups (kvpage/core/kv_spec.py): exact values, and every rule checked
against the masks themselves (transformers' definitions, written out here)."""

from __future__ import annotations

import pytest

from kvpage.core.block import cdiv
from kvpage.core.kv_spec import (
    FULL,
    ChunkedLocal,
    KVGroup,
    RecurrentState,
    SlidingWindow,
    group_layers,
    layer_specs,
    longest_hit,
    max_live_blocks,
    needed_from,
    num_releasable,
    page_layers,
)


def reads(spec, q: int, k: int) -> bool:
    """transformers' masks: causal, and the window's / the chunk's overlay."""
    if k > q:
        return False
    if isinstance(spec, SlidingWindow):
        return k > q - spec.window
    if isinstance(spec, ChunkedLocal):
        return k // spec.chunk == q // spec.chunk
    if isinstance(spec, RecurrentState):  # the state left by the token before (its block), and its own
        return k >= q - 1
    return True


SPECS = [FULL, SlidingWindow(1), SlidingWindow(5), SlidingWindow(16), SlidingWindow(32), SlidingWindow(33),
         ChunkedLocal(4), ChunkedLocal(16), ChunkedLocal(24), RecurrentState()]  # fmt: skip


@pytest.mark.parametrize("spec", SPECS, ids=repr)
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_what_is_released_is_read_by_no_later_query_and_the_bound_is_exact(spec, bs):
    for k in (1, 3, 16):
        worst = 0
        for n in range(0, 120):
            first = num_releasable(spec, n, bs)
            # nothing a query of this step or later reads is released (a query reads an interval of keys)
            assert not any(reads(spec, q, first * bs - 1) for q in range(n, n + 40)) or not first
            # and the first block kept is read by the step's first query (nothing kept needlessly)
            assert any(reads(spec, n, key) for key in range(first * bs, min((first + 1) * bs, n + 1)))
            worst = max(worst, cdiv(n + k, bs) - first)
        bound = max_live_blocks(spec, bs, k)
        if spec is FULL:
            assert bound is None
        else:
            assert worst == bound, (spec, bs, k)  # reached, never passed


def test_exact_values():
    w = SlidingWindow(32)
    assert [w.first_visible(p) for p in (0, 31, 32, 47, 48)] == [0, 0, 1, 16, 17]
    assert [num_releasable(w, n, 16) for n in (0, 32, 47, 48, 49, 100)] == [0, 0, 1, 1, 1, 4]
    assert max_live_blocks(w, 16) == 3 and max_live_blocks(w, 16, 16) == 4  # ceil(W / B) + 1 for a decode
    c = ChunkedLocal(32)
    assert [c.first_visible(p) for p in (0, 31, 32, 63, 64)] == [0, 0, 32, 32, 64]
    assert [num_releasable(c, n, 16) for n in (31, 32, 63, 64)] == [0, 2, 2, 4]
    assert needed_from(FULL, 1000, 16) == 0 and needed_from(w, 64, 16) == 2
    r = RecurrentState()  # block i holds the state after block i's last token written
    assert [num_releasable(r, n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 0, 0, 1, 1, 2]
    assert [needed_from(r, k * 16, 16) for k in range(4)] == [0, 0, 1, 2] and max_live_blocks(r, 16) == 2
    assert longest_hit(r, [False, True, False, False], 16) == 2  # block 1: the state after 32 tokens


def test_bad_specs_name_their_value():
    with pytest.raises(ValueError, match="window of at least 1"):
        SlidingWindow(0)
    with pytest.raises(ValueError, match="chunks of at least 1"):
        ChunkedLocal(True)


def test_longest_hit_full_is_the_leading_run_a_window_the_last_resumable_point():
    present = [True, True, False, True, True, True, False]
    assert longest_hit(FULL, present, 16) == 2
    # W = 32 with 16-token blocks: the query at 16k reads keys 16k - 31 .. 16k, from block k - 2 on
    w = SlidingWindow(32)
    assert [needed_from(w, k * 16, 16) for k in range(7)] == [0, 0, 0, 1, 2, 3, 4]
    assert longest_hit(w, present, 16) == 6  # blocks 4 and 5 present; 0..3 may be holes
    assert longest_hit(w, present, 16, upto=5) == 5  # blocks 3, 4
    assert longest_hit(w, present, 16, upto=3) == 2  # k = 3 needs blocks 1, 2 (2 is missing); k = 2: 0, 1
    assert longest_hit(w, [False, False, True], 16) == 0  # k = 3 needs 1, 2; k = 2 needs 0, 1; k = 1 needs 0
    assert longest_hit(SlidingWindow(1), [False, False, False], 16) == 3  # a window of one key: nothing before
    # at a chunk's start nothing before it is read: a hit there needs no block at all
    assert longest_hit(ChunkedLocal(32), [False, False, False, False], 16) == 4
    assert longest_hit(ChunkedLocal(32), [True, False, True, False, False], 16) == 4  # k = 5 needs block 4
    assert longest_hit(FULL, [], 16) == 0


def test_longest_hit_agrees_with_the_masks():
    import itertools

    for spec in SPECS:
        for present in itertools.product([False, True], repeat=6):
            k = longest_hit(spec, present, 4)
            # resuming after k blocks: every key the next query (position 4k) and later read below 4k is present
            for kk in range(k + 1, 7):
                needed = {key // 4 for key in range(4 * kk) if reads(spec, 4 * kk, key)}
                assert not all(present[b] for b in needed), (spec, present, kk)
            needed = {key // 4 for q in range(4 * k, 4 * k + 40) for key in range(4 * k) if reads(spec, q, key)}
            assert all(present[b] for b in needed), (spec, present, k)


def test_groups_one_spec_is_one_group_of_every_layer():
    (g,) = group_layers([FULL] * 30)
    assert g == KVGroup(0, FULL, tuple(range(30))) and page_layers([g]) == 30 and g.slot_of(29) == 29


def test_groups_of_alternating_and_five_to_one_layers():
    w = SlidingWindow(128)
    gpt_oss = group_layers([w, FULL] * 12)
    assert [(g.spec, g.layers[:3]) for g in gpt_oss] == [(FULL, (1, 3, 5)), (w, (0, 2, 4))]
    assert page_layers(gpt_oss) == 12
    gemma3 = group_layers(([w] * 5 + [FULL]) * 2)  # 10 local, 2 global: groups of 2
    assert [g.layers for g in gemma3] == [(5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert [g.spec for g in gemma3] == [FULL] + [w] * 5 and [g.index for g in gemma3] == list(range(6))
    assert gemma3[3].slot_of(6) == 1


def test_groups_whose_sizes_do_not_divide_end_with_a_smaller_group_within_the_padding_allowed():
    w = SlidingWindow(64)
    groups = group_layers([FULL] * 7 + [w] * 3, max_padding=0.2)  # Qwen2 with max_window_layers=7 of 10
    assert [len(g.layers) for g in groups] == [3, 3, 1, 3]  # 2 slots of 10 unused: 20%
    assert page_layers(groups) == 3
    assert page_layers(group_layers([FULL] * 7 + [w] * 3)) == 1  # (within 5%: groups of one layer)
    gemma3_27b = [FULL if (i + 1) % 6 == 0 else w for i in range(62)]  # 10 global, 52 local
    groups = group_layers(gemma3_27b)  # groups of 10 would leave 8 slots of 62 unused, of 6 four: 5 leave 3
    assert page_layers(groups) == 5 and [len(g.layers) for g in groups].count(2) == 1 and len(groups) == 13
    with pytest.raises(ValueError, match="at least one layer"):
        group_layers([])


def test_layer_specs_from_config_facts():
    assert layer_specs(3) == (FULL,) * 3
    assert layer_specs(2, sliding_window=4096) == (SlidingWindow(4096),) * 2
    types = ["sliding_attention", "full_attention", "chunked_attention"]
    assert layer_specs(3, sliding_window=8, attention_chunk_size=16, layer_types=types) == (
        SlidingWindow(8), FULL, ChunkedLocal(16))  # fmt: skip
    with pytest.raises(ValueError, match="names 3 layers but the model has 4"):
        layer_specs(4, layer_types=types)
    with pytest.raises(ValueError, match="sets no sliding_window"):
        layer_specs(1, layer_types=["sliding_attention"])
    assert layer_specs(2, layer_types=["linear_attention", "full_attention"]) == (RecurrentState(), FULL)
    with pytest.raises(ValueError, match="'moe_attention' is not supported"):
        layer_specs(1, layer_types=["moe_attention"])


def test_a_groups_digests_are_its_own_and_group_zero_keeps_the_one_group_digests():
    from kvpage.core.cache_key import block_digests, extra_keys_for, hash_block

    tokens = list(range(40))
    g0 = list(block_digests(tokens, 16))
    assert g0 == list(block_digests(tokens, 16, group=0))
    assert g0[0] == hash_block(None, tokens[:16], ())  # what every digest was before groups
    g1, g2 = list(block_digests(tokens, 16, group=1)), list(block_digests(tokens, 16, group=2))
    assert len({*g0, *g1, *g2}) == 6  # no digest shared between groups, the chain carries the group
    assert extra_keys_for(0, "s", 3) == ("salt", "s", "group", 3) and extra_keys_for(1, "s", 3) == ()
    assert list(block_digests(tokens, 16, "s", 1)) != g1
