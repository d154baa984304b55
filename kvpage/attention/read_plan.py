"""`ReadPlan`: what a step's attention reads beyond the block tables, and what it reports back.

Most steps read their tables and nothing else (`ReadPlan.empty`, the hot path). Three features ask
for more, per sequence, and this is the one record of it:

    want_mass / mass     H2O (core/eviction): the softmax mass each table entry received, summed
                         over heads, queries and layers; [num_seqs, max_blocks] float32
    budgets              a read budget (key_bounds.py): the blocks each decode reads in the layers
                         that keep key bounds (0: all); [num_seqs] int64, prefill chunks 0
    demoted / ..._mass   blocks demoted to a lower precision (core/eviction: Demote, demoted.py):
                         per sequence its (precision, block id) list, read besides its table; the
                         mass they received, [num_seqs, max_demoted]

Which path reads a sequence is decided from this record in one place (backend.py: `read_path`).
The order in which a sequence's mass is reported, its table's entries then its demoted blocks, is
`reported_mass`'s (the eviction windows read it back in that order: `EvictionWindows.read_order`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.attention import key_bounds

Demoted = list[tuple[str, int]]  # a sequence's demoted blocks: (precision, block id in its pool)


@dataclass(slots=True)
class ReadPlan:
    want_mass: list[bool] = field(default_factory=list)
    mass: torch.Tensor | None = None
    budgets: torch.Tensor | None = None
    demoted: list[Demoted] | None = None
    demoted_mass: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        num_decodes: int,
        table_width: int,
        block_size: int,
        device: torch.device | str,
        want_mass: list[bool] | None,
        read_budgets: list[int | None] | None,
        demoted: list[Demoted] | None,
        num_seqs: int,
    ) -> ReadPlan:
        """From per-sequence lists (None: no sequence has it). `read_budgets`: tokens each sequence's
        decode may read (None: all), applied to decodes only."""
        want = list(want_mass) if want_mass is not None else [False] * num_seqs
        mass = torch.zeros(num_seqs, table_width, device=device) if any(want) else None
        blocks = [
            key_bounds.read_blocks(b, block_size) if i < num_decodes else 0 for i, b in enumerate(read_budgets or [])
        ]
        budgets = torch.tensor(blocks, dtype=torch.int64, device=device) if any(blocks) else None
        cold = [list(c) for c in demoted] if demoted and any(demoted) else None
        width = max(map(len, cold)) if cold else 0
        cold_mass = torch.zeros(num_seqs, width, device=device) if cold and any(want) else None
        return cls(want, mass, budgets, cold, cold_mass)

    @property
    def empty(self) -> bool:
        """Nothing beyond the tables: every backend's fast path."""
        return self.mass is None and self.budgets is None and self.demoted is None

    def wants_mass(self, i: int) -> bool:
        return self.mass is not None and self.want_mass[i]

    def demoted_of(self, i: int) -> Demoted:
        return self.demoted[i] if self.demoted else []

    def restricted(self, i: int, seq_len: int, block_size: int) -> bool:
        """Whether sequence i's budget leaves some of its blocks unread."""
        if self.budgets is None:
            return False
        want = int(self.budgets[i])
        return 0 < want < -(-seq_len // block_size)

    def add_mass(self, i: int, table: torch.Tensor, demoted: torch.Tensor | None = None) -> None:
        """Mass sequence i's table entries (and demoted blocks, in `demoted_of(i)`'s order) received."""
        self.mass[i, : table.numel()] += table  # type: ignore[index]
        if demoted is not None and demoted.numel():
            self.demoted_mass[i, : demoted.numel()] += demoted  # type: ignore[index]

    def add_rows(self, other: ReadPlan, rows: torch.Tensor) -> None:
        """Add the mass of `other` (a plan over some of this one's sequences: row r of it is sequence
        rows[r] here) to this plan's (CacheBlend's narrowed batch, worker/selective.py)."""
        for mine, theirs in ((self.mass, other.mass), (self.demoted_mass, other.demoted_mass)):
            if mine is not None and theirs is not None:
                mine[:, : theirs.shape[1]].index_add_(0, rows.to(theirs.device), theirs)

    def all_reduce(self, group) -> None:
        """Sum the mass over a tensor-parallel group's ranks (each attends its own heads)."""
        for t in (self.mass, self.demoted_mass):
            if t is not None:
                group.all_reduce(t)

    def reported_mass(self, i: int, table_len: int, divisor: float) -> list[float]:
        """Sequence i's mass as the eviction windows read it: its table's entries, then its demoted
        blocks, each divided by `divisor` (the heads and layers it was summed over)."""
        assert self.mass is not None
        out = (self.mass[i, :table_len] / divisor).tolist()
        n = len(self.demoted_of(i))
        if n and self.demoted_mass is not None:
            out += (self.demoted_mass[i, :n] / divisor).tolist()
        return out
