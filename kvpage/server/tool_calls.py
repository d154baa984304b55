"""Tool calls on the chat endpoint: OpenAI's `tools` and `tool_choice`, as vLLM serves them.

- `tool_choice="required"`: the output is constrained (structured outputs) to a JSON array of calls, each
  `{"name": <a tool's name>, "parameters": <that tool's parameters>}`; a named function
  (`{"type": "function", "function": {"name": ...}}`): to that tool's parameters alone. Either way the answer's
  `message.tool_calls` carries them (arguments as a JSON string) and `finish_reason` is "tool_calls".
- `tool_choice="auto"` (the default when tools are given): the model writes calls in its chat-template family's
  own format, found after generation by the parser the server was started with (`--tool-call-parser`: hermes
  for Hermes / Qwen's `<tool_call>{...}</tool_call>`, llama3_json for Llama 3's JSON, mistral for
  `[TOOL_CALLS][...]`); text outside the calls is the message's content.
- `tool_choice="none"`: plain text.

The parsers are pure functions of the text: (content, [(name, arguments JSON)]).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

Calls = list[tuple[str, str]]  # (function name, arguments as a JSON string)


def required_schema(tools: list[dict]) -> dict:
    """The output's schema under tool_choice "required": one or more calls of the given tools."""
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
              "parameters": t.get("parameters") or {"type": "object"}},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]  # fmt: skip
    return {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


def named_schema(tool: dict) -> dict:
    return tool.get("parameters") or {"type": "object"}


def _decoded(fragment: str) -> Any:
    try:
        return json.loads(fragment)
    except ValueError:
        return None


def _call(obj: Any, args_key: str) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def parse_hermes(text: str) -> tuple[str | None, Calls]:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as many as there are."""
    found = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, flags=re.DOTALL)
    calls = [c for c in (_call(_decoded(f), "arguments") for f in found) if c is not None]
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, Calls]:
    """Llama 3's: the whole answer one JSON call `{"name": ..., "parameters": {...}}` (or several, separated by
    ";"), after an optional <|python_tag|>."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = [_call(_decoded(part), "parameters") for part in body.split(";")]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, calls  # type: ignore[return-value]


def parse_mistral(text: str) -> tuple[str | None, Calls]:
    """Mistral's: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`."""
    if "[TOOL_CALLS]" not in text:
        return text, []
    before, after = text.split("[TOOL_CALLS]", 1)
    decoded = _decoded(after.strip())
    items = decoded if isinstance(decoded, list) else [decoded]
    calls = [_call(item, "arguments") for item in items]
    if not calls or any(c is None for c in calls):
        return text, []
    return before.strip() or None, calls  # type: ignore[return-value]


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}


def tool_call_json(name: str, arguments: str) -> dict:
    """One entry of `message.tool_calls`, with an id of its own."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip
