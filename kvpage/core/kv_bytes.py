"""What one token (and one block) of KV cache costs in bytes, for every KV dtype: the one formula
used by the engine to size its pool, by `CacheStats`, by `/metrics` and by `kvpage estimate`.

    bytes per token = 2 (K and V) x layers x kv_heads x (head_dim x element bytes + scale bytes)

float32 / bfloat16 / float16 blocks hold the values themselves (no scale). int8 and fp8
(float8_e4m3fn) blocks hold one byte per value plus one float32 scale per token, kv head and K or V
(see kvpage/attention/kv_quant.py for why per token): for a head_dim of 64, 68 bytes against
bfloat16's 128, so a pool of the same bytes holds 1.88x the blocks of bfloat16, 3.76x those of float32.

A cache that keeps key bounds for a read budget (kvpage/attention/key_bounds.py) adds, per block, in
each of its `bounded_layers`, a float32 min and max per kv head and head_dim: 2 x kv_heads x head_dim x 4
bytes (SmolLM2, 16-token blocks of bfloat16: 12.5% more per block in those layers).

A block demoted to a lower precision (core/eviction: Demote) lives in that precision's pool:
int8 as the int8 cache holds it; int4 in KIVI's layout (kvpage/attention/int4_kv.py), half a byte
a value plus float16 scale and minimum per channel of K and per token of V (the "cpu" rung holds
the same int4 blocks in host memory):
    per layer: kv_heads x (block_size x head_dim + 4 x head_dim + 4 x block_size) bytes
"""

from __future__ import annotations

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8": 1}
SCALE_BYTES = {"int8": 4, "fp8": 4}  # one float32 scale per token and kv head, for K and for V
QUANTIZED_KV_DTYPES = ("int8", "fp8")
KV_CACHE_DTYPES = ("auto", *QUANTIZED_KV_DTYPES)  # "auto": the model's dtype
# the names a model's dtype may be given by, each to its canonical name (models/loader.py: the torch dtype)
MODEL_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
                     "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}  # fmt: skip


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    if kv_dtype not in ELEMENT_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; known: {', '.join(ELEMENT_BYTES)}")
    return 2 * layers * kv_heads * (head_dim * ELEMENT_BYTES[kv_dtype] + SCALE_BYTES.get(kv_dtype, 0))


def kv_bytes_per_block(
    layers: int, kv_heads: int, head_dim: int, kv_dtype: str, block_size: int, bounded_layers: int = 0
) -> int:
    bounds = 2 * bounded_layers * kv_heads * head_dim * 4
    return kv_bytes_per_token(layers, kv_heads, head_dim, kv_dtype) * block_size + bounds


DEMOTED_DTYPES = ("int8", "int4", "cpu")  # the rungs a block may be demoted to; "cpu": int4 in host memory


def demoted_bytes_per_block(layers: int, kv_heads: int, head_dim: int, precision: str, block_size: int) -> int:
    """What one block costs in a demoted precision's pool."""
    if precision in ("int4", "cpu"):
        return layers * kv_heads * (block_size * head_dim + 4 * head_dim + 4 * block_size)
    if precision == "int8":
        return kv_bytes_per_block(layers, kv_heads, head_dim, "int8", block_size)
    raise ValueError(f"unknown demoted precision {precision!r}; known: {', '.join(DEMOTED_DTYPES)}")
