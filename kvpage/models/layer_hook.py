"""`LayerHook`: what may run around a model's layers within one forward (the model knows no feature).

    for each layer i:   before_layer(i, kv)   layer(...)   after_layer(i, kv) -> (rows, metadata)
    after the last:     finish(hidden) -> hidden at the step's rows

`after_layer` returns (None, None) to go on unchanged, or the rows of the batch the later layers
run and their metadata (CacheBlend keeps only the reused tokens whose KV deviated most:
worker/selective.py). The model runner's step hooks hand the model one (worker/step_hooks.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvpage.attention import AttentionMetadata, LayerKV


class LayerHook(Protocol):
    def before_layer(self, i: int, kv: LayerKV) -> None: ...

    def after_layer(self, i: int, kv: LayerKV) -> tuple[torch.Tensor | None, AttentionMetadata | None]: ...

    def finish(self, hidden: torch.Tensor) -> torch.Tensor: ...
