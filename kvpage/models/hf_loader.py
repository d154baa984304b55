"""Read a Hugging Face model directory: config.json, *.safetensors (one file or shards), tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvpage.models.config import ModelConfig
from kvpage.models.tokenizer import Tokenizer


def read_hf_dir(path: Path) -> tuple[ModelConfig, Tokenizer | None, dict[str, torch.Tensor], dict]:
    """Config, tokenizer (None if the directory has none), weights, and the raw config.json."""
    from safetensors.torch import load_file

    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"{path} has no config.json")
    raw = json.loads(cfg_path.read_text())
    cfg = ModelConfig.from_hf(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"cannot read weights {f}: {e}") from e
    return cfg, Tokenizer.from_dir(path, cfg.eos_token_ids), weights, raw
