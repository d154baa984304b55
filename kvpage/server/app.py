"""The OpenAI-compatible app: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

Every request of every client goes to one AsyncEngine, which batches them together. Errors use
OpenAI's body, {"error": {"message", "type", "param", "code"}}, with a 4xx status that names the
problem; one bad request never disturbs the others.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpage.engine.llm_engine import LLMEngine
from kvpage.outputs import RequestOutput
from kvpage.sampling_params import SamplingParams
from kvpage.server.async_engine import AsyncEngine
from kvpage.server.metrics import Metrics
from kvpage.server.protocol import ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_BODY_BYTES = 1 << 20


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _BodyLimit:
    """Refuse request bodies over `limit` bytes with 413, whether or not Content-Length is sent."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._reject(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise APIError(413, f"request body larger than {self.limit} bytes", code="body_too_large")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except APIError:
            await self._reject(send)

    async def _reject(self, send):
        body = json.dumps(_error_body(f"request body larger than {self.limit} bytes", "invalid_request_error",
                                      code="body_too_large")).encode()  # fmt: skip
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def build_app(
    engine: LLMEngine,
    *,
    served_model_name: str = "smollm2",
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    metrics = Metrics(engine)
    aengine = AsyncEngine(engine, on_output=metrics.observe)
    tokenizer = engine.tokenizer
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        aengine.start()
        yield
        aengine.shutdown()

    app = FastAPI(title="kvpage", lifespan=lifespan)
    app.state.async_engine = aengine
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_request, e: APIError):
        return JSONResponse(_error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            msg, param = f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", None
        else:
            param = ".".join(loc) or None
            msg = f"{param}: {err['msg']}" if param else err["msg"]
        return JSONResponse(_error_body(msg, "invalid_request_error", param), status_code=400)

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                           type_="authentication_error", code="invalid_api_key")  # fmt: skip

    @app.get("/health")
    async def health():
        if not aengine.alive:
            return JSONResponse({"status": "error", "error": repr(aengine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "kvpage", "max_model_len": engine.max_model_len}]}  # fmt: skip

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served_model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    def check_length(ids: list[int], max_tokens: int | None) -> int:
        limit = engine.max_model_len
        if len(ids) >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                                f"{len(ids)} tokens", param="prompt", code="context_length_exceeded")  # fmt: skip
        if max_tokens is None:
            return limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has {len(ids)} "
                                f"and max_tokens asks for {max_tokens}", param="max_tokens",
                           code="context_length_exceeded")  # fmt: skip
        return max_tokens

    def sampling(req, max_tokens: int, logprobs: int | None) -> SamplingParams:
        kw = dict(n=req.n, max_tokens=max_tokens, stop=req.stop, seed=req.seed, logprobs=logprobs,
                  ignore_eos=req.ignore_eos, min_tokens=req.min_tokens)  # fmt: skip
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                     "repetition_penalty"):  # fmt: skip
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def final(rid: str, ids: list[int], params: SamplingParams) -> RequestOutput:
        out = None
        try:
            async for item in aengine.generate(rid, ids, params):
                out = item
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(500, str(e), type_="server_error") from None
        assert out is not None
        if out.error:
            raise APIError(400, out.error)
        return out

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(req: CompletionRequest):
        check_model(req.model)
        prompts = _prompt_list(req.prompt)
        token_lists = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        vocab = engine.model_config.vocab_size
        for ids in token_lists:
            if not ids:
                raise APIError(400, "the prompt is empty", param="prompt")
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        max_tokens = min(check_length(ids, req.max_tokens) for ids in token_lists)
        params = sampling(req, max_tokens, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        rids = [f"{rid}-{i}" for i in range(len(prompts))]
        if req.stream:
            gens = [aengine.generate(r, ids, params) for r, ids in zip(rids, token_lists, strict=True)]
            return _sse(_stream_completion(rid, req, gens, token_lists))
        outs = await asyncio.gather(*(final(r, ids, params) for r, ids in zip(rids, token_lists, strict=True)))
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                text = (prompts[i] if req.echo and isinstance(prompts[i], str) else "") + c.text
                lp = _completion_logprobs(c, 0, req.logprobs) if req.logprobs is not None else None
                choices.append({"index": i * req.n + c.index, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason})  # fmt: skip
        prompt_tokens = sum(len(ids) for ids in token_lists)
        completion_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": served_model_name,
                "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}  # fmt: skip

    async def _stream_completion(rid, req, gens, token_lists) -> AsyncIterator[dict]:
        sent: dict[int, tuple[int, int]] = {}
        completion_tokens = 0
        async for i, out in _merge(gens):
            for c in out.outputs:
                idx = i * req.n + c.index
                n_text, n_tok = sent.get(idx, (0, 0))
                delta, new_tokens = c.text[n_text:], len(c.token_ids) - n_tok
                if not delta and not c.finish_reason:
                    continue
                sent[idx] = (len(c.text), len(c.token_ids))
                completion_tokens += new_tokens
                lp = _completion_logprobs(c, n_tok, req.logprobs) if req.logprobs is not None else None
                yield {"id": rid, "object": "text_completion", "created": int(time.time()),
                       "model": served_model_name,
                       "choices": [{"index": idx, "text": delta, "finish_reason": c.finish_reason,
                                    "logprobs": lp}]}  # fmt: skip
        if req.stream_options and req.stream_options.include_usage:
            yield {"id": rid, "object": "text_completion", "created": int(time.time()), "model": served_model_name,
                   "choices": [], "usage": _usage(sum(len(t) for t in token_lists), completion_tokens)}  # fmt: skip

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(req: ChatCompletionRequest):
        check_model(req.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        ids = tokenizer.encode(prompt)
        max_tokens = check_length(ids, req.max_completion_tokens or req.max_tokens)
        top = req.top_logprobs if req.logprobs else None
        params = sampling(req, max_tokens, (top or 0) if req.logprobs else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return _sse(_stream_chat(rid, req, aengine.generate(rid, ids, params), len(ids)))
        out = await final(rid, ids, params)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": {"content": _chat_logprobs(c, 0, top or 0)} if req.logprobs else None,
                    "finish_reason": c.finish_reason} for c in out.outputs]  # fmt: skip
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": served_model_name,
                "choices": choices, "usage": _usage(len(ids), completion_tokens)}  # fmt: skip

    async def _stream_chat(rid, req, gen, prompt_tokens) -> AsyncIterator[dict]:
        def chunk(choices, usage=None):
            body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": served_model_name, "choices": choices}  # fmt: skip
            if usage is not None:
                body["usage"] = usage
            return body

        sent: dict[int, tuple[int, int]] = {}
        completion_tokens = 0
        async for _, out in _merge([gen]):
            for c in out.outputs:
                if c.index not in sent:
                    sent[c.index] = (0, 0)
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])  # fmt: skip
                n_text, n_tok = sent[c.index]
                delta = c.text[n_text:]
                completion_tokens += len(c.token_ids) - n_tok
                sent[c.index] = (len(c.text), len(c.token_ids))
                lp = {"content": _chat_logprobs(c, n_tok, req.top_logprobs or 0)} if req.logprobs else None
                if delta:
                    yield chunk([{"index": c.index, "delta": {"content": delta}, "logprobs": lp,
                                  "finish_reason": None}])  # fmt: skip
                    lp = None
                if c.finish_reason:
                    yield chunk([{"index": c.index, "delta": {}, "logprobs": lp, "finish_reason": c.finish_reason}])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], _usage(prompt_tokens, completion_tokens))

    # ------------------------------------------------------------------ helpers
    def _top(pos, k: int) -> list:
        """The k most likely entries of one position, best first (the chosen token may rank lower)."""
        return sorted((lp for lp in pos.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)

    def _completion_logprobs(c, start: int, k: int) -> dict:
        tokens, token_lps, tops = [], [], []
        for tok, pos in zip(c.token_ids[start:], (c.logprobs or [])[start:], strict=False):
            tokens.append(tokenizer.decode([tok], skip_special_tokens=False))
            token_lps.append(pos[tok].logprob)
            tops.append({lp.decoded_token: lp.logprob for lp in _top(pos, k)})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": []}

    def _chat_logprobs(c, start: int, k: int) -> list[dict]:
        out = []
        for tok, pos in zip(c.token_ids[start:], (c.logprobs or [])[start:], strict=False):
            text = tokenizer.decode([tok], skip_special_tokens=False)
            top = [{"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list((lp.decoded_token or "").encode())}
                   for lp in _top(pos, k)]  # fmt: skip
            out.append({"token": text, "logprob": pos[tok].logprob, "bytes": list(text.encode()), "top_logprobs": top})
        return out

    def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
        async def body():
            try:
                async for c in chunks:
                    yield f"data: {json.dumps(c)}\n\n"
            except (APIError, ValueError, RuntimeError) as e:
                message = e.message if isinstance(e, APIError) else str(e)
                yield f"data: {json.dumps(_error_body(message, 'server_error'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return _BodyLimit(app, max_body_bytes) if max_body_bytes else app  # type: ignore[return-value]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def _prompt_list(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt)


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come; closing this closes (aborts) them all."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen):
        try:
            async for out in gen:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            await g.aclose()
