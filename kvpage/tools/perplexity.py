"""Perplexity of the model through the engine, on real English text that is already on the machine.

The text (`english_corpus`): Python's own LICENSE.txt, then the docstrings of a fixed list of
standard-library modules and of their public classes and functions (those over 200 characters),
in a fixed order: ~190k characters, ~45k SmolLM2 tokens, with no download. It depends only on the
Python version, which the results record beside a digest of the text.

`perplexity` cuts the tokens into non-overlapping windows, sends each as a prompt with
`prompt_logprobs=0` and `max_tokens=1`, and averages the negative log-likelihood of every token
but each window's first: what the engine really computes, including chunked prefill (set
`max_num_batched_tokens` below the window so later chunks read earlier ones back from the paged
cache, as they will when the cache is quantized).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal", "email",
    "functools", "heapq", "inspect", "itertools", "json", "logging", "pathlib", "pickle", "random", "re",
    "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
    "typing", "unittest", "urllib.parse", "zipfile",
)  # fmt: skip


def english_corpus() -> str:
    """Real English prose from the installed Python, the same on every machine with its version."""
    parts = []
    license_file = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if license_file.exists():
        parts.append(license_file.read_text(encoding="utf-8"))
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        root = name.split(".")[0]
        parts.append(inspect.getdoc(module) or "")
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            with warnings.catch_warnings():  # typing's deprecated aliases (typing.io) warn when read
                warnings.simplefilter("ignore", DeprecationWarning)
                if not str(getattr(obj, "__module__", "")).startswith(root):
                    continue  # re-exported from elsewhere: counted there, or not at all
                doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(p for p in parts if p)


def corpus_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(slots=True)
class PerplexityResult:
    perplexity: float
    nll_sum: float
    tokens: int  # tokens scored (every window's first token is not)
    windows: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens


def windows_of(token_ids: list[int], window: int) -> list[list[int]]:
    """Non-overlapping windows; a last one shorter than 2 tokens is dropped (nothing to score)."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    out = [token_ids[i : i + window] for i in range(0, len(token_ids), window)]
    return [w for w in out if len(w) >= 2]


def token_nlls(llm, token_ids: list[int], window: int = 1024, kv_eviction=None) -> list[list[float]]:
    """The negative log-likelihood of every token but each window's first, window by window, as the
    engine computes it (`kv_eviction`: the windows' eviction policy, core/eviction/)."""
    from kvpage.sampling_params import SamplingParams

    wins = windows_of(token_ids, window)
    if not wins:
        raise ValueError("no window of at least 2 tokens to score")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, kv_eviction=kv_eviction)
    out_nlls = []
    for out, win in zip(llm.generate(wins, params, use_tqdm=False), wins, strict=True):
        positions = out.prompt_logprobs
        if out.error is not None:
            raise RuntimeError(out.error)
        assert positions is not None and len(positions) == len(win), "the engine returned no prompt logprobs"
        out_nlls.append([-pos[tok].logprob for tok, pos in zip(win[1:], positions[1:], strict=True)])
    return out_nlls


def perplexity(llm, token_ids: list[int], window: int = 1024, kv_eviction=None) -> PerplexityResult:
    """exp(mean NLL) of `token_ids` scored by `llm` (a kvpage LLM) window by window."""
    nlls = token_nlls(llm, token_ids, window, kv_eviction)
    nll, count = sum(map(sum, nlls)), sum(map(len, nlls))
    return PerplexityResult(math.exp(nll / count), nll, count, len(nlls))


def decode_nlls(
    model, token_ids: list[int], start: int, read_budget: int | None = None, block_size: int = 16, batch: int = 256
) -> list[float]:
    """The negative log-likelihood of token_ids[start + 1:], each predicted by a decode: the first
    `start` tokens are prefilled, then every later position is fed as a one-token query (teacher
    forcing: the text's tokens, not sampled ones), `batch` of them per forward as entries sharing one
    block table (every layer writes the forward's K/V before any entry attends, so entry p sees keys
    0..p, as its decode would). With `read_budget`, those decodes read within it past the dense
    layers (attention/key_bounds.py), where a prompt's own forward always reads in full. The model's
    own attention backend and step path (the fused decode where it applies), in a private cache."""
    import torch

    from kvpage.core.scheduler_output import ScheduledSequence, SeqKey
    from kvpage.worker.fused_decode import step_forward
    from kvpage.worker.input_builder import build_inputs
    from kvpage.worker.kv_cache import KVCache

    if not 0 < start < len(token_ids) - 1:
        raise ValueError(f"start must leave a prefix and at least two tokens to decode, got {start}")
    n, device = len(token_ids), model.norm.weight.device
    table = list(range(-(-n // block_size)))
    cache = KVCache(model.config, len(table), block_size, model.norm.weight.dtype, device,
                    backend=model.attention_backend, key_bounds=True)  # fmt: skip
    forward, nlls = step_forward(model), []

    def run(entries):
        inputs = build_inputs(entries, block_size, device)
        hidden = forward(inputs.input_ids, inputs.positions, cache.layers, inputs.meta)
        return model.compute_logits(hidden[inputs.logits_index]).float()

    with torch.inference_mode():
        for c in range(0, start, 2048):  # the prefix, in chunks that bound the attention's memory
            end = min(start, c + 2048)
            run([ScheduledSequence(SeqKey("prefix", c), token_ids[c:end], c, table, return_logits=False)])
        for b in range(start, n - 1, batch):
            positions = range(b, min(n - 1, b + batch))
            entries = [ScheduledSequence(SeqKey("decode", p), [token_ids[p]], p, table, max_read_tokens=read_budget)
                       for p in positions]  # fmt: skip
            logprobs = torch.log_softmax(run(entries), dim=-1)
            targets = torch.tensor([token_ids[p + 1] for p in positions], device=device)
            nlls += (-logprobs.gather(1, targets[:, None])[:, 0]).tolist()
    return nlls
