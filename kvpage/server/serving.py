"""`OpenAIServing`: what the completions and chat endpoints share.

The model and length checks, the request's sampling (or beam-search) parameters, its prefix-cache
salt, running its prompts through the AsyncEngine (a bounded window at a time, aborted as soon as
the client goes away, streaming or not), and the mapping of engine errors to HTTP statuses.
Tokenizing and templating run in one worker thread (`off_loop`), not in the event loop: a prompt of
300,000 words takes ~0.4 s to tokenize, and /health, the streams and the other clients must not wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request

from kvpage.errors import ParameterError
from kvpage.outputs import Logprob, PositionLogprobs, RequestOutput
from kvpage.sampling_params import BeamSearchParams, SamplingParams, parse_kv_eviction
from kvpage.server.async_engine import AsyncEngine, EngineUnavailable
from kvpage.server.errors import APIError
from kvpage.server.streaming import merge
from kvpage.server.tool_calls import PARSERS, named_schema, required_schema
from kvpage.structured.params import StructuredOutputsParams, parse_structured_outputs

DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
_TOKENIZER_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpage-tokenizer")


async def off_loop(fn: Callable, *args):
    """`fn(*args)` in the tokenizer thread (the tokenizer releases the GIL while it works)."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREAD, fn, *args)


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; its requests were aborted."""


def translate(e: BaseException) -> BaseException:
    """An engine-side exception as the APIError the client gets."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineUnavailable):
        return APIError(503, str(e), code="engine_unavailable")
    if isinstance(e, ValueError):  # a ParameterError names its field
        return APIError(400, str(e), param=e.param if isinstance(e, ParameterError) else None)
    if isinstance(e, RuntimeError):
        return APIError(500, str(e))
    return e


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def constraint_field(req) -> str | None:
    """Which of a request's fields asks for a structured output (None: none does); two of them are a 400. Tools
    under tool_choice "required" or a named function are one (the output is the calls' JSON)."""
    text = req.response_format is not None and req.response_format.type == "text"  # (no constraint)
    names = ("response_format", *_GUIDED, "structured_outputs")
    given = [n for n in names if getattr(req, n) is not None and not (n == "response_format" and text)]
    if getattr(req, "tool_mode", "none") in ("required", "named"):
        given.insert(0, "tools")
    if len(given) > 1:
        raise APIError(400, f"{given[1]}: give one of {given[0]} and {given[1]}, not both", param=given[1])
    return given[0] if given else None


def structured_outputs_of(req) -> StructuredOutputsParams | None:
    """The engine's structured output for a request body (OpenAI's response_format, vLLM's guided_* or its
    structured_outputs), or None; a bad value is a 400 naming the field."""
    field = constraint_field(req)
    if field is None:
        return None
    try:
        if field == "tools":
            tools = [t.function.model_dump() for t in req.tools]
            if req.tool_mode == "required":
                return StructuredOutputsParams(json=required_schema(tools))
            (tool,) = [t for t in tools if t["name"] == req.tool_choice.function["name"]]
            return StructuredOutputsParams(json=named_schema(tool))
        if field == "response_format":
            rf = req.response_format
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {"type": "object"}
            return StructuredOutputsParams(json=schema)
        if field in _GUIDED:
            return StructuredOutputsParams(**{_GUIDED[field]: getattr(req, field)})
        return parse_structured_outputs(req.structured_outputs)
    except ParameterError as e:
        raise constraint_error(field, e) from None


def constraint_error(field: str, e: ParameterError) -> APIError:
    """A constraint that cannot be read or compiled, as the 400 naming the request's field (vLLM's own
    structured_outputs names its inner field as the engine did: structured_outputs.json, ...)."""
    if field == "structured_outputs":
        return APIError(400, str(e), param=e.param)
    return APIError(400, f"{field}: {e}", param=field)


async def until_disconnected(raw_request: Request, work: Awaitable):
    """The result of `work`, unless the client disconnects first: then `work` is cancelled (which
    aborts its engine requests) and ClientDisconnected is raised."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect():
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done() and asyncio.current_task().cancelling():  # the handler itself is cancelled
            task.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected


class OpenAIServing:
    def __init__(
        self,
        aengine: AsyncEngine,
        served_model_name: str,
        *,
        max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
        salt_cache_per_key: bool = False,
        force_include_usage: bool = False,  # --enable-force-include-usage
        return_tokens_as_token_ids: bool = False,  # --return-tokens-as-token-ids: every request's default
        tool_call_parser: str | None = None,  # --tool-call-parser: tool_choice "auto" is served with it
    ) -> None:
        self.aengine = aengine
        self.engine = aengine.engine
        self.tokenizer = aengine.engine.tokenizer
        self.served_model_name = served_model_name
        self.max_prompts_per_request = max_prompts_per_request
        self.salt_cache_per_key = salt_cache_per_key
        self.force_include_usage = force_include_usage
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}")
        self.tool_call_parser = tool_call_parser

    # ------------------------------------------------------------------ checks
    def check_model(self, name: str | None) -> None:
        """404 for another model's name; none given means the served model, as vLLM takes it."""
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.served_model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    def eviction(self, req):
        """The request's eviction policy: its own `kv_eviction`, else the engine's; 400 if malformed."""
        try:
            policy = parse_kv_eviction(req.kv_eviction)
        except ValueError as e:
            raise APIError(400, str(e), param="kv_eviction") from None
        return self.engine.config.kv_eviction if policy is None else policy

    def check_length(self, ids: list[int], max_tokens: int | None, eviction, prompt_field: str = "prompt",
                     max_tokens_field: str = "max_tokens") -> int:  # fmt: skip
        """The output budget; 400 context_length_exceeded naming the request's own field (the chat
        endpoint's prompt is its `messages`, its budget `max_completion_tokens` where that was given)."""
        limit = self.engine.max_model_len
        if eviction.unbounded:  # StreamingLLM runs past the context
            return max_tokens if max_tokens is not None else max(1, limit - len(ids))
        if len(ids) >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but the {prompt_field} "
                                f"resulted in {len(ids)} tokens", param=prompt_field,
                           code="context_length_exceeded")  # fmt: skip
        if max_tokens is None:
            return limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the {prompt_field} resulted "
                                f"in {len(ids)} and {max_tokens_field} asks for {max_tokens}",
                           param=max_tokens_field, code="context_length_exceeded")  # fmt: skip
        return max_tokens

    def params(
        self, req, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None, eviction
    ) -> SamplingParams | BeamSearchParams:
        """The engine's parameters for a request body; a bad value is a 400 naming its field."""
        vocab = self.engine.model_config.vocab_size
        for tok in req.logit_bias or ():
            if tok >= vocab:
                raise APIError(400, f"logit_bias: token id {tok} is outside the vocabulary [0, {vocab})",
                               param="logit_bias")  # fmt: skip
        structured = structured_outputs_of(req)
        try:
            if req.use_beam_search:
                for name, unsupported in (("logprobs", logprobs is not None),
                                          ("prompt_logprobs", prompt_logprobs is not None),
                                          ("logit_bias", bool(req.logit_bias))):  # fmt: skip
                    if unsupported:
                        raise APIError(400, f"{name} is not supported with use_beam_search", param=name)
                return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                        length_penalty=float(req.length_penalty),
                                        include_stop_str_in_output=req.include_stop_str_in_output,
                                        kv_eviction=eviction, kv_read_budget=req.kv_read_budget,
                                        structured_outputs=structured)  # fmt: skip
            kw = dict(n=req.n, max_tokens=max_tokens, stop=req.stop, seed=req.seed, logprobs=logprobs,
                      structured_outputs=structured,
                      prompt_logprobs=prompt_logprobs, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                      stop_token_ids=req.stop_token_ids, skip_special_tokens=req.skip_special_tokens,
                      include_stop_str_in_output=req.include_stop_str_in_output,
                      logit_bias=req.logit_bias or None, kv_eviction=eviction,
                      kv_read_budget=req.kv_read_budget)  # fmt: skip
            for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                         "repetition_penalty"):  # fmt: skip
                value = getattr(req, name)
                if value is not None:
                    kw[name] = value
            return SamplingParams(**kw)
        except ValueError as e:  # a ParameterError names its field
            raise APIError(400, str(e), param=e.param if isinstance(e, ParameterError) else None) from None

    async def compile_constraint(self, req, params) -> None:
        """A structured output compiled before its request reaches the engine (in the grammar thread; the engine
        then finds it cached and never compiles on its own thread); one that cannot be is a 400 naming the field."""
        spec = params.structured_outputs
        if spec is None:
            return
        field = constraint_field(req)
        try:
            if not self.engine.structured.submitted(spec):
                await off_loop(self.engine.structured.check, spec)
            await asyncio.wrap_future(self.engine.structured.submit(spec))
        except ParameterError as e:
            raise constraint_error(field, e) from None

    def cache_salt(self, req, raw_request: Request) -> str | None:
        """The request's prefix-cache salt: its own `cache_salt`, and its tenant's with --salt-cache-per-key."""
        parts = []
        if self.salt_cache_per_key:
            parts.append(getattr(raw_request.state, "tenant", None) or "anonymous")
        if req.cache_salt:
            parts.append(req.cache_salt)
        return "\x1f".join(parts) or None

    def check_ready(self, req) -> None:
        """What would otherwise surface only inside a stream, after its 200: a server that takes no
        requests (503) and a width the engine can never run (400)."""
        if self.aengine.closing:
            raise APIError(503, "the server is shutting down", code="engine_unavailable")
        if not self.aengine.alive:
            raise APIError(503, f"the engine stopped: {self.aengine.error!r}", code="engine_unavailable")
        try:
            self.engine.check_width("n", req.n)
        except ValueError as e:
            raise APIError(400, str(e), param="n") from None

    def window(self, width: int) -> int:
        """How many of one HTTP request's prompts run at a time: half the batch at most."""
        return max(1, self.engine.config.max_num_seqs // (2 * width))

    # ------------------------------------------------------------------ running
    def generators(self, rid: str, prompts: list, params, salt) -> list[AsyncIterator[RequestOutput]]:
        """One engine request per prompt (token ids, or a SegmentedPrompt)."""
        return [self.aengine.generate(f"{rid}-{i}", p, params, salt) for i, p in enumerate(prompts)]

    async def outputs(self, gens, width: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come; engine errors become APIErrors."""
        try:
            async with contextlib.aclosing(merge(gens, self.window(width))) as outs:
                async for i, out in outs:
                    if out.error:
                        raise APIError(400 if out.rejected else 500, out.error)
                    yield i, out
        except Exception as e:  # noqa: BLE001 - translated, not swallowed
            raise translate(e) from None

    async def final_outputs(self, raw_request: Request, gens, width: int) -> list[RequestOutput]:
        """Every prompt's last output; the client leaving aborts them all (ClientDisconnected)."""

        async def collect():
            finals: list[RequestOutput | None] = [None] * len(gens)
            async for i, out in self.outputs(gens, width):
                finals[i] = out
            return finals

        return await until_disconnected(raw_request, collect())

    # ------------------------------------------------------------------ formatting
    def stream_usage(self, req) -> tuple[bool, bool]:
        """(a usage chunk ends the stream, every chunk carries the usage so far), as vLLM decides them:
        stream_options.include_usage or --enable-force-include-usage; continuous_usage_stats."""
        opts = req.stream_options
        final = self.force_include_usage or bool(opts and opts.include_usage)
        return final, final and bool(opts and opts.continuous_usage_stats)

    def prompt_logprobs_json(self, positions: list[PositionLogprobs | None] | None) -> list | None:
        """vLLM's prompt_logprobs: per prompt token, None (the first) or {token id: {logprob, rank, decoded_token}}."""
        if positions is None:
            return None
        return [None if pos is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                   "decoded_token": lp.decoded_token} for t, lp in pos.items()}
                for pos in positions]  # fmt: skip

    def token_label(self, req, token_id: int, decoded: str | None = None) -> str:
        """A token as logprobs name it: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids, for
        tokens that are not whole characters)."""
        as_ids = req.return_tokens_as_token_ids
        if as_ids if as_ids is not None else self.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return decoded if decoded is not None else self.token_text(token_id)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def top_entries(pos: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The k most likely (token id, entry) of one position, best first (the chosen token may rank lower)."""
    top = [(t, lp) for t, lp in pos.items() if lp.rank is not None and lp.rank <= k]
    return sorted(top, key=lambda item: item[1].rank)  # type: ignore[arg-type, return-value]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage, with `prompt_tokens_details.cached_tokens`: the prompt tokens the prefix cache
    served (what a router that knows the replicas' blocks buys a client)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip
