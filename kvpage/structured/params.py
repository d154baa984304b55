"""`StructuredOutputsParams`: what a request's output must be, with vLLM's names.

Exactly one of `json` (a JSON schema, as a dict or its text), `regex`, `choice` (a non-empty list of strings),
`grammar` (an EBNF / GBNF grammar whose start rule is `root`), `json_object` (any JSON object) or
`structural_tag`. Checked when made: a wrong value raises ParameterError naming the field
("structured_outputs.json", ...); whether the grammar engine can compile it is checked when the request is added.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields
from typing import Any

from kvpage.errors import ParameterError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
PREFIX = "structured_outputs"


@dataclass(frozen=True, slots=True, kw_only=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # vLLM's options for JSON schemas: no free whitespace between tokens (compact JSON), and no properties beyond
    # those a schema names even where it allows them
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None  # (vLLM's outlines option: refused, naming it)
    disable_fallback: bool = False  # (vLLM's: one engine here, nothing to fall back to)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ParameterError(PREFIX, f"{PREFIX}: give exactly one of {', '.join(KINDS)}"
                                 + (f" (got {', '.join(given)})" if given else ""))  # fmt: skip
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = _json.loads(value)
                except ValueError as e:
                    raise ParameterError(f"{PREFIX}.json", f"{PREFIX}.json is not valid JSON: {e}") from None
            if not isinstance(value, dict | bool):
                raise ParameterError(f"{PREFIX}.json", f"{PREFIX}.json must be a JSON schema (an object), got "
                                     f"{type(value).__name__}")  # fmt: skip
        elif kind == "choice":
            if not isinstance(value, list | tuple) or not value or not all(isinstance(c, str) and c for c in value):
                raise ParameterError(f"{PREFIX}.choice", f"{PREFIX}.choice must be a non-empty list of non-empty "
                                     f"strings, got {value!r}")  # fmt: skip
        elif kind == "json_object":
            if value is not True:
                raise ParameterError(f"{PREFIX}.json_object", f"{PREFIX}.json_object must be true, got {value!r}")
        elif not isinstance(value, str) or not value:
            raise ParameterError(f"{PREFIX}.{kind}", f"{PREFIX}.{kind} must be a non-empty string, got {value!r}")
        for flag in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, flag), bool):
                raise ParameterError(f"{PREFIX}.{flag}", f"{PREFIX}.{flag} must be true or false")
        if self.whitespace_pattern is not None:
            raise ParameterError(f"{PREFIX}.whitespace_pattern", f"{PREFIX}.whitespace_pattern is not supported "
                                 "(use disable_any_whitespace for compact JSON)")  # fmt: skip

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> dict | bool | None:
        """The JSON schema as a value (`json` given as text is parsed)."""
        return _json.loads(self.json) if isinstance(self.json, str) else self.json

    def key(self) -> str:
        """The constraint as canonical text: equal constraints have equal keys (the compile cache's)."""
        value = self.schema if self.kind == "json" else getattr(self, self.kind)
        options = (self.disable_any_whitespace, self.disable_additional_properties)
        return _json.dumps([self.kind, value, options], sort_keys=True, separators=(",", ":"))


def parse_structured_outputs(spec: Any) -> StructuredOutputsParams | None:
    """A request's `structured_outputs` (the params object, or a mapping of its fields) as the params object."""
    if spec is None or isinstance(spec, StructuredOutputsParams):
        return spec
    if not isinstance(spec, dict):
        kind = type(spec).__name__
        raise ParameterError(PREFIX, f"{PREFIX} must be StructuredOutputsParams or a mapping, got {kind}")
    unknown = sorted(set(spec) - {f.name for f in fields(StructuredOutputsParams)})
    if unknown:
        raise ParameterError(f"{PREFIX}.{unknown[0]}", f"unknown {PREFIX} field(s): {', '.join(unknown)}")
    return StructuredOutputsParams(**spec)
