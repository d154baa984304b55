"""Seeded dummy models on disk for the tensor-parallel tests: a Hugging Face directory (config.json,
safetensors, SmolLM2's tokenizer), weights ~5x the loader's dummy scale so greedy choices are far from
ties, small enough that a TP=2 group starts in seconds."""

from __future__ import annotations

import json
from pathlib import Path

from kvpage.models.config import ModelConfig
from kvpage.models.loader import dummy_weights


def dummy_config(heads: int, kv_heads: int, layers: int = 2, head_dim: int = 16, vocab: int = 49152) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=4 * heads * head_dim,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                       eos_token_ids=[2])  # fmt: skip


def write_dummy_model(path: Path, cfg: ModelConfig, tokenizer, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    weights = {}
    for name, t in dummy_weights(cfg, seed).items():
        weights[name] = (t if name.endswith("norm.weight") else 5 * t).contiguous()
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    tokenizer.save(path)
    return path
