"""The offline workloads kvpage and OpenVINO GenAI both run (benchmarks/peers.py --openvino): token ids
only, so both engines see the same prompts whatever their tokenizers do. Plain Python: the OpenVINO
side imports it in its own environment.

  one_stream  one 128-token prompt, 256 new tokens; decode tokens/s = 256 / (t(257 new) - t(1 new))
  batch       64 prompts of 64-512 tokens, 128 new each, submitted at once; output tokens/s
  shared      31 prompts sharing a 1,024-token system text (cached by one request first), each with
              its own 16-64 token question, 32 new each; output tokens/s
"""

from __future__ import annotations

import random

# both engines: prefix caching on, a 2 GiB KV pool, 256 sequences and 2,048 tokens a step at most
KV_POOL_GIB = 2
MAX_NUM_SEQS = 256
MAX_BATCHED_TOKENS = 2048
VOCAB = (100, 49000)  # SmolLM2's ordinary tokens (no special ones)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def workloads(repeat: int = 0) -> dict[str, dict]:
    """name -> {"warm": [(prompt ids, new tokens)] run first, untimed, "runs": [[(prompt ids, new tokens)]]
    each run submitted at once}. Each repeat has prompts of its own (none cached by an earlier one) but
    the same system text."""
    system = _tokens(random.Random(1), 1024)
    rng = random.Random(1000 + repeat)
    one = _tokens(rng, 128)
    batch = [(_tokens(rng, rng.randint(64, 512)), 128) for _ in range(64)]
    shared = [(system + _tokens(rng, rng.randint(16, 64)), 32) for _ in range(31)]
    return {
        "one_stream": {"warm": [(one, 8)], "runs": [[(one, 1)], [(one, 257)]]},
        "batch": {"warm": [(batch[0][0], 4)], "runs": [batch]},
        "shared": {"warm": [(system + _tokens(rng, 8), 1)], "runs": [shared]},
    }


def measure(run, repeat: int, only: list[str] | None = None) -> dict[str, float]:
    """Each workload's figure, `run(requests) -> wall seconds` timing one submission of an engine."""
    result = {}
    for name, w in workloads(repeat).items():
        if only and name not in only:
            continue
        run(w["warm"])
        result[name] = summarize(name, [run(r) for r in w["runs"]], w["runs"])
    return result


def summarize(name: str, times: list[float], runs: list[list[tuple[list[int], int]]]) -> float:
    """The workload's figure from its runs' wall times: decode tokens/s for one_stream, else output tokens/s."""
    if name == "one_stream":
        return (runs[1][0][1] - runs[0][0][1]) / (times[1] - times[0])
    return sum(n for _, n in runs[0]) / times[0]
