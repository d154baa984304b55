"""`CompletionServing`: POST /v1/completions, streaming or not, one prompt or several.

Legacy `logprobs` as OpenAI gives them: per token its text, log-probability, the `logprobs` most
likely alternatives plus the sampled token itself, and its character offset in the choice's text.
With `echo`, the prompt comes first (its text, and with `logprobs` its tokens, the first with a
null log-probability, from the engine's prompt log-probabilities).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from kvpage.engine.segment_prompts import SegmentedPrompt
from kvpage.outputs import CompletionOutput, RequestOutput
from kvpage.server.errors import APIError
from kvpage.server.protocol import CompletionRequest
from kvpage.server.serving import OpenAIServing, off_loop, top_entries, usage
from kvpage.server.streaming import sse


class CompletionServing(OpenAIServing):
    def _tokenized(self, prompts: list) -> tuple[list[list[int]], list[str]]:
        """Each prompt's ids and text (off the event loop: serving.off_loop)."""
        tok, vocab = self.tokenizer, self.engine.model_config.vocab_size
        token_lists = [tok.encode(p) if isinstance(p, str) else p for p in prompts]
        for ids in token_lists:
            if not ids:
                raise APIError(400, "the prompt is empty", param="prompt")
            if min(ids) < 0 or max(ids) >= vocab:
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return token_lists, [p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False) for p in prompts]

    def _segmented(self, req: CompletionRequest) -> tuple[SegmentedPrompt, list[list[int]], list[str]]:
        """A prompt given as segments: the engine's prompt, its ids and its text (off the event loop)."""
        try:
            prompt = SegmentedPrompt.parse(req.segments, req.recompute_blocks, req.recompute_ratio)
        except ValueError as e:
            raise APIError(400, str(e), param="segments") from None
        ids = [t for seg in prompt.encode(self.tokenizer) for t in seg]
        vocab = self.engine.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise APIError(400, f"segments: token ids must be in [0, {vocab})", param="segments")
        return prompt, [ids], [self.tokenizer.decode(ids, skip_special_tokens=False)]

    async def create(self, req: CompletionRequest, raw_request: Request):
        self.check_model(req.model)
        segmented = None
        if req.segments is not None:
            segmented, token_lists, texts = await off_loop(self._segmented, req)
        else:
            prompts = _prompt_list(req.prompt)
            if len(prompts) > self.max_prompts_per_request:
                raise APIError(400, f"prompt: at most {self.max_prompts_per_request} prompts per request, got "
                                    f"{len(prompts)}", param="prompt", code="too_many_prompts")  # fmt: skip
            token_lists, texts = await off_loop(self._tokenized, prompts)
        eviction = self.eviction(req)
        max_tokens = min(self.check_length(ids, req.max_tokens, eviction) for ids in token_lists)
        echo_lp = req.echo and req.logprobs is not None
        plp = max(req.prompt_logprobs or 0, req.logprobs or 0) if echo_lp or req.prompt_logprobs is not None else None
        params = self.params(req, max_tokens, req.logprobs, plp, eviction)
        await self.compile_constraint(req, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        gens = self.generators(
            rid, [segmented] if segmented else token_lists, params, self.cache_salt(req, raw_request)
        )
        run = _Run(self, rid, req, token_lists, texts)
        self.check_ready(req)
        if req.stream:
            return sse(run.stream(self.outputs(gens, req.n)))
        outs = await self.final_outputs(raw_request, gens, req.n)
        return run.response(outs)


class _Run:
    """One completions request's prompts and how its choices are written."""

    def __init__(self, serving: CompletionServing, rid: str, req: CompletionRequest, token_lists, texts) -> None:
        self.s, self.rid, self.req, self.token_lists, self.texts = serving, rid, req, token_lists, texts

    def _body(self, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": "text_completion", "created": int(time.time()),
                "model": self.s.served_model_name, "choices": choices}  # fmt: skip

    def _echo_logprobs(self, i: int, out: RequestOutput) -> dict:
        ids, positions = self.token_lists[i], out.prompt_logprobs or [None] * len(self.token_lists[i])
        return self._logprobs(ids, positions, 0)

    def _logprobs(self, token_ids, positions, offset: int) -> dict:
        s, k = self.s, self.req.logprobs or 0
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, pos in zip(token_ids, positions, strict=False):
            text = s.token_text(tok)
            label = s.token_label(self.req, tok, text)
            tokens.append(label)
            offsets.append(offset)
            offset += len(text)
            if pos is None or tok not in pos:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(pos[tok].logprob)
            top = {label: pos[tok].logprob}  # the sampled token always there, and first (as vLLM orders it)
            for t, lp in top_entries(pos, k):
                top.setdefault(s.token_label(self.req, t, lp.decoded_token), lp.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _choice(self, i: int, out: RequestOutput, c: CompletionOutput, *, text: str, start: int,
                offset: int, echo: bool) -> dict:  # fmt: skip
        req = self.req
        choice = {"index": i * req.n + c.index, "text": text, "logprobs": None, "finish_reason": c.finish_reason}
        if req.logprobs is not None:
            lp = self._echo_logprobs(i, out) if echo else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                           "text_offset": []}  # fmt: skip
            base = offset + (len(self.texts[i]) if echo else 0)
            gen = self._logprobs(c.token_ids[start:], (c.logprobs or [])[start:], base)
            for key in lp:
                lp[key] += gen[key]
            choice["logprobs"] = lp
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason
        if req.return_token_ids and (echo or start == 0):
            choice["prompt_token_ids"] = self.token_lists[i]
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids[start:]
        if req.prompt_logprobs is not None and (echo or start == 0):
            choice["prompt_logprobs"] = self.s.prompt_logprobs_json(out.prompt_logprobs)
        return choice

    def response(self, outs: list[RequestOutput]) -> dict:
        req, choices = self.req, []
        for i, out in enumerate(outs):
            for c in out.outputs:
                prefix = self.texts[i] if req.echo else ""
                choices.append(self._choice(i, out, c, text=prefix + c.text, start=0, offset=0, echo=req.echo))
        for choice in choices:  # vLLM's extension fields are always there, null when not asked for
            for key in ("prompt_logprobs", "prompt_token_ids", "token_ids"):
                choice.setdefault(key, None)
        body = self._body(choices)
        generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
        body["usage"] = usage(sum(len(t) for t in self.token_lists), generated, sum(o.num_cached_tokens for o in outs))
        return body

    async def stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict]:
        req = self.req
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) sent
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        done: set[int] = set()
        completion_tokens = 0
        cached: dict[int, int] = {}  # prompt index -> its cached prompt tokens
        final_usage, continuous = self.s.stream_usage(req)
        prompt_tokens = sum(len(t) for t in self.token_lists)
        async for i, out in outputs:
            cached[i] = out.num_cached_tokens
            beam = req.use_beam_search
            if beam and not out.finished:
                continue  # beams are only final once the search ends
            for c in out.outputs:
                idx = i * req.n + c.index
                if idx in done:
                    continue
                first = idx not in sent
                n_text, n_tok = sent.get(idx, (0, 0))
                delta = c.text[n_text:]
                if not delta and not c.finish_reason and not (first and req.echo):
                    continue
                echo = first and req.echo
                text = (self.texts[i] if echo else "") + delta
                choice = self._choice(i, out, c, text=text, start=n_tok, offset=offsets.get(idx, 0), echo=echo)
                if choice["logprobs"] is not None:
                    lp = choice["logprobs"]
                    offsets[idx] = (
                        (lp["text_offset"][-1] + len(lp["tokens"][-1])) if lp["tokens"] else offsets.get(idx, 0)
                    )
                completion_tokens += len(c.token_ids) - n_tok
                sent[idx] = (len(c.text), len(c.token_ids))
                if c.finish_reason:
                    done.add(idx)
                body = self._body([choice])
                if continuous:
                    body["usage"] = usage(prompt_tokens, completion_tokens, sum(cached.values()))
                yield body
        if final_usage:
            body = self._body([])
            body["usage"] = usage(prompt_tokens, completion_tokens, sum(cached.values()))
            yield body


def _prompt_list(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt)
