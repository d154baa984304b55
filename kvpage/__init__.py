"""kvpage: an LLM inference engine whose KV cache is managed like virtual memory.

    from kvpage import LLM, SamplingParams, BeamSearchParams

Names are imported on first use, so `import kvpage.core` stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

from kvpage import cpu_kind as _cpu_kind  # noqa: E402 - torch-free; must precede torch (KVPAGE_CPU_KIND)

_cpu_kind.apply_torch_env()

_EXPORTS = {
    "LLM": "kvpage.engine.llm",
    "LLMEngine": "kvpage.engine.llm_engine",
    "EngineConfig": "kvpage.config",
    "SamplingParams": "kvpage.sampling_params",
    "BeamSearchParams": "kvpage.sampling_params",
    "StructuredOutputsParams": "kvpage.structured.params",
    "RequestOutput": "kvpage.outputs",
    "CompletionOutput": "kvpage.outputs",
    "Logprob": "kvpage.outputs",
    "CacheStats": "kvpage.core.cache_stats",
}
__all__ = [
    "LLM",
    "BeamSearchParams",
    "CacheStats",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]

if TYPE_CHECKING:
    from kvpage.config import EngineConfig
    from kvpage.core.cache_stats import CacheStats
    from kvpage.engine.llm import LLM
    from kvpage.engine.llm_engine import LLMEngine
    from kvpage.outputs import CompletionOutput, Logprob, RequestOutput
    from kvpage.sampling_params import BeamSearchParams, SamplingParams


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvpage' has no attribute {name!r}")
