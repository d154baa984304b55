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

The result is the finished hypotheses, best first by their length-normalised score.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.core.request import Request, Sequence
from kvpage.outputs import CompletionOutput

_NEG = -1e9


def _length_norm(t: int, length_penalty: float) -> float:
    """t ** length_penalty, saturating to inf instead of raising for extreme penalties (1e308)."""
    try:
        return float(t) ** length_penalty
    except OverflowError:
        return float("inf")


@dataclass(slots=True)
class _Hypothesis:
    token_ids: list[int]  # generated tokens, the EOS included
    score: float  # length-normalised
    cumulative_logprob: float
    finish_reason: str


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
        running: list[tuple[Sequence, int, torch.Tensor]] = []
        new_finished = []
        for j in range(num_cand):
            parent = by_index[order[int(idx[j]) // vocab]]
            token = int(idx[j]) % vocab
            stopped = token in self.eos_token_ids or at_limit
            if stopped:
                if j < k:
                    reason = "stop" if token in self.eos_token_ids else "length"
                    new_finished.append(
                        _Hypothesis(parent.output_token_ids + [token], float(norm[j]), float(vals[j]), reason)
                    )
            elif len(running) < k:
                running.append((parent, token, vals[j]))
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
        new_scores = {}
        for parent, token, score in running:
            if parent.index in used:
                index = self._next_index
                self._next_index += 1
            else:
                used.add(parent.index)
                index = parent.index
            plan.continue_.append((parent, token, index))
            new_scores[index] = score
        self.order, self.scores = [index for _, _, index in plan.continue_], new_scores
        return plan

    def outputs(self, tokenizer, req: Request) -> list[CompletionOutput]:
        """The finished hypotheses, best first, once the request is done; until then the running beams."""
        if req.finished:
            return [
                CompletionOutput(
                    i, tokenizer.decode(h.token_ids), h.token_ids, h.cumulative_logprob, None, h.finish_reason
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
