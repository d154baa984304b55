"""CacheBlend's selective recompute (arXiv 2405.16444), in one forward of the step.

A prompt of segments copies each reused segment's own KV into place (core/segments.py); that KV
never saw what now precedes it. CacheBlend recomputes only the tokens whose KV deviates most:

    layers 0 .. L          every token of the copied spans is computed in the new context (its
                           K/V overwrites the copy), like the rest of the step
    at layer L             the deviation of each copied token's new K/V from the copy it replaced,
                           ||k_new - k_old||^2 + ||v_new - v_old||^2 over heads; per sequence, the
                           top `select_ratio` share of its copied tokens carries on
    layers L+1 ..          only those tokens and the step's ordinary tokens (the question, the
                           recomputed blocks, other requests); the rest keep the copied K/V

L is CacheBlend's check layer, the second one (index 1): the first layer's K/V depend on the token
and its position only, so after the re-rotation its copy deviates by rounding alone. Past L the
kept rows are a ragged batch of their own: every run of consecutive kept rows of an entry becomes
an entry of a new `AttentionMetadata` (same block table; decodes first, as the metadata wants).
`widen` puts the final hidden states back at their rows of the step; a dropped row's stays zero,
and nothing reads it (the logits rows and every ordinary row are kept).

`SelectiveRecompute` is the model's layer hook for one step (models/layer_hook.py); `CacheBlend` is
the model runner's step hook that makes one when a step asks for it (worker/step_hooks.py).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from kvpage.attention import AttentionMetadata, LayerKV
from kvpage.core.scheduler_output import ScheduledSequence
from kvpage.worker.step_hooks import StepHook

CHECK_LAYER = 1


class SelectiveRecompute:
    def __init__(self, seqs: list[ScheduledSequence], meta: AttentionMetadata, num_layers: int):
        self.layer = min(CHECK_LAYER, num_layers - 1)
        self.seqs, self.meta = seqs, meta
        groups: dict = defaultdict(list)  # seq_id -> its copied rows of the step (flat batch rows)
        self.ratio = {}
        for i, s in enumerate(seqs):
            if s.select_ratio is not None:
                start = meta.query_start_loc[i]
                groups[s.seq_id].extend(range(start, start + len(s.token_ids)))
                self.ratio[s.seq_id] = s.select_ratio
        self.groups = dict(groups)
        rows = [r for g in self.groups.values() for r in g]
        self.candidates = torch.tensor(rows, dtype=torch.int64, device=meta.slot_mapping.device)
        self.slots = meta.slot_mapping[self.candidates]
        self.num_candidates, self.num_kept = len(rows), 0
        self.rows: torch.Tensor | None = None
        self.narrowed: AttentionMetadata | None = None
        self._before: tuple[torch.Tensor, torch.Tensor] | None = None

    # the layer hook (models/layer_hook.py)
    def before_layer(self, i: int, kv: LayerKV) -> None:
        if i == self.layer:
            self._before = self.read(kv)

    def after_layer(self, i: int, kv: LayerKV) -> tuple[torch.Tensor | None, AttentionMetadata | None]:
        if i != self.layer:
            return None, None
        return self.narrow(self._before, self.read(kv))

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.widen(hidden)

    def read(self, kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
        """The copied tokens' K/V in this layer's cache (before the layer writes: the copy; after: new)."""
        return kv.read_slots(self.slots)

    def narrow(self, before, after) -> tuple[torch.Tensor, AttentionMetadata]:
        """After the check layer: the rows that carry on (in their new batch order) and their metadata."""
        dev = ((after[0] - before[0]) ** 2).sum((1, 2)) + ((after[1] - before[1]) ** 2).sum((1, 2))
        dropped, at = set(), 0
        for seq_id, rows in self.groups.items():
            d = dev[at : at + len(rows)]
            at += len(rows)
            keep = max(0, min(len(rows), math.ceil(self.ratio[seq_id] * len(rows))))
            kept = set(torch.topk(d, keep).indices.tolist()) if keep else set()
            dropped.update(r for j, r in enumerate(rows) if j not in kept)
            self.num_kept += keep
        entries = []  # (row ids, entry index in the step's batch) per run of consecutive kept rows
        for i, s in enumerate(self.seqs):
            start, run = self.meta.query_start_loc[i], []
            for r in range(start, start + len(s.token_ids)):
                if r in dropped:
                    if run:
                        entries.append((run, i))
                    run = []
                else:
                    run.append(r)
            if run:
                entries.append((run, i))
        entries.sort(key=lambda e: len(e[0]) != 1)  # decodes first (stable: batch order otherwise)
        self.entry_of = [i for _, i in entries]

        def kv_len(run, i):  # keys the run's last query sees: its position + 1, less the evicted
            s = self.seqs[i]
            return s.num_computed + (run[-1] - self.meta.query_start_loc[i]) + 1 - s.num_evicted

        device = self.meta.slot_mapping.device
        self.narrowed = AttentionMetadata.build(
            [len(run) for run, _ in entries], [kv_len(run, i) for run, i in entries],
            [self.seqs[i].block_table for _, i in entries], self.meta.block_size, device,
            want_mass=[self.seqs[i].want_mass for _, i in entries],
            read_budgets=[self.seqs[i].max_read_tokens for _, i in entries],
            demoted=[self.seqs[i].cold_blocks for _, i in entries],
        )  # fmt: skip
        self.rows = torch.tensor([r for run, _ in entries for r in run], dtype=torch.int64, device=device)
        return self.rows, self.narrowed

    def widen(self, hidden: torch.Tensor) -> torch.Tensor:
        """The kept rows' final hidden states at their rows of the step (and H2O's mass of the layers
        after the check layer added to the step's own entries)."""
        if self.rows is None:
            return hidden
        full = hidden.new_zeros(self.meta.num_tokens, hidden.shape[1])
        full[self.rows] = hidden
        if self.narrowed is not None:  # H2O's mass of the later layers, to the step's own entries
            self.meta.reads.add_rows(self.narrowed.reads, torch.tensor(self.entry_of, dtype=torch.int64))
        return full


def selective_recompute(seqs: list[ScheduledSequence], meta: AttentionMetadata, num_layers: int):
    """The step's selective recompute, or None when no entry asks for one."""
    if all(s.select_ratio is None for s in seqs):
        return None
    return SelectiveRecompute(seqs, meta, num_layers)


class CacheBlend(StepHook):
    """The step hook: a step with copied tokens to check runs the model with a SelectiveRecompute.
    Counts the reused tokens that took part and those recomputed past the check layer."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.tokens = {"candidates": 0, "recomputed": 0}
        self._step: SelectiveRecompute | None = None

    def layer_hook(self, inputs) -> SelectiveRecompute | None:
        self._step = selective_recompute(inputs.sequences, inputs.meta, self.num_layers)
        return self._step

    def after_forward(self, inputs) -> None:
        if self._step is not None:
            self.tokens["candidates"] += self._step.num_candidates
            self.tokens["recomputed"] += self._step.num_kept
            self._step = None
