"""The seed documents' KV-cache memory formula, for any model shape and KV dtype:

    bytes = 2 (K and V) x layers x kv_heads x head_dim x bytes_per_element x tokens

(int8 and fp8 also store a float32 scale per token and kv head: see kvpage/core/kv_bytes.py, the
one formula the engine, CacheStats and /metrics use too)

and what it means for a batch: a cache pre-allocated to the maximum length for every sequence,
against a paged cache that holds the actual lengths rounded up to whole blocks.

Where the model's dimensions are known, also its weights, as kvpage stores them (linears at the
weight dtype, an int8 output projection under quantization, embeddings and norms in bfloat16), and,
given a GPU's memory, how many sequences of the maximum length fit beside them for each weight and
KV dtype: the seed documents' "Llama-2-70B on one card with 8 concurrent requests", computed with
its conditions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from kvpage.core.block import cdiv
from kvpage.core.kv_bytes import ELEMENT_BYTES, kv_bytes_per_token
from kvpage.distributed.shard import check_split, local_kv_heads

KV_DTYPES = ELEMENT_BYTES  # bytes per stored value; int8 / fp8 add their scales

# bytes per weight of a linear layer, as kvpage/models/weight_quant.py stores it: int8 one byte and a
# float16 scale per group of 32; int4 half a byte and a float16 scale and min per group
GROUP = 32
WEIGHT_BYTES = {"bfloat16": 2.0, "int8": 1 + 2 / GROUP, "int4": 0.5 + 4 / GROUP}
MODEL_DTYPE_BYTES = 2  # embeddings and norms (bfloat16 / float16)


@dataclass(slots=True, frozen=True)
class ModelDims:
    """What the weights' size needs beyond the KV shape."""

    hidden: int
    intermediate: int
    vocab: int
    heads: int
    tied: bool  # the output projection is the embedding
    mlp_matrices: int = 3  # gate, up, down (LLaMA); 2 for a plain MLP (GPT-3)


# Well-known models the seed documents talk about: (layers, kv_heads, head_dim), then their dimensions
# (GPT-3's biases and learned positions, 0.03% of it, are left out)
PRESETS = {
    "llama-2-7b": ((32, 32, 128), ModelDims(4096, 11008, 32000, 32, False)),
    "llama-2-13b": ((40, 40, 128), ModelDims(5120, 13824, 32000, 40, False)),
    "llama-2-70b": ((80, 8, 128), ModelDims(8192, 28672, 32000, 64, False)),
    "llama-3-8b": ((32, 8, 128), ModelDims(4096, 14336, 128256, 32, False)),
    "gpt-3-175b": ((96, 96, 128), ModelDims(12288, 49152, 50257, 96, True, mlp_matrices=2)),
}


@dataclass(slots=True, frozen=True)
class KVShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dims: ModelDims | None = None

    def bytes_per_token(self, dtype: str) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, dtype)

    def per_rank(self, n: int) -> KVShape:
        """What one rank of a tensor-parallel group of `n` holds (kvpage/distributed/shard.py): its
        heads, its kv heads (replicated when n exceeds them), its MLP slice; tables and norms whole."""
        if n == 1:
            return self
        d = self._dims()
        check_split(n, d.heads, self.kv_heads, d.intermediate)
        dims = dataclasses.replace(d, heads=d.heads // n, intermediate=d.intermediate // n)
        return KVShape(f"{self.name} (one rank of {n})", self.layers, local_kv_heads(n, self.kv_heads),
                       self.head_dim, dims)  # fmt: skip

    def linear_params(self) -> int:
        d = self._dims()
        q, kv = d.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (d.hidden * (q + 2 * kv) + q * d.hidden + d.mlp_matrices * d.hidden * d.intermediate)

    def params(self) -> int:
        d = self._dims()
        tables = d.vocab * d.hidden * (1 if d.tied else 2)
        return self.linear_params() + tables + (2 * self.layers + 1) * d.hidden

    def weight_bytes(self, weight_dtype: str) -> int:
        """The weights as kvpage holds them under `weight_dtype` (bfloat16, int8 or int4)."""
        d = self._dims()
        table = d.vocab * d.hidden
        norms = (2 * self.layers + 1) * d.hidden * MODEL_DTYPE_BYTES
        linears = self.linear_params() * WEIGHT_BYTES[weight_dtype]
        if weight_dtype == "bfloat16":
            tables = table * MODEL_DTYPE_BYTES * (1 if d.tied else 2)
        else:  # the output projection at int8; a tied embedding is looked up in it, an untied one stays
            tables = table * WEIGHT_BYTES["int8"] + (0 if d.tied else table * MODEL_DTYPE_BYTES)
        return int(linears + tables + norms)

    def _dims(self) -> ModelDims:
        if self.dims is None:
            raise ValueError(f"the dimensions of {self.name} beyond its KV shape are not known")
        return self.dims


def kv_bytes(shape: KVShape, dtype: str, tokens: int) -> int:
    return shape.bytes_per_token(dtype) * tokens


def resolve_shape(model: str) -> KVShape:
    """A preset name, a config.json, a Hugging Face directory, a .gguf file or "smollm2"."""
    key = model.lower()
    if key in PRESETS:
        kv, dims = PRESETS[key]
        return KVShape(key, *kv, dims)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        from kvpage.models.config import ModelConfig

        cfg = ModelConfig.from_hf(json.loads(path.read_text()))
    else:
        cfg = _gguf_config(model)
    dims = ModelDims(cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_heads, cfg.tie_word_embeddings)
    return KVShape(model, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dims)


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


GIB = 1 << 30


def fit_report(shape: KVShape, gpu_gib: float, utilization: float, reserve_gib: float, batch: int, max_len: int,
               block_size: int) -> str:  # fmt: skip
    """The weights under each weight dtype, and how many sequences of `max_len` tokens fit in what a
    GPU of `gpu_gib` leaves at `utilization` (vLLM's gpu_memory_utilization) after them and `reserve_gib`
    for activations and the runtime (which vLLM measures by a profiling run; here an assumption)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if gpu_gib <= 0 or reserve_gib < 0:
        raise ValueError("--gpu-memory must be positive and --reserve not negative")
    d = shape._dims()
    budget = gpu_gib * GIB * utilization - reserve_gib * GIB
    slots = cdiv(max_len, block_size) * block_size
    kv_dtypes = [k for k in KV_DTYPES if k != "float32"]
    lines = [
        f"Weights of {shape.name}: {shape.params() / 1e9:.2f} B parameters (hidden {d.hidden}, intermediate "
        f"{d.intermediate}, vocab {d.vocab}, {d.heads} heads, {'tied' if d.tied else 'untied'} embeddings)",
        f"A GPU of {gpu_gib:g} GiB at utilization {utilization:g}, {reserve_gib:g} GiB kept for activations and "
        f"the runtime: {human(budget)} for weights and KV. Sequences of {max_len} tokens that fit:",
        "",
        "| weights | weight bytes | KV room | " + " | ".join(f"{k} KV" for k in kv_dtypes) + f" | batch {batch} fits |",
        "|---|---|---|" + "---|" * len(kv_dtypes) + "---|",
    ]
    answers = []
    for wd in WEIGHT_BYTES:
        w = shape.weight_bytes(wd)
        room = budget - w
        counts = {k: max(0, int(room // (shape.bytes_per_token(k) * slots))) for k in kv_dtypes}
        ok = [k for k in kv_dtypes if counts[k] >= batch]
        if ok:
            answers.append(f"{wd} weights with {' / '.join(ok)} KV")
        cells = [human(w), human(room) if room > 0 else "none", *(str(counts[k]) for k in kv_dtypes)]
        lines.append(f"| {wd} | " + " | ".join(cells) + f" | {', '.join(ok) + ' KV' if ok else 'no'} |")
    lines.append("")
    lines.append(f"{batch} concurrent requests of {max_len} tokens: "
                 + (f"fit with {'; '.join(answers)}" if answers else "do not fit in any combination"))  # fmt: skip
    return "\n".join(lines)
