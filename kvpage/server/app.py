"""The OpenAI-compatible app: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics,
/v1/kv_events (+ /snapshot): the blocks this replica's KV cache holds, as vLLM-style events, and
/dashboard: a live picture of the KV cache (dashboard.py).

Every request of every client goes to one AsyncEngine, which batches them together; the endpoint
families live in serving_completions.py and serving_chat.py. Errors use OpenAI's body (errors.py),
with a status that names the problem; one bad request never disturbs the others. Outermost first,
a request meets: the X-Request-Id echo, the API-key check (auth.py, headers only), the body's
bounds in size and time (body_limit.py), then FastAPI. serve.py runs it (signals, engine death).
"""

from __future__ import annotations

import inspect
import json
import time
import uuid
from dataclasses import asdict
from urllib.parse import quote

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvpage import __version__
from kvpage.engine.llm_engine import LLMEngine
from kvpage.server.async_engine import AsyncEngine
from kvpage.server.auth import APIKeyAuth, checked_api_keys, route_path
from kvpage.server.body_limit import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, BodyLimit
from kvpage.server.dashboard import EngineFeed, install_dashboard
from kvpage.server.errors import install_error_handlers
from kvpage.server.metrics import PREFIXES, Metrics, renamed
from kvpage.server.openapi import install_openapi
from kvpage.server.protocol import (
    MAX_NAMED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvpage.server.serving import DEFAULT_MAX_PROMPTS_PER_REQUEST, ClientDisconnected, off_loop
from kvpage.server.serving_chat import ChatServing
from kvpage.server.serving_completions import CompletionServing
from kvpage.server.serving_tokens import TokenServing

CLIENT_CLOSED_REQUEST = 499  # nginx's status for an answer nobody was left to read


def build_app(
    engine: LLMEngine | None = None,
    *,
    client=None,
    metrics=None,
    served_model_name: str = "smollm2",
    api_key: str | list[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
    salt_cache_per_key: bool = False,
    force_include_usage: bool = False,
    metrics_prefix: str = "kvpage",
    return_tokens_as_token_ids: bool = False,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    dashboard=None,
):
    """The ASGI app over one LLMEngine in this process, or over another engine client (engine_client.py:
    a fleet's, with its own `metrics`: an object whose `render()` gives /metrics' body, awaitable or
    not) and, optionally, its `dashboard` feed (dashboard.py: an object whose `pictures()` gives /dashboard's
    pictures). `api_key`: one key or several (each client uses one); None: no authentication.
    `app.state.async_engine` (on the FastAPI app, `.fastapi` of what is returned) is the engine client."""
    keys = checked_api_keys(api_key, salt_cache_per_key)
    if metrics_prefix not in PREFIXES:
        raise ValueError(f"metrics_prefix must be one of {', '.join(PREFIXES)}, got {metrics_prefix!r}")
    if (engine is None) == (client is None):
        raise ValueError("build_app takes an engine or a client, not both")
    if engine is not None:
        metrics = Metrics(engine, served_model_name)
        aengine = AsyncEngine(engine, on_output=metrics.observe, on_abort=metrics.aborted)
        dashboard = EngineFeed(engine, wake=aengine.wake)
        aengine.between_steps.append(dashboard)
    else:
        aengine = client
    serving = dict(max_prompts_per_request=max_prompts_per_request, salt_cache_per_key=salt_cache_per_key,
                   force_include_usage=force_include_usage,
                   return_tokens_as_token_ids=return_tokens_as_token_ids,
                   tool_call_parser=tool_call_parser)  # fmt: skip
    del enable_auto_tool_choice  # (vLLM's flag: auto tool choice is on wherever a parser is given)
    completions = CompletionServing(aengine, served_model_name, **serving)
    chat = ChatServing(aengine, served_model_name, **serving)
    tokens = TokenServing(aengine, served_model_name, **serving)
    load = _ServerLoad()
    created = int(time.time())

    async def lifespan(_app):
        aengine.start()
        yield
        aengine.begin_shutdown()
        aengine.shutdown()

    app = FastAPI(title="kvpage", lifespan=lifespan)
    app.state.async_engine = aengine
    app.state.metrics = metrics
    app.state.dashboard = dashboard
    install_error_handlers(app)
    install_openapi(app, aengine.engine.model_config.vocab_size)

    async def answered(req, work):
        try:
            body = await work
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return named_ignored(req, body if isinstance(body, Response) else JSONResponse(body))

    @app.get("/health")
    async def health():
        if not aengine.alive:
            reason = repr(aengine.error) if aengine.error else "the engine is not running"
            return JSONResponse({"status": "error", "error": reason}, status_code=503)
        if aengine.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body = metrics.render()
        body = await body if inspect.isawaitable(body) else body
        return Response(renamed(body, metrics_prefix), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "kvpage",
                "max_model_len": aengine.engine.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    if engine is not None:
        _kv_event_routes(app, engine)
    if dashboard is not None:
        install_dashboard(app, dashboard, closing=lambda: aengine.closing or not aengine.alive)

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw_request: Request):
        return await answered(req, completions.create(req, raw_request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request):
        return await answered(req, chat.create(req, raw_request))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        """vLLM's: the prompt's (or the chat-templated messages') token ids, as the engine counts them."""
        # (in the tokenizer thread, as the generation endpoints)
        return named_ignored(req, JSONResponse(await off_loop(tokens.tokenize, req)))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return named_ignored(req, JSONResponse(tokens.detokenize(req)))

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/load")
    async def server_load():
        """vLLM's: the generation requests in flight (streams until their last chunk)."""
        return {"server_load": load.in_flight}

    inner = load.wrap(app)
    if hasattr(metrics, "load_report"):
        inner = _OrcaLoadHeader(inner, metrics)
    asgi = BodyLimit(inner, max_body_bytes, body_timeout)
    if keys:
        asgi = APIKeyAuth(asgi, keys)
    asgi = _EitherSideOfTheProxy(_EchoRequestId(asgi))
    asgi.fastapi = app  # type: ignore[attr-defined]
    return asgi


def named_ignored(req, response: Response) -> Response:
    """The request's ignored fields (protocol.py) in the x-kvpage-ignored-fields header: comma-separated,
    percent-encoded (a field name is any JSON string), each cut at 64 characters, at most
    MAX_NAMED_FIELDS of them and then "+N" for the rest."""
    ignored = req.ignored_fields
    if ignored:
        names = [quote(name[:64], safe="") for name in ignored[:MAX_NAMED_FIELDS]]
        if len(ignored) > MAX_NAMED_FIELDS:
            names.append(f"+{len(ignored) - MAX_NAMED_FIELDS}")
        response.headers["x-kvpage-ignored-fields"] = ",".join(names)
    return response


def _kv_event_routes(app: FastAPI, engine: LLMEngine) -> None:
    @app.get("/v1/kv_events")
    async def kv_events(since: int = Query(0, ge=0, description="the last batch seen; 0: from the start")):
        """The KV events after batch `since` (kvpage/core/kv_events.py): what this replica's cache
        stored and removed, in vLLM's shape. `gap`: batches were dropped since then; resynchronise
        from /v1/kv_events/snapshot."""
        log = engine.kv_events
        batches, gap = log.since(since)
        return {"seq": batches[-1].seq if batches else max(since, log.seq), "gap": gap, "block_size": log.block_size,
                "batches": [{"seq": b.seq, "events": [asdict(e) for e in b.events]} for b in batches]}  # fmt: skip

    @app.get("/v1/kv_events/snapshot")
    async def kv_events_snapshot():
        """Every block this replica's cache holds, as BlockStored events, as of batch `seq`."""
        seq, held = engine.kv_events.snapshot()
        return {"seq": seq, "block_size": engine.kv_events.block_size, "blocks": [asdict(e) for e in held]}


class _ServerLoad:
    """Generation requests in flight: counted from their start to the last byte of their answer."""

    PATHS = ("/v1/completions", "/v1/chat/completions")

    def __init__(self) -> None:
        self.in_flight = 0

    def wrap(self, app):
        async def counted(scope, receive, send):
            if scope["type"] != "http" or route_path(scope) not in self.PATHS:
                return await app(scope, receive, send)
            self.in_flight += 1
            done = False

            async def send_counted(message):
                nonlocal done
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body") and not done:
                    done = True
                    self.in_flight -= 1

            try:
                await app(scope, receive, send_counted)
            finally:
                if not done:
                    self.in_flight -= 1

        return counted


class _OrcaLoadHeader:
    """ORCA load reports, as vLLM sends them to load-aware gateways (Envoy): a completion or chat request
    with `endpoint-load-metrics-format: text|json` gets an `endpoint-load-metrics` response header with
    the KV cache's usage and the requests waiting: `metrics.load_report()` (awaitable or not; None: no
    report), the engine's latest snapshot on one server, the replicas' latest reports behind a fleet."""

    def __init__(self, app, metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        fmt = next((v for k, v in scope.get("headers") or () if k == b"endpoint-load-metrics-format"), b"").lower()
        if scope["type"] != "http" or fmt not in (b"text", b"json") or route_path(scope) not in _ServerLoad.PATHS:
            return await self.app(scope, receive, send)

        async def send_with_load(message):
            if message["type"] == "http.response.start":
                named = self.metrics.load_report()
                named = await named if inspect.isawaitable(named) else named
                if named is not None:
                    if fmt == b"json":
                        value = "JSON " + json.dumps({"named_metrics": named})
                    else:
                        value = "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named.items())
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"endpoint-load-metrics", value.encode())]}  # fmt: skip
            await send(message)

        await self.app(scope, receive, send_with_load)


class _EchoRequestId:
    """Every HTTP response carries an X-Request-Id (errors included): the client's, echoed, or one made
    here when it sent none, as OpenAI does (the openai client shows it as `_request_id`)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = next((v for k, v in scope.get("headers") or () if k == b"x-request-id"), None)
        if rid is None:
            rid = f"req_{uuid.uuid4().hex}".encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _EitherSideOfTheProxy:
    """With --root-path P, a path is answered whether the proxy in front stripped P (/v1/models) or not
    (P/v1/models, or a client that calls the server directly with the prefix), as vLLM's. uvicorn puts
    P in front of every path; a path that carried P already has it twice: one is taken off here."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        root = scope.get("root_path", "")
        if root and scope["type"] in ("http", "websocket"):
            path, twice = scope.get("path", ""), root + root
            if path == twice or path.startswith(twice + "/"):
                raw = scope.get("raw_path")
                scope = {
                    **scope,
                    "path": path[len(root) :],
                    "raw_path": raw[len(root.encode()) :] if raw and raw.startswith(twice.encode()) else raw,
                }
        await self.app(scope, receive, send)
