"""Turns the scheduler's plain data into the model's tensors: one flat, unpadded batch.

Sequences are reordered decodes first (the attention backend attends all decodes as one batch);
`logits_index` picks the row of each sequence's last token out of the flat hidden states.
A sequence whose policy evicted blocks attends over its resident blocks only: its key count is
`kv_len` (tokens minus the evicted ones) while its positions stay those of the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpage.attention import AttentionMetadata
from kvpage.core.scheduler_output import ScheduledSequence, SeqKey


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # a model of several KV-cache groups: the metadata of the groups after the first (their tables)
    group_metas: list[AttentionMetadata]
    sequences: list[ScheduledSequence]  # in batch order (decodes first)
    logits_index: torch.Tensor  # rows of the last token of each sequence that returns logits
    logits_seq_ids: list[SeqKey]


def build_inputs(scheduled: list[ScheduledSequence], block_size: int, device: torch.device | str) -> ModelInputs:
    seqs = [s for s in scheduled if len(s.token_ids) == 1] + [s for s in scheduled if len(s.token_ids) > 1]
    ids: list[int] = []
    positions: list[int] = []
    logits_rows: list[int] = []
    logits_seq_ids: list[SeqKey] = []
    for s in seqs:
        if not s.token_ids:
            raise ValueError(f"sequence {s.seq_id!r} is scheduled with no tokens")
        ids.extend(s.token_ids)
        positions.extend(range(s.num_computed, s.seq_len))
        if s.return_logits:
            logits_rows.append(len(ids) - 1)
            logits_seq_ids.append(s.seq_id)
    meta = AttentionMetadata.build(
        [len(s.token_ids) for s in seqs], [s.kv_len for s in seqs], [s.block_table for s in seqs], block_size, device,
        want_mass=[s.want_mass for s in seqs], read_budgets=[s.max_read_tokens for s in seqs],
        demoted=[s.cold_blocks for s in seqs],
    )  # fmt: skip
    lens = [len(s.token_ids) for s in seqs]
    group_metas = [
        AttentionMetadata.build(
            lens,
            [s.seq_len - s.group_tables[g][1] for s in seqs],
            [s.group_tables[g][0] for s in seqs],
            block_size,
            device,
        )  # fmt: skip
        for g in range(len(seqs[0].group_tables) if seqs else 0)
    ]
    return ModelInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=meta,
        group_metas=group_metas,
        sequences=seqs,
        logits_index=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        logits_seq_ids=logits_seq_ids,
    )
