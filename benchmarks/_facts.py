"""Long-context probes shared by the benchmarks that drop or skip KV (read_budget.py, demotion.py):
texts cut from the corpus, and planted facts ("The code for NAME is 48213.") at random depths."""

from __future__ import annotations

import random

NAMES = ["Alder", "Birch", "Cedar", "Dahlia", "Elm", "Fern", "Gorse", "Hazel", "Iris", "Juniper"]


def contexts(ids: list[int], count: int, length: int) -> list[list[int]]:
    """`count` texts of `length` tokens from the corpus, each starting elsewhere (no shared prefix)."""
    stride = max(1, (len(ids) - length) // max(1, count))
    return [ids[i * stride : i * stride + length] for i in range(count)]


def planted_facts(tok, ids: list[int], count: int, context: int, seed: int = 0) -> list[tuple[list[int], str]]:
    """(prompt, code): a `context`-token text with one fact at a random depth (10%-80%), then the question."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        name, code = NAMES[i % len(NAMES)], str(rng.randrange(10000, 99999))
        fact = tok.encode(f" The code for {name} is {code}. ", add_special_tokens=False)
        question = tok.encode(f"\nQuestion: what is the code for {name}? Answer: The code for {name} is",
                              add_special_tokens=False)  # fmt: skip
        start = rng.randrange(0, len(ids) - context)
        body = ids[start : start + context - len(fact) - len(question)]
        depth = rng.randrange(len(body) // 10, len(body) * 8 // 10)
        cases.append((body[:depth] + fact + body[depth:] + question, code))
    return cases
