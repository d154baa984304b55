"""`kvpage serve`'s own options, declared as fields (options.py makes each an option), and what they give:
the API keys, and build_app's keywords. Adding a server option means adding a field here; `app=True`
passes it to build_app under the field's name (one server's app, or a fleet's ingress)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from kvpage.cli.options import add_options
from kvpage.config import option


@dataclass(slots=True)
class ServeOptions:
    """Declared, never built: the fields are the options, in the order `kvpage serve -h` lists them."""

    host: str = option("127.0.0.1", "address to bind (default 127.0.0.1: this machine only)")
    port: int = option(8000, "port (default 8000)", type=int)
    api_key: list[str] | None = option(
        None,
        "require 'Authorization: Bearer KEY' on every path but /health; repeat for several "
        "clients' keys (also KVPAGE_API_KEY); an empty key is refused",
        action="append",
        metavar="KEY",
    )
    salt_cache_per_key: bool = option(
        False,
        "keep each API key's prefix cache apart, so no client can tell from /metrics or "
        "timing what another client's prompts began with",
        app=True,
    )
    served_model_name: str | None = option(None, "the model id clients use (default: --model)", app=True)
    root_path: str = option(
        "",
        "served under this path prefix by a proxy that strips it (vLLM's --root-path); the OpenAPI document names it",
        metavar="PATH",
    )
    return_tokens_as_token_ids: bool = option(
        False,
        'logprobs name each token "token_id:N" instead of its text (vLLM\'s; a request may say otherwise)',
        app=True,
    )
    metrics_prefix: str = option(
        "kvpage",
        "name /metrics' families kvpage:* (default) or vllm:*, for a vLLM dashboard as it is",
        choices=["kvpage", "vllm"],
        app=True,
    )
    force_include_usage: bool = option(
        False,
        "every stream ends with a usage chunk, asked for or not (vLLM's flag)",
        flag="--enable-force-include-usage",
        app=True,
    )
    tool_call_parser: str | None = option(
        None,
        'how tool_choice "auto" finds tool calls in an answer: the chat-template family\'s format (hermes: '
        "Hermes / Qwen's <tool_call>; llama3_json; mistral: [TOOL_CALLS]); without it, auto is refused",
        choices=["hermes", "llama3_json", "mistral"],
        app=True,
    )
    enable_auto_tool_choice: bool = option(
        False, "vLLM's flag, accepted: auto tool choice is on wherever --tool-call-parser is given", app=True
    )
    max_body_bytes: int = option(1 << 20, "largest request body (default 1 MiB)", type=int, app=True)
    body_timeout: float = option(
        30.0, "seconds a request body may take to arrive, else 408 (default 30)", type=float, app=True
    )
    max_prompts_per_request: int = option(
        256, "most prompts in one /v1/completions request (default 256)", type=int, app=True
    )
    log_level: str = option("warning", "uvicorn log level (default warning)")


def add_serve_options(p: argparse.ArgumentParser) -> None:
    add_options(p, ServeOptions)


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys of --api-key and KVPAGE_API_KEY, checked as build_app checks them, before a model loads."""
    from kvpage.server.auth import checked_api_keys

    env_key = os.environ.get("KVPAGE_API_KEY")
    given = [*(args.api_key or []), *([env_key] if env_key is not None else [])]
    return checked_api_keys(given or None, args.salt_cache_per_key, key_option="--api-key / KVPAGE_API_KEY",
                            salt_option="--salt-cache-per-key")  # fmt: skip


def app_kwargs(args: argparse.Namespace, keys: list[str]) -> dict:
    """build_app's options from `kvpage serve`'s (one server or a fleet's ingress)."""
    kw = {f.name: getattr(args, f.name) for f in fields(ServeOptions) if f.metadata.get("app")}
    return {**kw, "served_model_name": args.served_model_name or args.model, "api_key": keys or None}
