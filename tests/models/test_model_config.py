"""`ModelConfig.kv_bytes_per_token` and the estimator: the one formula for KV bytes (core/kv_bytes.py),
checked by hand on SmolLM2's shape."""

from __future__ import annotations

import pytest
import torch

from kvpage.models.config import ModelConfig
from kvpage.tools.kv_estimate import KV_DTYPES, KVShape
from kvpage.worker.kv_cache import KVCache

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64)  # fmt: skip


# 2 (K and V) x 30 layers x 3 kv heads x (head_dim 64 x bytes per value + scale bytes)
BY_HAND = {"float32": 11520 * 4, "bfloat16": 11520 * 2, "float16": 11520 * 2, "int8": 180 * 68, "fp8": 180 * 68}


@pytest.mark.parametrize(("dtype", "name"), [(torch.float32, "float32"), (torch.bfloat16, "bfloat16"),
                                             (torch.float16, "float16")])  # fmt: skip
def test_kv_bytes_per_token_by_hand(dtype, name):
    assert SMOLLM2.kv_bytes_per_token(name) == BY_HAND[name]
    assert KVCache.bytes_per_block(SMOLLM2, 16, dtype) == 16 * BY_HAND[name]  # the engine sizes its cache by it
    for kind in ("int8", "fp8"):
        assert KVCache.bytes_per_block(SMOLLM2, 16, dtype, kind) == 16 * BY_HAND[kind]


def test_the_estimator_agrees_with_the_model_config():
    shape = KVShape("smollm2", 30, 3, 64)
    for dtype in KV_DTYPES:
        assert shape.bytes_per_token(dtype) == SMOLLM2.kv_bytes_per_token(dtype) == BY_HAND[dtype]
