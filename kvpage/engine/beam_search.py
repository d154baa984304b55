"""Beam search inside the engine, matching transformers' generate(num_beams=k, do_sample=False) with
its default early_stopping=False, token for token.

Beams are sequences of one request; a new beam forks its parent (sharing every block, copy-on-write)
and a pruned beam is finished at once, so its blocks go back to the pool. The rules, per step t
(t = tokens generated after this step; all arithmetic in float32 as transformers does it):

    acc[b, v]   = log_softmax(logits[b])[v] + score[b]            running beams in their rank order
    candidates  = top 2k of acc over (beam, token), flattened beam-major, best first
    stopped     = candidate token is EOS, or t == max_tokens
    running     = the first k candidates that did not stop, with their raw summed scores
    finished    = stopped candidates ranked among the first k, scored sum / t ** length_penalty
                  (t counts the EOS token, not the prompt), merged with earlier ones, best k kept
    done        = t == max_tokens, or k hypotheses are finished and the best running beam's
                  score / t ** length_penalty is not above the worst finished one

The result is the finished hypotheses, best first by their length-normalised score. Each beam's
per-step log-probabilities (the chosen token's and its row's top candidates, as vLLM's beams carry
them) are a chain of `_Step`s pointing at the parent's, so a fork copies nothing; a finished
hypothesis walks its chain back once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.core.request import Request, Sequence
from kvpage.outputs import CompletionOutput, Logprob, PositionLogprobs

_NEG = -1e9


def _length_norm(t: int, length_penalty: float) -> float:
    """t ** length_penalty, saturating to inf instead of raising for extreme penalties (1e308)."""
    try:
        return float(t) ** length_penalty
    except OverflowError:
        return float("inf")


@dataclass(slots=True)
class _Step:
    """One generated token of a beam: its log-probability and rank, the row's top candidates, and
    the step before it (None at the first generated token)."""

    prev: _Step | None
    token: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class _Hypothesis:
    token_ids: list[int]  # generated tokens, the EOS included
    score: float  # length-normalised
    cumulative_logprob: float
    finish_reason: str
    last: _Step


@dataclass(slots=True)
class BeamPlan:
    # (parent beam, token, index of the new beam) per running beam, in rank order; the first use of a
    # parent continues it in place (index == parent.index), later uses are forks with fresh indices
    continue_: list[tuple[Sequence, int, int]]
    done: bool


@dataclass(slots=True)
class BeamSearch:
    beam_width: int
    length_penalty: float
    max_tokens: int
    eos_token_ids: frozenset[int]
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # beam index -> float32 summed logprob
    order: list[int] = field(default_factory=list)  # beam indices in rank order
    finished: list[_Hypothesis] = field(default_factory=list)
    steps: dict[int, _Step | None] = field(default_factory=dict)  # beam index -> its newest token's step
    _pending: dict[int, torch.Tensor] = field(default_factory=dict)
    _next_index: int = 1
    step_no: int = 0

    def set_logits(self, seq: Sequence, logits: torch.Tensor) -> None:
        self._pending[seq.index] = logits

    def ready(self, live: list[Sequence]) -> bool:
        return all(s.index in self._pending for s in live)

    def step(self, live: list[Sequence]) -> BeamPlan:
        k = self.beam_width
        by_index = {s.index: s for s in live}
        if not self.order:  # the first step: the prompt is the only beam
            self.order = [live[0].index]
            self.scores = {live[0].index: torch.zeros((), dtype=torch.float32)}
            self.steps = {live[0].index: None}
        order = [i for i in self.order if i in by_index]
        lp = torch.stack([torch.log_softmax(self._pending[i].float(), dim=-1) for i in order])
        acc = lp + torch.stack([self.scores[i] for i in order])[:, None]
        self._pending.clear()
        vocab = acc.shape[1]
        num_cand = min(max(2, 1 + len(self.eos_token_ids)) * k, acc.numel())
        vals, idx = torch.topk(acc.reshape(-1), num_cand)
        self.step_no += 1
        t = self.step_no
        at_limit = t >= self.max_tokens
        norm = vals / _length_norm(t, self.length_penalty)
        # each row's own top candidates: a chosen token ranks among them (acc's row is lp's row plus a constant)
        row_vals, row_ids = torch.topk(lp, min(num_cand, vocab), dim=-1)
        row_top = [list(zip(i, v, strict=True)) for i, v in zip(row_ids.tolist(), row_vals.tolist(), strict=True)]
        running: list[tuple[Sequence, int, torch.Tensor, _Step]] = []
        new_finished = []
        for j in range(num_cand):
            if not torch.isfinite(vals[j]):
                break  # (a structured output's forbidden tokens, -inf: fewer beams go on rather than take one)
            r = int(idx[j]) // vocab
            parent = by_index[order[r]]
            token = int(idx[j]) % vocab
            stopped = token in self.eos_token_ids or at_limit
            if (stopped and j >= k) or (not stopped and len(running) >= k):
                continue  # a stopped candidate ranked below k, or the running beams are complete
            step = self._step(parent.index, token, lp[r], row_top[r])
            if stopped:
                reason = "stop" if token in self.eos_token_ids else "length"
                new_finished.append(
                    _Hypothesis(parent.output_token_ids + [token], float(norm[j]), float(vals[j]), reason, step)
                )
            else:
                running.append((parent, token, vals[j], step))
        # stable sort: on equal scores, earlier hypotheses stay ahead of new ones
        self.finished = sorted(self.finished + new_finished, key=lambda h: -h.score)[:k]
        done = at_limit or not running
        if not done and len(self.finished) == k:
            best = running[0][2] / _length_norm(t, self.length_penalty)
            done = not bool(best > min(h.score for h in self.finished))
        if done:
            return BeamPlan([], True)
        plan = BeamPlan([], False)
        used: set[int] = set()
        new_scores, new_steps = {}, {}
        for parent, token, score, step in running:
            if parent.index in used:
                index = self._next_index
                self._next_index += 1
            else:
                used.add(parent.index)
                index = parent.index
            plan.continue_.append((parent, token, index))
            new_scores[index] = score
            new_steps[index] = step
        self.order, self.scores = [index for _, _, index in plan.continue_], new_scores
        self.steps = new_steps
        return plan

    def _step(self, parent: int, token: int, lp_row: torch.Tensor, top: list[tuple[int, float]]) -> _Step:
        for rank, (t, v) in enumerate(top, 1):
            if t == token:
                return _Step(self.steps[parent], token, v, rank, top)
        # a tie at the top-k boundary broken the other way: the chosen token's own value and rank
        v = lp_row[token]
        return _Step(self.steps[parent], token, float(v), int((lp_row > v).sum()) + 1, top)

    def outputs(self, tokenizer, req: Request) -> list[CompletionOutput]:
        """The finished hypotheses, best first, once the request is done; until then the running beams."""
        if req.finished:
            decoded: dict[int, str] = {}
            return [
                CompletionOutput(
                    i,
                    tokenizer.decode(h.token_ids),
                    h.token_ids,
                    h.cumulative_logprob,
                    _logprobs(h.last, tokenizer, decoded),
                    h.finish_reason,
                )  # fmt: skip
                for i, h in enumerate(self.finished)
            ]
        by_index = {s.index: s for s in req.live_sequences}
        running = [by_index[i] for i in self.order if i in by_index] or req.live_sequences
        return [
            CompletionOutput(
                i,
                tokenizer.decode(s.output_token_ids),
                list(s.output_token_ids),
                float(self.scores[s.index]) if s.index in self.scores else 0.0,
                None,
            )  # fmt: skip
            for i, s in enumerate(running)
        ]


def _logprobs(last: _Step, tokenizer, decoded: dict[int, str]) -> list[PositionLogprobs]:
    """Per generated token: the chosen token first, then its row's top candidates (vLLM's beam logprobs)."""

    def text(t: int) -> str:
        if t not in decoded:
            decoded[t] = tokenizer.decode([t], skip_special_tokens=False)
        return decoded[t]

    out: list[PositionLogprobs] = []
    step: _Step | None = last
    while step is not None:
        pos = {step.token: Logprob(step.logprob, step.rank, text(step.token))}
        for rank, (t, v) in enumerate(step.top, 1):
            if t not in pos:
                pos[t] = Logprob(v, rank, text(t))
        out.append(pos)
        step = step.prev
    return out[::-1]
