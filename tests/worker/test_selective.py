"""CacheBlend's selective recompute (kvpage/worker/selective.py) on its own: which copied rows carry on
past the check layer, the narrowed metadata they run under, and the hidden states put back in place."""

from __future__ import annotations

import pytest
import torch

from kvpage.attention import AttentionMetadata
from kvpage.core.scheduler_output import ScheduledSequence, SeqKey
from kvpage.worker.selective import CHECK_LAYER, selective_recompute

BS, KVH, D = 4, 2, 8


def step(ratio_a: float | None, ratio_b: float | None):
    """One step: a decode (request "d"), then two prompt chunks, "a" (5 copied tokens at position 8)
    and "b" (3 tokens at position 0, copied too when `ratio_b` is not None)."""
    seqs = [
        ScheduledSequence(SeqKey("d", 0), [7], 6, [9, 10]),
        ScheduledSequence(SeqKey("a", 0), [1, 2, 3, 4, 5], 8, [0, 1, 2, 3], select_ratio=ratio_a),
        ScheduledSequence(SeqKey("b", 0), [6, 6, 6], 0, [5], select_ratio=ratio_b),
    ]
    meta = AttentionMetadata.build([1, 5, 3], [7, 13, 3], [s.block_table for s in seqs], BS)
    return seqs, meta


def deviations(values: list[float]) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(before, after) K/V of the candidate rows whose squared deviation is `values` (all in K)."""
    before = (torch.zeros(len(values), KVH, D), torch.zeros(len(values), KVH, D))
    k = torch.zeros(len(values), KVH, D)
    k[:, 0, 0] = torch.tensor(values).sqrt()
    return before, (k, torch.zeros(len(values), KVH, D))


def test_no_entry_asking_means_no_selective_recompute():
    seqs, meta = step(None, None)
    assert selective_recompute(seqs, meta, num_layers=4) is None


def test_the_rows_that_deviate_most_carry_on_as_runs_of_their_own_decodes_first():
    seqs, meta = step(0.4, 0.5)  # a: ceil(0.4 * 5) = 2 of 5 rows; b: ceil(0.5 * 3) = 2 of 3
    sel = selective_recompute(seqs, meta, num_layers=4)
    assert sel.layer == CHECK_LAYER and sel.num_candidates == 8
    assert sel.candidates.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]  # the copied rows of the step's flat batch
    # a's rows (batch rows 1-5) deviate 1, 9, 4, 0, 8: rows 2 and 5 carry on; b's (6-8) 3, 1, 2: rows 6 and 8
    rows, narrowed = sel.narrow(*deviations([1, 9, 4, 0, 8, 3, 1, 2]))
    assert sel.num_kept == 4
    # runs of consecutive kept rows, each a metadata entry; one-row runs (decodes) first, batch order kept
    assert rows.tolist() == [0, 2, 5, 6, 8]
    assert sel.entry_of == [0, 1, 1, 2, 2]
    assert narrowed.query_start_loc == [0, 1, 2, 3, 4, 5] and narrowed.num_decodes == 5
    # each run's last query sees its own position + 1 keys: d at 6, a's rows at 9 and 12, b's at 0 and 2
    assert narrowed.seq_lens_list == [7, 10, 13, 1, 3]
    assert narrowed.block_tables[3, :1].tolist() == [5] and narrowed.block_tables[1, :4].tolist() == [0, 1, 2, 3]
    hidden = torch.arange(5.0)[:, None].expand(5, 3).clone()
    full = sel.widen(hidden)
    assert full[:, 0].tolist() == [0, 0, 1, 0, 0, 2, 3, 0, 4]  # dropped rows stay zero, never read


@pytest.mark.parametrize(("ratio", "kept"), [(0.0, []), (1.0, [1, 2, 3, 4, 5])])
def test_a_ratio_of_nothing_or_everything(ratio, kept):
    seqs, meta = step(ratio, None)
    sel = selective_recompute(seqs, meta, num_layers=4)
    assert sel.candidates.tolist() == [1, 2, 3, 4, 5]
    rows, narrowed = sel.narrow(*deviations([5, 4, 3, 2, 1]))
    assert rows.tolist() == [0, *kept, 6, 7, 8]  # the decode and b's ordinary rows always carry on
    assert sel.num_kept == len(kept)
    assert narrowed.num_tokens == 4 + len(kept)


def test_a_one_layer_model_checks_at_its_only_layer():
    seqs, meta = step(0.5, None)
    assert selective_recompute(seqs, meta, num_layers=1).layer == 0
