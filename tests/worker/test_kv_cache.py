import pytest
import torch

from kvpage.core.kv_bytes import kv_bytes_per_block
from kvpage.models import ModelConfig
from kvpage.worker.kv_cache import KVCache

CFG = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=4)  # fmt: skip
KINDS = [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float32, "int8"), (torch.bfloat16, "fp8")]


def fill(cache: KVCache) -> None:
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        for t in layer.tensors():
            t.copy_(torch.randint(0, 120, t.shape, generator=g).to(t.dtype))  # any bytes; fp8 as its raw bytes


def snapshot(cache: KVCache):
    return [[t.clone() for t in layer.tensors()] for layer in cache.layers]


@pytest.mark.parametrize("dtype,kind", KINDS)
def test_copy_blocks_copies_every_layer_and_its_scales_and_nothing_else(dtype, kind):
    cache = KVCache(CFG, num_blocks=4, block_size=2, dtype=dtype, kv_cache_dtype=kind)
    fill(cache)
    before = snapshot(cache)
    cache.copy_blocks([(1, 3), (0, 2)])
    for layer, old in zip(cache.layers, before, strict=True):
        assert len(layer.tensors()) == (4 if kind != "auto" else 2)
        for t, t0 in zip(layer.tensors(), old, strict=True):
            assert torch.equal(t[3], t0[1]) and torch.equal(t[2], t0[0]) and torch.equal(t[:2], t0[:2])


@pytest.mark.parametrize("dtype,kind", KINDS)
def test_swap_out_and_in_round_trip_bit_for_bit(dtype, kind):
    cache = KVCache(CFG, num_blocks=4, block_size=2, dtype=dtype, num_cpu_blocks=2, kv_cache_dtype=kind)
    fill(cache)
    before = snapshot(cache)
    cache.swap_out([(3, 0), (1, 1)])
    for layer in cache.layers:
        for t in layer.tensors():
            t.zero_()
    cache.swap_in([(0, 2), (1, 0)])
    for layer, old in zip(cache.layers, before, strict=True):
        for t, t0 in zip(layer.tensors(), old, strict=True):
            assert torch.equal(t[2], t0[3]) and torch.equal(t[0], t0[1])


def test_bytes_per_block():
    # 2 (K and V) x 2 layers x 16 slots x 1 kv head x 4 dims x 2 bytes
    assert KVCache.bytes_per_block(CFG, 16, torch.bfloat16) == 2 * 2 * 16 * 1 * 4 * 2
    # int8 / fp8: 1 byte per value + a float32 scale per token and kv head
    for kind in ("int8", "fp8"):
        assert KVCache.bytes_per_block(CFG, 16, torch.float32, kind) == 2 * 2 * 16 * 1 * (4 + 4)
    # SmolLM2 (30 layers, 3 kv heads, head_dim 64): 68 bytes a head against bfloat16's 128
    assert kv_bytes_per_block(30, 3, 64, "int8", 16) == 2 * 30 * 3 * 68 * 16
    with pytest.raises(ValueError, match="unknown KV dtype 'int3'"):
        kv_bytes_per_block(30, 3, 64, "int3", 16)
    cache = KVCache(CFG, num_blocks=3, block_size=16, dtype=torch.float32, kv_cache_dtype="int8")
    real = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.tensors())
    assert real == 3 * KVCache.bytes_per_block(CFG, 16, torch.float32, "int8")  # the formula is what is allocated
