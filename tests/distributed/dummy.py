"""Seeded dummy models on disk for the tensor-parallel tests: weights ~5x the loader's dummy scale so
greedy choices are far from ties, small enough that a TP=2 group starts in seconds."""

from __future__ import annotations

from pathlib import Path

from kvpage.models.config import ModelConfig
from kvpage.models.loader import save_dummy_model


def dummy_config(heads: int, kv_heads: int, layers: int = 2, head_dim: int = 16, vocab: int = 49152) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=4 * heads * head_dim,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                       eos_token_ids=[2])  # fmt: skip


def write_dummy_model(path: Path, cfg: ModelConfig, tokenizer, seed: int = 0) -> Path:
    return save_dummy_model(path, cfg, tokenizer, seed, scale=5.0)
