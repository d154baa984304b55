"""`AttentionMetadata`: everything attention needs to find a batch's keys and values in the paged cache.

One forward runs a ragged batch: the new tokens of every sequence are concatenated, decodes first.

    tokens      [ d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 ]     3 decodes, 2 prefill chunks
    query_start [ 0,   1,   2,   3,          7,     9 ]
    seq_lens    [ 40,  17,  9,   4,          70    ]       keys visible to each sequence's last query
    slot_mapping: where each new token's K/V is written (block_id * block_size + offset)
    block_tables: [num_seqs, max_blocks] physical block ids, padded with 0

A query at position p of its sequence sees the keys at positions <= p. For a chunk of q tokens in a
sequence of seq_len keys, query r sits at position seq_len - q + r. (Here positions are those in
the table: a sequence whose eviction policy released blocks has fewer keys than tokens.)

reads: what attention reads beyond the tables, and reports back (H2O's mass, a read budget,
demoted blocks: read_plan.py); empty for most steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.attention.read_plan import Demoted, ReadPlan
from kvpage.core.block import cdiv

DECODE_GROUP = 32  # decodes attended together; bigger groups pad more, smaller ones loop more


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor  # [num_seqs] int64
    query_start_loc: list[int]  # [num_seqs + 1], plain ints: the reference backend loops over them
    seq_lens_list: list[int]  # the same as seq_lens, plain ints
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    block_size: int
    reads: ReadPlan = field(default_factory=ReadPlan)
    _groups: list[tuple[torch.Tensor, int, torch.Tensor]] | None = field(default=None, repr=False)
    _query_start: torch.Tensor | None = field(default=None, repr=False)

    @property
    def decode_groups(self) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """Decodes sorted by length and cut into groups, so each group gathers only up to its own
        longest context instead of padding every decode to the longest of the batch: per group
        (rows, max_len, bias), bias [rows, 1, padded_len] float32 is 0 for real keys and -inf past
        each row's length. Built on first use (only the reference backend gathers), then kept."""
        if self._groups is None:
            lens, bs, device = self.seq_lens_list, self.block_size, self.seq_lens.device
            by_len = sorted(range(self.num_decodes), key=lambda i: lens[i])
            groups = []
            for g in range(0, self.num_decodes, DECODE_GROUP):
                rows = by_len[g : g + DECODE_GROUP]
                max_len = lens[rows[-1]]
                padded = cdiv(max_len, bs) * bs
                row_lens = torch.tensor([lens[r] for r in rows], device=device)
                bias = torch.zeros(len(rows), 1, padded, device=device)
                past = torch.arange(padded, device=device)[None, None, :] >= row_lens[:, None, None]
                bias.masked_fill_(past, float("-inf"))
                groups.append((torch.tensor(rows, dtype=torch.int64, device=device), max_len, bias))
            self._groups = groups
        return self._groups

    @property
    def query_start_tensor(self) -> torch.Tensor:
        """query_start_loc as an int64 tensor on the metadata's device (kernels that loop over chunks)."""
        if self._query_start is None:
            self._query_start = torch.tensor(self.query_start_loc, dtype=torch.int64, device=self.seq_lens.device)
        return self._query_start

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        want_mass: list[bool] | None = None,
        read_budgets: list[int | None] | None = None,
        demoted: list[Demoted] | None = None,
    ) -> AttentionMetadata:
        """From plain lists. Decodes (query length 1) must come first. `want_mass`, `read_budgets`,
        `demoted`: per sequence, what it reads besides its table (ReadPlan.build)."""
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        if any(q == 1 for q in query_lens[num_decodes:]):
            raise ValueError("decodes (one query token) must come before prefill chunks")
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        slots = []
        for q, n, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 0 < q <= n or len(table) * block_size < n:
                raise ValueError(f"query of {q} tokens in a sequence of {n} with {len(table)} blocks")
            slots.extend(table[t // block_size] * block_size + t % block_size for t in range(n - q, n))
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        reads = ReadPlan.build(num_decodes, width, block_size, device, want_mass, read_budgets, demoted,
                               len(query_lens))  # fmt: skip
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(padded), width),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            query_start_loc=starts,
            seq_lens_list=list(seq_lens),
            num_decodes=num_decodes,
            block_size=block_size,
            reads=reads,
        )
