"""Structured outputs: a request's output constrained to a JSON schema, a regex, a choice of strings or a grammar.

params.py     StructuredOutputsParams (vLLM's names), checked when made; torch-free
grammars.py   the grammar engine (xgrammar: benchmarks/grammar_engines.py says why): a constraint checked at
              once, compiled for the vocabulary in a worker thread, cached by the constraint
matchers.py   each constrained sequence's matcher, kept equal to its tokens (forks, beams, preemption and
              prefix hits change nothing: a matcher is found or rebuilt from the tokens), and the step's masks
"""

from kvpage.structured.params import StructuredOutputsParams, parse_structured_outputs

__all__ = ["StructuredOutputsParams", "parse_structured_outputs"]
