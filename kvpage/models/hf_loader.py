"""Read a Hugging Face model directory: config.json, *.safetensors (one file or shards), tokenizer.
(A GGUF conversion in kvpage's cache reads the same way: its quantized blocks come out float32.)"""

from __future__ import annotations

import json
from collections import ChainMap
from collections.abc import Mapping
from pathlib import Path

import torch

from kvpage.models import gguf_blocks
from kvpage.models.config import ModelConfig
from kvpage.models.tokenizer import Tokenizer


def read_hf_dir(path: Path) -> tuple[ModelConfig, Tokenizer | None, Mapping[str, torch.Tensor], dict]:
    """Config, tokenizer (None if the directory has none), weights, and the raw config.json."""

    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"{path} has no config.json")
    raw = json.loads(cfg_path.read_text())
    cfg = ModelConfig.from_hf(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights")
    parts = []
    for f in files:
        try:
            parts.append(gguf_blocks.load(f))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"cannot read weights {f}: {e}") from e
    weights = parts[0] if len(parts) == 1 else ChainMap(*parts)
    return cfg, Tokenizer.from_dir(path, cfg.eos_token_ids), weights, raw
