"""The sampler: from a batch of logits to one token per row, with per-row settings.

    logits -> a structured output's mask (tokens its grammar forbids: -inf)
           -> log-probabilities (returned, from those logits, as vLLM does)
           -> logit bias -> repetition / presence / frequency penalties -> banned tokens (min_tokens)
           -> greedy rows: argmax
           -> others: temperature -> top-k -> top-p -> min-p -> a draw from the row's own generator

Each row draws with its own `torch.Generator` (seeded per request and sample), so a seeded
request gives the same tokens whatever else is in the batch. The random numbers are drawn on the
generator's device (the engine's generators are CPU ones) and moved to the logits' device, so a
seed gives the same draws whether the logits live on the CPU or on a GPU.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

MASKED_LOGPROB = -9999.0  # a token a structured output forbids (vLLM's figure for it)


def seeded_generator(seed: int, index: int) -> torch.Generator:
    """The generator of sample `index` of a request seeded `seed` (the engine's and the baselines')."""
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**63)


@dataclass(slots=True)
class SamplingRow:
    logits_row: int  # which row of the logits (several samples of one prompt share a row)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    banned_token_ids: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] | None = None  # added to the logits before penalties and sampling
    generator: torch.Generator | None = None
    num_logprobs: int | None = None  # top-k log-probabilities to return (0: only the sampled token's)
    allowed: torch.Tensor | None = None  # bool [vocab]: the tokens a structured output allows next (None: all)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the sampled token under the raw model distribution
    rank: int | None = None  # 1 = the most likely token
    top: list[tuple[int, float]] | None = None  # the num_logprobs most likely (token, logprob)


def _apply_penalties(x: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    if row.logit_bias:
        ids = torch.tensor(list(row.logit_bias), dtype=torch.int64, device=x.device)
        x[ids] += torch.tensor(list(row.logit_bias.values()), dtype=x.dtype, device=x.device)
    if row.repetition_penalty != 1.0:
        seen_ids = sorted(set(row.prompt_token_ids) | set(row.output_token_ids))
        seen = torch.tensor(seen_ids, dtype=torch.int64, device=x.device)
        if seen.numel():
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / row.repetition_penalty, vals * row.repetition_penalty)
    if (row.presence_penalty or row.frequency_penalty) and row.output_token_ids:
        out_ids = torch.tensor(row.output_token_ids, dtype=torch.int64, device=x.device)
        counts = torch.bincount(out_ids, minlength=x.numel())
        x -= row.frequency_penalty * counts.to(x.dtype) + row.presence_penalty * (counts > 0).to(x.dtype)
    if row.banned_token_ids:
        x[torch.tensor(row.banned_token_ids, dtype=torch.int64, device=x.device)] = float("-inf")
    return x


def _filter(x: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p: logits of excluded tokens become -inf."""
    x = x / row.temperature
    if 0 < row.top_k < x.numel():
        kth = torch.topk(x, row.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if row.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the tokens before it already reach top_p (the first one always stays)
        drop = probs.cumsum(-1) - probs >= row.top_p
        x = x.scatter(0, order[drop], float("-inf"))
    if row.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < row.min_p * probs.max(), float("-inf"))
    return x


class Sampler:
    """The engine's one owner of sampling: each sample's generator (seeded per request and sample
    index on first use, kept while the request lives), the per-row settings taken from a request's
    parameters (`row`), and the draw (`sample`: one argmax over every plain greedy row, the others
    row by row, each from its own generator)."""

    def __init__(self) -> None:
        self._generators: dict[str, dict[int, torch.Generator]] = {}  # request id -> sample index -> generator

    def row(self, request_id: str, seed: int, index: int, params: Any, token_ids: Sequence[int],
            num_prompt_tokens: int, stop_token_ids: Collection[int], logits_row: int) -> SamplingRow:  # fmt: skip
        """Sample `index` of a request (its tokens so far `token_ids`) as a row of the batch."""
        gens = self._generators.setdefault(request_id, {})
        generator = gens.get(index)
        if generator is None:
            generator = gens[index] = seeded_generator(seed, index)
        out_ids = list(token_ids[num_prompt_tokens:])
        return SamplingRow(
            logits_row=logits_row,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            prompt_token_ids=list(token_ids[:num_prompt_tokens]) if params.repetition_penalty != 1.0 else [],
            output_token_ids=out_ids,
            banned_token_ids=sorted(stop_token_ids) if len(out_ids) < params.min_tokens else [],
            generator=generator,
            num_logprobs=params.logprobs,
            logit_bias=params.logit_bias,
        )

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        return sample(logits, rows)

    def forget(self, request_id: str) -> None:
        """The request ended: its generators go."""
        self._generators.pop(request_id, None)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
    """One token per row. `logits` is [num_logits_rows, vocab] float32."""
    out: list[SampledToken] = []
    logprobs = None
    if any(r.num_logprobs is not None and r.allowed is None for r in rows):
        logprobs = torch.log_softmax(logits, dim=-1)
    # plain greedy rows (no penalty, nothing banned) are one argmax over all of them
    plain = [i for i, r in enumerate(rows) if r.greedy and not _penalized(r) and r.allowed is None]
    argmax = dict(zip(plain, logits[[rows[i].logits_row for i in plain]].argmax(-1).tolist(), strict=True))
    for i, row in enumerate(rows):
        if i in argmax:
            out.append(_with_logprobs(SampledToken(argmax[i]), row, logprobs))
            continue
        x = logits[row.logits_row]
        masked = None
        if row.allowed is not None:  # (a copy: samples of one prompt share a logits row)
            x = masked = x.masked_fill(~row.allowed, float("-inf"))
        if _penalized(row):
            x = _apply_penalties(x.clone(), row)
        if row.greedy:
            token = int(torch.argmax(x))
        else:
            probs = _filter(x, row).softmax(-1)
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, using only this row's generator.
            noise = exponential_noise(probs.numel(), row.generator, probs.device, probs.dtype)
            token = int(torch.argmax(probs / noise))
        out.append(_with_logprobs(SampledToken(token), row, logprobs, masked))
    return out


def exponential_noise(
    num: int, generator: torch.Generator | None, device: str | torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`num` draws of Exp(1) from `generator`, returned on `device`. They are drawn where the
    generator lives (without one: on `device`, from torch's default generator), so the values
    depend on the seed only, never on where the logits are."""
    where = generator.device if generator is not None else device
    noise = torch.empty(num, dtype=dtype, device=where).exponential_(generator=generator)
    return noise.to(device)


def _penalized(row: SamplingRow) -> bool:
    return bool(
        row.repetition_penalty != 1.0
        or row.presence_penalty
        or row.frequency_penalty
        or row.banned_token_ids
        or row.logit_bias
    )


def _with_logprobs(st: SampledToken, row: SamplingRow, logprobs: torch.Tensor | None,
                   masked: torch.Tensor | None = None) -> SampledToken:  # fmt: skip
    """The sampled token's log-probability, rank and the top ones: from the row's logits, or from `masked`
    (a structured output's logits: its forbidden tokens' log-probabilities are MASKED_LOGPROB, as vLLM reports
    them, so every figure stays a finite number: JSON has no -inf)."""
    if masked is not None and row.num_logprobs is not None:
        lp = torch.log_softmax(masked, -1).clamp_(min=MASKED_LOGPROB)
        logprobs, row = lp[None], SamplingRow(0, num_logprobs=row.num_logprobs)
    if row.num_logprobs is not None and logprobs is not None:
        lp = logprobs[row.logits_row]
        st.logprob = float(lp[st.token_id])
        st.rank = int((lp > lp[st.token_id]).sum()) + 1
        if row.num_logprobs > 0:
            top = torch.topk(lp, min(row.num_logprobs, lp.numel()))
            st.top = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return st
