"""`ChatServing`: POST /v1/chat/completions, streaming or not.

Messages are tokenized with `Tokenizer.encode_chat`: only the chat template's own markup becomes
control tokens; a message's content is always text, whatever it spells.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from jinja2.exceptions import TemplateError

from kvpage.outputs import CompletionOutput, RequestOutput
from kvpage.server.errors import APIError
from kvpage.server.protocol import ChatCompletionRequest
from kvpage.server.serving import OpenAIServing, off_loop, top_entries, usage
from kvpage.server.streaming import sse
from kvpage.server.tool_calls import PARSERS, tool_call_json
from kvpage.server.tool_stream import AutoContent, NamedCall, RequiredCalls, required_calls


class ChatServing(OpenAIServing):
    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        self.check_model(req.model)
        if req.tool_choice == "auto" and self.tool_call_parser is None:
            raise APIError(400, 'tool_choice "auto" needs a server started with --tool-call-parser (hermes, '
                                "llama3_json, mistral); or ask for required or a named function",
                           param="tool_choice")  # fmt: skip
        try:
            messages = [m.template_dict() for m in req.messages]
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = await off_loop(lambda: self.tokenizer.encode_chat(
                messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tools=tools))  # fmt: skip
        except (ValueError, TemplateError) as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        eviction = self.eviction(req)
        budget_field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        max_tokens = self.check_length(ids, req.max_completion_tokens or req.max_tokens, eviction, "messages",
                                       budget_field)  # fmt: skip
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = self.params(req, max_tokens, top, req.prompt_logprobs, eviction)
        await self.compile_constraint(req, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gens = self.generators(rid, [ids], params, self.cache_salt(req, raw_request))
        run = _Run(self, rid, req, ids)
        self.check_ready(req)
        if req.stream:
            return sse(run.stream(self.outputs(gens, req.n)))
        (out,) = await self.final_outputs(raw_request, gens, req.n)
        return run.response(out)


class _Run:
    def __init__(self, serving: ChatServing, rid: str, req: ChatCompletionRequest, ids: list[int]) -> None:
        self.s, self.rid, self.req, self.ids = serving, rid, req, ids

    def _logprobs(self, c: CompletionOutput, start: int) -> dict | None:
        if not self.req.logprobs:
            return None
        k, content = self.req.top_logprobs or 0, []
        for tok, pos in zip(c.token_ids[start:], (c.logprobs or [])[start:], strict=False):
            text = self.s.token_label(self.req, tok)
            top = []
            for t, lp in top_entries(pos, k):
                label = self.s.token_label(self.req, t, lp.decoded_token or "")
                top.append({"token": label, "logprob": lp.logprob, "bytes": list(label.encode())})
            content.append({"token": text, "logprob": pos[tok].logprob, "bytes": list(text.encode()),
                            "top_logprobs": top})  # fmt: skip
        return {"content": content}

    def _extras(self, body: dict, out: RequestOutput) -> dict:
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.ids
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.s.prompt_logprobs_json(out.prompt_logprobs)
        return body

    def _answer(self, c: CompletionOutput, echoed: bool = True) -> tuple[str | None, list[dict], str | None]:
        """A choice's (content, tool calls, finish reason): the calls its constraint made (tool_choice required or
        a named function; cut by the length, as far as they came) or the server's parser found (auto); with
        calls, the reason is "tool_calls" (or "length"). `echoed`: the content begins with what `echo` puts
        first (a stream sent that already)."""
        mode, text = self.req.tool_mode, (self.req.echoed if echoed else "") + c.text
        calls: list[tuple[str, str]] = []
        cut = c.finish_reason == "length"  # (the calls as far as they came, as a stream sent them)
        if mode == "required" and c.finish_reason in ("stop", "length"):
            calls = required_calls(c.text)
            text = None if calls else text
        elif mode == "named" and c.finish_reason in ("stop", "length"):
            text, calls = None, [(self.req.tool_choice.function["name"], c.text)]
        elif mode == "auto" and self.s.tool_call_parser is not None:
            text, calls = PARSERS[self.s.tool_call_parser](text)
        if not calls:
            return text, [], c.finish_reason
        return text, [tool_call_json(name, args) for name, args in calls], "length" if cut else "tool_calls"

    def response(self, out: RequestOutput) -> dict:
        choices = []
        for c in out.outputs:
            content, calls, finish = self._answer(c)
            message = {"role": self.req.reply_role, "content": content}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": c.index, "message": message, "logprobs": self._logprobs(c, 0), "finish_reason": finish,
                      "stop_reason": c.stop_reason}  # fmt: skip
            choice["token_ids"] = c.token_ids if self.req.return_token_ids else None
            choices.append(choice)
        body = {"id": self.rid, "object": "chat.completion", "created": int(time.time()),
                "model": self.s.served_model_name, "choices": choices,
                "usage": usage(len(self.ids), sum(len(c.token_ids) for c in out.outputs),
                               out.num_cached_tokens)}  # fmt: skip
        body = self._extras(body, out)
        body.setdefault("prompt_logprobs", None)  # vLLM's extension fields: there, null when not asked for
        body.setdefault("prompt_token_ids", None)
        return body

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.s.served_model_name, "choices": choices}  # fmt: skip

    def _tool_stream(self):
        """How this request's answer streams its calls (tool_stream.py), or None (plain text)."""
        mode, parser = self.req.tool_mode, self.s.tool_call_parser
        if mode == "named":
            return NamedCall(self.req.tool_choice.function["name"])
        if mode == "required":
            return RequiredCalls()
        if mode == "auto" and parser is not None:
            return AutoContent(parser)
        return None

    async def stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict]:
        req = self.req
        sent: dict[int, tuple[int, int]] = {}  # choice -> (characters read, tokens sent)
        done: set[int] = set()
        tools: dict[int, NamedCall | RequiredCalls | AutoContent | None] = {}
        completion_tokens = cached = 0
        final_usage, continuous = self.s.stream_usage(req)

        def chunk(choices: list[dict]) -> dict:
            body = self._chunk(choices)
            if continuous:
                body["usage"] = usage(len(self.ids), completion_tokens, cached)
            return body

        async for _, out in outputs:
            cached = out.num_cached_tokens
            if req.use_beam_search and not out.finished:
                continue  # beams are only final once the search ends
            for c in out.outputs:
                if c.index in done:
                    continue
                if c.index not in sent:
                    sent[c.index] = (0, 0)
                    tools[c.index] = self._tool_stream()
                    first = chunk([{"index": c.index, "delta": {"role": req.reply_role, "content": req.echoed},
                                          "logprobs": None, "finish_reason": None}])  # fmt: skip
                    yield self._extras(first, out) if c.index == 0 else first
                n_text, n_tok = sent[c.index]
                delta = c.text[n_text:]
                if not delta and not c.finish_reason:
                    continue  # (a token that ends mid-character: it goes with the next one)
                ts, finish = tools[c.index], c.finish_reason
                pieces: list[dict] = []  # the deltas to send now: content and tool calls
                if ts is None:
                    pieces.append({"content": delta})
                elif isinstance(ts, AutoContent):
                    pieces.append({"content": ts.feed(c.text)})
                    if finish:  # the parser reads the whole answer: its calls go whole, or the rest as content
                        _, calls, finish = self._answer(c, echoed=False)
                        if calls:
                            pieces.append({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
                        else:
                            pieces.append({"content": ts.rest(c.text)})
                else:
                    pieces.append({"tool_calls": ts.feed(delta)})
                    if finish == "stop":
                        finish = "tool_calls"
                pieces = [p for p in pieces if next(iter(p.values()))]
                sent[c.index] = (len(c.text), n_tok)
                if not pieces and not finish:
                    continue  # (held back: its tokens and logprobs go with the next piece)
                completion_tokens += len(c.token_ids) - n_tok
                sent[c.index] = (len(c.text), len(c.token_ids))
                lp, token_ids = self._logprobs(c, n_tok), c.token_ids[n_tok:]
                for piece in pieces:
                    choice = {"index": c.index, "delta": piece, "logprobs": lp, "finish_reason": None}
                    if req.return_token_ids:
                        choice["token_ids"] = token_ids
                    yield chunk([choice])
                    lp, token_ids = None, []
                if finish:
                    done.add(c.index)
                    choice = {"index": c.index, "delta": {}, "logprobs": lp, "finish_reason": finish,
                              "stop_reason": c.stop_reason}  # fmt: skip
                    if req.return_token_ids:
                        choice["token_ids"] = token_ids
                    yield chunk([choice])
        if final_usage:
            body = self._chunk([])
            body["usage"] = usage(len(self.ids), completion_tokens, cached)
            yield body
