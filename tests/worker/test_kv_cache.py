import torch

from kvpage.models import ModelConfig
from kvpage.worker.kv_cache import KVCache

CFG = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=4)  # fmt: skip


def fill(cache: KVCache) -> None:
    for i, (k, v) in enumerate(cache.layers):
        k.copy_(torch.arange(k.numel(), dtype=k.dtype).view_as(k) + 1000 * i)
        v.copy_(-k)


def test_copy_blocks_copies_every_layer_and_nothing_else():
    cache = KVCache(CFG, num_blocks=4, block_size=2, dtype=torch.float32)
    fill(cache)
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    cache.copy_blocks([(1, 3), (0, 2)])
    for (k, v), (k0, v0) in zip(cache.layers, before, strict=True):
        assert torch.equal(k[3], k0[1]) and torch.equal(v[2], v0[0])
        assert torch.equal(k[:2], k0[:2]) and torch.equal(v[:2], v0[:2])


def test_swap_out_and_in_round_trip():
    cache = KVCache(CFG, num_blocks=4, block_size=2, dtype=torch.bfloat16, num_cpu_blocks=2)
    fill(cache)
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    cache.swap_out([(3, 0), (1, 1)])
    for k, _ in cache.layers:
        k.zero_()
    cache.swap_in([(0, 2), (1, 0)])
    for (k, v), (k0, v0) in zip(cache.layers, before, strict=True):
        assert torch.equal(k[2], k0[3]) and torch.equal(k[0], k0[1]) and torch.equal(v[2], v0[3])


def test_bytes_per_block():
    # 2 (K and V) x 2 layers x 16 slots x 1 kv head x 4 dims x 2 bytes
    assert KVCache.bytes_per_block(CFG, 16, torch.bfloat16) == 2 * 2 * 16 * 1 * 4 * 2
