"""The seed documents' KV-cache memory formula, for any model shape and KV dtype:

    bytes = 2 (K and V) x layers x kv_heads x head_dim x bytes_per_element x tokens

(int8 and fp8 also store a float32 scale per token and kv head: see kvpage/core/kv_bytes.py, the
one formula the engine, CacheStats and /metrics use too)

and what it means for a batch: a cache pre-allocated to the maximum length for every sequence,
against a paged cache that holds the actual lengths rounded up to whole blocks.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from kvpage.core.block import cdiv
from kvpage.core.kv_bytes import ELEMENT_BYTES, kv_bytes_per_token

KV_DTYPES = ELEMENT_BYTES  # bytes per stored value; int8 / fp8 add their scales

# Shapes of well-known models the seed documents talk about (layers, kv_heads, head_dim)
PRESETS = {
    "llama-2-7b": (32, 32, 128),
    "llama-2-13b": (40, 40, 128),
    "llama-2-70b": (80, 8, 128),
    "llama-3-8b": (32, 8, 128),
    "gpt-3-175b": (96, 96, 128),
}


@dataclass(slots=True, frozen=True)
class KVShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: str) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, dtype)


def kv_bytes(shape: KVShape, dtype: str, tokens: int) -> int:
    return shape.bytes_per_token(dtype) * tokens


def resolve_shape(model: str) -> KVShape:
    """A preset name, a config.json, a Hugging Face directory, a .gguf file or "smollm2"."""
    key = model.lower()
    if key in PRESETS:
        return KVShape(key, *PRESETS[key])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        from kvpage.models.config import ModelConfig

        cfg = ModelConfig.from_hf(json.loads(path.read_text()))
    else:
        cfg = _gguf_config(model)
    return KVShape(model, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def _gguf_config(model: str):
    from gguf import GGUFReader

    from kvpage.models.gguf_loader import config_from_metadata
    from kvpage.models.loader import resolve_model_path

    path = resolve_model_path(model)  # raises a clear ValueError for unknown names
    if path.suffix != ".gguf":
        raise ValueError(f"{model!r}: give a preset ({', '.join(PRESETS)}), a config.json, a model directory or .gguf")
    reader = GGUFReader(str(path))
    meta = {}
    for k, f in reader.fields.items():
        if k.startswith("tokenizer."):
            continue
        with contextlib.suppress(Exception):  # fields this gguf version cannot decode are not needed here
            meta[k] = f.contents()
    meta["tokenizer.ggml.tokens"] = [None] * int(meta.get(f"{meta['general.architecture']}.vocab_size") or 1)
    return config_from_metadata(meta, {t.name for t in reader.tensors})


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def report(shape: KVShape, block_size: int, batch: int, max_len: int, actual_lens: list[int]) -> str:
    lines = [
        f"KV cache of {shape.name}: {shape.layers} layers x {shape.kv_heads} kv heads x head_dim {shape.head_dim}",
        "bytes = 2 x layers x kv_heads x head_dim x bytes_per_element x tokens "
        "(int8 / fp8: + 2 x layers x kv_heads x 4 bytes of float32 scales per token)",
        "",
        f"| KV dtype | per token | per block of {block_size} | batch {batch} x {max_len} pre-allocated "
        f"| paged, actual lengths | saved |",
        "|---|---|---|---|---|---|",
    ]
    paged_tokens = sum(cdiv(n, block_size) * block_size for n in actual_lens)
    for dtype in KV_DTYPES:
        per_token = shape.bytes_per_token(dtype)
        contiguous = per_token * batch * max_len
        paged = per_token * paged_tokens
        lines.append(
            f"| {dtype} | {human(per_token)} | {human(per_token * block_size)} | {human(contiguous)} | "
            f"{human(paged)} | {1 - paged / contiguous:.1%} |"
        )
    lines.append("")
    lines.append(f"actual lengths: {len(actual_lens)} sequences, {sum(actual_lens)} tokens, "
                 f"{paged_tokens} slots in whole blocks")  # fmt: skip
    return "\n".join(lines)
