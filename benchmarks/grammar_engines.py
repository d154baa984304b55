"""Which grammar engine kvpage's structured outputs run on, measured: xgrammar and llguidance on SmolLM2's
vocabulary (49,152 tokens), on the same schemas, regexes and grammars: the one-off cost of reading the vocabulary,
each constraint's compile time (cold caches), and the mask time per generated token while a valid output is fed
token by token (every token of it must be allowed by the mask: a constraint an engine rejects, or a valid output it
refuses, counts as unsupported).

    python benchmarks/grammar_engines.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _report import append_results, machine, parse, recording, suite_args, write_json

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 40}, "age": {"type": "integer", "minimum": 0,
    "maximum": 150}, "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {
    "type": "string"}, "maxItems": 4}}, "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
# name -> (kind, constraint, a valid output)
CASES = {
    "json: flat object": ("json", {"type": "object", "properties": {"city": {"type": "string"}, "population": {
        "type": "integer"}}, "required": ["city", "population"]}, '{"city": "Lyon", "population": 522250}'),
    "json: nested, arrays, optional": ("json", {"type": "object", "properties": {"people": {"type": "array",
        "items": PERSON, "minItems": 1}, "source": {"type": "string"}}, "required": ["people"]},
        '{"people": [{"name": "Ada", "age": 36, "tags": ["math"]}, {"name": "Alan", "age": 41}]}'),
    "json: enums, numbers, const": ("json", {"type": "object", "properties": {"unit": {"enum": ["C", "F", "K"]},
        "value": {"type": "number", "minimum": -273.15}, "version": {"const": 2}, "ok": {"type": "boolean"}},
        "required": ["unit", "value", "version", "ok"]}, '{"unit": "K", "value": 350.5, "version": 2, "ok": true}'),
    # (both engines refuse an exponent in a number with a bound, though it is valid JSON: the bound's grammar has none)
    "json: bounded number, exponent": ("json", {"type": "object", "properties": {"v": {"type": "number",
        "minimum": -300}}, "required": ["v"]}, '{"v": -2.5e-3}'),
    "json: $defs, anyOf, formats": ("json", {"$defs": {"point": {"type": "object", "properties": {"x": {"type":
        "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}}, "type": "object", "properties": {"at": {
        "anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]}, "when": {"type": "string", "format": "date-time"},
        "id": {"type": "string", "format": "uuid"}}, "required": ["at", "when", "id"]},
        '{"at": {"x": 1.5, "y": -2}, "when": "2026-12-07T12:00:00Z", "id": "123e4567-e89b-12d3-a456-426614174000"}'),
    "json: string pattern": ("json", {"type": "object", "properties": {"code": {"type": "string", "pattern":
        "^[A-Z]{3}-[0-9]{4}$"}}, "required": ["code"]}, '{"code": "KVP-2026"}'),
    "json object (any)": ("json_object", None, '{"a": [1, 2, {"b": null}], "c": "d"}'),
    "regex: phone": ("regex", r"\+?[0-9]{1,3}-[0-9]{3}-[0-9]{3}-[0-9]{4}", "+1-555-010-4477"),
    "choice": ("choice", ["positive", "negative", "neutral"], "negative"),
    "grammar: arithmetic (EBNF)": ("ebnf", 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | '
        '"/") factor)*\nfactor ::= [0-9]+ | "(" expr ")"', "(12+3)*4-5/6"),
}  # fmt: skip


def tokenizer():
    """SmolLM2's tokenizer (kvpage's, from its GGUF) as transformers' fast tokenizer, and its EOS ids."""
    from gguf import GGUFReader
    from transformers import PreTrainedTokenizerFast

    from kvpage.models.gguf_loader import _metadata
    from kvpage.models.loader import resolve_model_path
    from kvpage.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(_metadata(GGUFReader(str(resolve_model_path("smollm2")))))
    return tok, PreTrainedTokenizerFast(tokenizer_object=tok.backend)


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.vocab = vocab

    def compile(self, kind: str, spec):
        c = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec))
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_regex("|".join(self._escape(s) for s in spec))
        return c.compile_grammar(spec)

    @staticmethod
    def _escape(s: str) -> str:
        import re

        return re.escape(s)

    def run(self, compiled, tokens: list[int]) -> tuple[list[float], bool]:
        """Mask seconds per token while `tokens` are fed; whether every one was allowed."""
        import torch

        m = self.xgr.GrammarMatcher(compiled)
        mask = self.xgr.allocate_token_bitmask(1, self.vocab)
        times, ok = [], True
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
            allowed = bool((mask[0, t // 32] >> (t % 32)) & 1)
            ok &= allowed and m.accept_token(t)
            if not ok:
                break
        del torch
        return times, ok and m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int, eos: list[int]) -> None:
        import llguidance as llg
        import llguidance.hf

        self.llg = llg
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
        self.vocab = vocab

    def compile(self, kind: str, spec):
        llg = self.llg
        if kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(spec))
        elif kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            import re

            grammar = llg.LLMatcher.grammar_from_regex("|".join(re.escape(s) for s in spec))
        else:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            grammar = llg.LLMatcher.grammar_from_lark(gbnf_to_lark(spec))
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
        if is_error:
            raise ValueError(messages[0])
        m = llg.LLMatcher(self.tok, grammar)  # (it compiles lazily: the first mask is part of compiling)
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(m, lt.allocate_token_bitmask(1, self.vocab), 0)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def run(self, grammar, tokens: list[int]) -> tuple[list[float], bool]:
        import llguidance.torch as lt

        m = self.llg.LLMatcher(self.tok, grammar)
        mask = lt.allocate_token_bitmask(1, self.vocab)
        times, ok = [], True
        for t in tokens:
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - t0)
            allowed = bool((mask[0, t // 32] >> (t % 32)) & 1)
            ok &= allowed and m.consume_token(t)
            if not ok:
                break
        return times, ok and (m.is_stopped() or m.is_accepting())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    suite_args(ap)
    ap.add_argument("--repeat", type=int, default=3, help="compile and mask runs per case (medians reported)")
    args = parse(ap, argv, __file__)
    import jsonschema

    tok, hf = tokenizer()
    vocab, eos = 49152, tok.eos_token_ids
    rows, data = [], {"cases": {}, "setup_s": {}}
    engines = []
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        engines.append(cls(hf, vocab, eos))
        data["setup_s"][cls.name] = time.perf_counter() - t0
    repeat = 1 if args.smoke else args.repeat
    for case, (kind, spec, valid) in CASES.items():
        if kind == "json":
            jsonschema.validate(json.loads(valid), spec)  # (the sample output is valid)
        tokens = tok.encode(valid, add_special_tokens=False) + eos[:1]
        entry = {}
        for e in engines:
            try:
                compiles, masks, accepted = [], [], True
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    compiled = e.compile(kind, spec)
                    compiles.append(time.perf_counter() - t0)
                    times, ok = e.run(compiled, tokens)
                    accepted &= ok
                    masks += times
                entry[e.name] = {"compile_ms": 1e3 * statistics.median(compiles), "accepted": accepted,
                                 "mask_us_median": 1e6 * statistics.median(masks),
                                 "mask_us_p90": 1e6 * statistics.quantiles(masks, n=10)[-1] if len(masks) > 1
                                 else 1e6 * masks[0]}  # fmt: skip
            except Exception as ex:  # noqa: BLE001 - an engine that rejects the constraint: unsupported
                entry[e.name] = {"error": f"{type(ex).__name__}: {str(ex)[:120]}"}
        data["cases"][case] = entry | {"tokens": len(tokens)}
        cells = []
        for e in engines:
            r = entry[e.name]
            cells.append("unsupported" if "error" in r else
                         f"{r['compile_ms']:.1f} ms / {r['mask_us_median']:.0f} µs ({r['mask_us_p90']:.0f})"
                         + ("" if r["accepted"] else " REFUSED the valid output"))  # fmt: skip
        rows.append(f"| {case} | {len(tokens)} | " + " | ".join(cells) + " |")
    setup = ", ".join(f"{k} {v:.2f} s" for k, v in data["setup_s"].items())
    table = ("| constraint | output tokens | xgrammar: compile / mask median (p90) | llguidance: compile / mask median "
             "(p90) |\n|---|---|---|---|\n" + "\n".join(rows))  # fmt: skip
    print(f"machine: {machine()}\nvocabulary read once: {setup}\n\n{table}")
    write_json("grammar_engines", data)
    if recording(args):
        append_results("Grammar engines for structured outputs (benchmarks/grammar_engines.py)",
                       f"SmolLM2's vocabulary (49,152 tokens), one thread, cold compiles; mask time per token while "
                       f"a valid output is fed (medians of {repeat} runs). Vocabulary read once: {setup}.\n\n{table}",
                       "xgrammar", "llguidance", "torch")  # fmt: skip


if __name__ == "__main__":
    main()
