"""`ModelConfig.kv_bytes_per_token`: the one formula for KV bytes, checked on SmolLM2's shape."""

from __future__ import annotations

import pytest
import torch

from kvpage.models.config import ModelConfig
from kvpage.tools.kv_estimate import KV_DTYPES, KVShape
from kvpage.worker.kv_cache import KVCache

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64)  # fmt: skip


@pytest.mark.parametrize(("dtype", "elem"), [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
def test_kv_bytes_per_token_takes_the_element_size(dtype, elem):
    # 2 (K and V) x 30 layers x 3 kv heads x head_dim 64 x bytes per element
    assert SMOLLM2.kv_bytes_per_token(elem) == 2 * 30 * 3 * 64 * elem == 11520 * elem
    assert KVCache.bytes_per_block(SMOLLM2, 16, dtype) == 16 * 11520 * elem  # the engine sizes its cache by it


def test_the_estimator_agrees_with_the_model_config():
    shape = KVShape("smollm2", 30, 3, 64)  # the torch-free estimator keeps its own copy of the formula
    for dtype, elem in KV_DTYPES.items():
        assert shape.bytes_per_token(dtype) == SMOLLM2.kv_bytes_per_token(elem) == 11520 * elem
