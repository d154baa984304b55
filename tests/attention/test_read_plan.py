"""The one place that picks how attention reads each sequence (backend.read_path) and the order in
which a sequence's mass comes back (ReadPlan.reported_mass)."""

from __future__ import annotations

import torch

from kvpage.attention import AttentionMetadata
from kvpage.attention.backend import BOUNDED, DEMOTED, DENSE, MASS, decodes_path, read_path

BS = 16


def test_a_step_that_asks_nothing_more_reads_every_sequence_densely():
    meta = AttentionMetadata.build([1, 1, 5], [40, 17, 30], [[0, 1, 2], [3, 4], [5, 6]], BS)
    assert meta.reads.empty
    assert [read_path(meta, i, bounded=True) for i in range(3)] == [DENSE] * 3
    assert decodes_path(meta, bounded=True) == DENSE


def test_each_sequence_gets_the_path_of_what_it_asks():
    # decodes: 0 within a budget of 2 of its 3 blocks, 1 with a budget covering its 2 blocks, 2 wanting
    # H2O's mass, 3 with a demoted block; chunk 4 wants mass, chunk 5 a budget (prefills read in full)
    meta = AttentionMetadata.build(
        [1, 1, 1, 1, 4, 4], [40, 17, 20, 20, 30, 30], [[0, 1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]], BS,
        want_mass=[False, False, True, False, True, False], read_budgets=[32, 32, None, None, None, 16],
        demoted=[[], [], [], [("int8", 3)], [], []],
    )  # fmt: skip
    assert [read_path(meta, i, bounded=True) for i in range(6)] == [BOUNDED, DENSE, MASS, DEMOTED, MASS, DENSE]
    assert read_path(meta, 0, bounded=False) == DENSE  # a layer without key bounds reads it all
    assert decodes_path(meta, bounded=True) == DEMOTED  # the most demanding of the decodes'
    meta = AttentionMetadata.build([1, 1], [40, 17], [[0, 1, 2], [3, 4]], BS, read_budgets=[32, 32])
    assert decodes_path(meta, bounded=True) == BOUNDED and decodes_path(meta, bounded=False) == DENSE


def test_mass_comes_back_table_first_then_demoted_blocks():
    meta = AttentionMetadata.build([1], [32], [[4, 5]], BS, want_mass=[True], demoted=[[("int8", 0), ("int4", 2)]])
    reads = meta.reads
    reads.add_mass(0, torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
    assert reads.reported_mass(0, 2, divisor=2.0) == [0.5, 1.0, 1.5, 2.0]
