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


@pytest.mark.parametrize("dtype,kind", KINDS)
def test_rotating_a_block_moves_its_keys_to_later_positions(dtype, kind):
    """StreamingLLM's sink copies: keys written at positions p, rotated by 40, equal keys written at
    p + 40 (the model's RoPE); values copied as they are; the source block untouched."""
    from kvpage.attention.torch_ref import write_kv
    from kvpage.models.layer_ops import apply_rope
    from kvpage.models.llama import RotaryEmbedding

    cfg = ModelConfig(vocab_size=10, hidden_size=32, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16, rope_theta=10000.0)  # fmt: skip
    rope = RotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(1)
    raw_k = torch.randn(4, 1, 16, generator=g)
    raw_v = torch.randn(4, 1, 16, generator=g)

    def keys_at(first: int) -> torch.Tensor:
        cos, sin = rope(torch.arange(first, first + 4), torch.float32)
        return apply_rope(raw_k, cos, sin).to(dtype)

    def cache_with(first: int) -> KVCache:
        cache = KVCache(cfg, num_blocks=3, block_size=4, dtype=dtype, kv_cache_dtype=kind)
        for layer in cache.layers:
            write_kv(keys_at(first), raw_v.to(dtype), layer, torch.arange(4) + 4)  # block 1
        return cache

    cache, later = cache_with(3), cache_with(43)
    before = snapshot(cache)
    cache.rotate_blocks([(1, 2, 40)], rope.inv_freq)
    tol = {"auto": 1e-5 if dtype == torch.float32 else 2e-2, "int8": 5e-2, "fp8": 2e-1}[kind]  # a step or two
    for layer, ref, old in zip(cache.layers, later.layers, before, strict=True):
        got, want = layer.k[2].float(), ref.k[1].float()
        if layer.quantized:
            got, want = got * layer.k_scale[2][..., None], want * ref.k_scale[1][..., None]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        assert torch.equal(layer.tensors()[1][2], old[1][1])  # values (and their scales) bit for bit
        assert all(torch.equal(t[1], t0[1]) for t, t0 in zip(layer.tensors(), old, strict=True))


def test_the_backend_owns_the_layout_and_block_moves_follow_it():
    """A backend with another layout (token-major blocks) gets its own tensors for every pool;
    copies and swaps move whole blocks along dimension 0 whatever the layout."""
    from kvpage.attention.layer_kv import LayerKV

    class TokenMajor:
        name = "token-major"

        @staticmethod
        def allocate_kv(num_blocks, num_kv_heads, block_size, head_dim, dtype, kind, device, pin=False):
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            return LayerKV(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    cache = KVCache(CFG, num_blocks=4, block_size=2, dtype=torch.float32, num_cpu_blocks=2, backend=TokenMajor())
    assert cache.layers[0].k.shape == (4, 2, 1, 4) and cache.cpu_layers[0].k.shape == (2, 2, 1, 4)
    fill(cache)
    before = snapshot(cache)
    cache.copy_blocks([(0, 3)])
    cache.swap_out([(1, 0)])
    cache.swap_in([(0, 2)])
    for layer, old in zip(cache.layers, before, strict=True):
        for t, t0 in zip(layer.tensors(), old, strict=True):
            assert torch.equal(t[3], t0[0]) and torch.equal(t[2], t0[1]) and torch.equal(t[:2], t0[:2])
