"""The seed documents' KV-cache memory formula, for any model shape and KV dtype:

    bytes = 2 (K and V) x layers x kv_heads x head_dim x bytes_per_element x tokens

(int8 and fp8 also store a float32 scale per token and kv head: see kvpage/core/kv_bytes.py, the
one formula the engine, CacheStats and /metrics use too)

and what it means for a batch: a cache pre-allocated to the maximum length for every sequence,
against a paged cache that holds the actual lengths rounded up to whole blocks.

A model whose layers read in several ways (sliding windows, chunks: kv_spec.py) is counted per KV-cache
group as the manager holds it (`group_report`): a window's group only the blocks its window still reads.

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
from kvpage.core.kv_spec import FULL, ChunkedLocal, LayerSpec, SlidingWindow, group_layers, num_releasable, page_layers
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
    experts: int = 1  # a mixture of experts: every expert's MLP is stored (routed and shared ones)


# Well-known models the seed documents talk about: (layers, kv_heads, head_dim), then their dimensions
# (GPT-3's biases and learned positions, 0.03% of it, are left out)
PRESETS = {
    "llama-2-7b": ((32, 32, 128), ModelDims(4096, 11008, 32000, 32, False)),
    "llama-2-13b": ((40, 40, 128), ModelDims(5120, 13824, 32000, 40, False)),
    "llama-2-70b": ((80, 8, 128), ModelDims(8192, 28672, 32000, 64, False)),
    "llama-3-8b": ((32, 8, 128), ModelDims(4096, 14336, 128256, 32, False)),
    "gpt-3-175b": ((96, 96, 128), ModelDims(12288, 49152, 50257, 96, True, mlp_matrices=2)),
    # models of 2025-26, from their published config.json files (text models; MoE: every expert stored)
    "gemma-3-27b": ((62, 16, 128), ModelDims(5376, 21504, 262208, 32, True)),
    "mistral-small-24b": ((40, 8, 128), ModelDims(5120, 32768, 131072, 32, False)),
    "mistral-7b": ((32, 8, 128), ModelDims(4096, 14336, 32000, 32, False)),  # v0.1: a 4,096-token window
    "gpt-oss-20b": ((24, 8, 64), ModelDims(2880, 2880, 201088, 64, False, experts=32)),
    "llama-4-scout": ((48, 8, 128), ModelDims(5120, 8192, 202048, 40, False, experts=17)),
    "qwen3-32b": ((64, 8, 128), ModelDims(5120, 25600, 151936, 64, False)),
}

# What each layer of a preset reads, where not every layer is full attention (their configs' layer_types,
# sliding_window, attention_chunk_size): Gemma 3 a 1,024-token window on five layers of six (every sixth
# global); gpt-oss a 128-token window on every other layer, from the first; Llama 4 Scout 8,192-token chunks
# on three layers of four (every fourth global, without RoPE); Mistral 7B v0.1 a 4,096-token window everywhere.
PRESET_LAYERS: dict[str, tuple[LayerSpec, ...]] = {
    "gemma-3-27b": tuple(FULL if (i + 1) % 6 == 0 else SlidingWindow(1024) for i in range(62)),
    "gpt-oss-20b": tuple(SlidingWindow(128) if i % 2 == 0 else FULL for i in range(24)),
    "llama-4-scout": tuple(FULL if i % 4 == 3 else ChunkedLocal(8192) for i in range(48)),
    "mistral-7b": (SlidingWindow(4096),) * 32,
}


@dataclass(slots=True, frozen=True)
class KVShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dims: ModelDims | None = None
    layer_specs: tuple[LayerSpec, ...] | None = None  # what each layer reads (None: full attention everywhere)

    @property
    def specs(self) -> tuple[LayerSpec, ...]:
        return self.layer_specs or (FULL,) * self.layers

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
                       self.head_dim, dims, self.layer_specs)  # fmt: skip

    def linear_params(self) -> int:
        d = self._dims()
        q, kv = d.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = d.experts * d.mlp_matrices * d.hidden * d.intermediate
        return self.layers * (d.hidden * (q + 2 * kv) + q * d.hidden + mlp)

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
        return KVShape(key, *kv, dims, PRESET_LAYERS.get(key))
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        from kvpage.models.config import ModelConfig

        cfg = ModelConfig.from_hf(json.loads(path.read_text()))
    else:
        cfg = _gguf_config(model)
    dims = ModelDims(cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_heads, cfg.tie_word_embeddings)
    return KVShape(model, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dims, cfg.layer_specs)


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


@dataclass(slots=True, frozen=True)
class GroupBlocks:
    """A sequence of `tokens` tokens, computed, as the KV-cache manager holds it between steps."""

    tokens: int
    blocks: tuple[int, ...]  # per KV-cache group (a window's: only what it still reads)
    block_bytes: int  # one block id: page_layers layers' K and V of block_size tokens
    full_blocks: int  # every layer sized as full attention: blocks of every layer's KV
    full_block_bytes: int

    @property
    def bytes(self) -> int:
        return sum(self.blocks) * self.block_bytes

    @property
    def full_bytes(self) -> int:
        return self.full_blocks * self.full_block_bytes


def group_blocks(shape: KVShape, block_size: int, tokens: int, dtype: str = "bfloat16") -> GroupBlocks:
    """Blocks and bytes a sequence of `tokens` computed tokens holds in each KV-cache group (the
    manager's rule: a window's group released what no later query reads, layer_window.py), against
    one table of every layer's KV (every layer sized as full attention)."""
    groups = group_layers(shape.specs)
    n = cdiv(tokens, block_size)
    held = tuple(n - num_releasable(g.spec, tokens, block_size) for g in groups)
    per_layer = kv_bytes_per_token(1, shape.kv_heads, shape.head_dim, dtype) * block_size
    return GroupBlocks(tokens, held, per_layer * page_layers(groups), n, per_layer * shape.layers)


def group_report(shape: KVShape, block_size: int, lengths: list[int], dtype: str = "bfloat16") -> str:
    """Per KV-cache group, what one sequence of each length holds, against every layer as full attention."""
    groups = group_layers(shape.specs)
    kinds: dict[str, list[int]] = {}
    for g in groups:
        kinds.setdefault(g.spec.describe(), []).append(g.index)
    lines = [
        f"KV-cache groups of {shape.name} ({dtype} KV, blocks of {block_size}): "
        + "; ".join(
            f"{sum(len(groups[i].layers) for i in ix)} layers of {k} in {len(ix)} group{'s' * (len(ix) > 1)}"
            for k, ix in kinds.items()
        )  # fmt: skip
        + f"; a block holds {page_layers(groups)} layers' KV (one per layer of a group)",
        "",
        "| tokens | " + " | ".join(f"{k}: blocks" for k in kinds) + " | bytes | every layer as full attention "
        "| ratio |",
        "|---|" + "---|" * len(kinds) + "---|---|---|",
    ]
    for n in lengths:
        gb = group_blocks(shape, block_size, n, dtype)
        cells = [str(sum(gb.blocks[i] for i in ix)) for ix in kinds.values()]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {human(gb.bytes)} | {human(gb.full_bytes)} | "
                     f"{gb.bytes / gb.full_bytes:.3f} |")  # fmt: skip
    return "\n".join(lines)


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
        # (each sequence at max_len as the manager holds it: a window's group only its window's blocks)
        counts = {k: max(0, int(room // group_blocks(shape, block_size, max_len, k).bytes)) for k in kv_dtypes}
        ok = [k for k in kv_dtypes if counts[k] >= batch]
        if ok:
            answers.append(f"{wd} weights with {' / '.join(ok)} KV")
        cells = [human(w), human(room) if room > 0 else "none", *(str(counts[k]) for k in kv_dtypes)]
        lines.append(f"| {wd} | " + " | ".join(cells) + f" | {', '.join(ok) + ' KV' if ok else 'no'} |")
    lines.append("")
    lines.append(f"{batch} concurrent requests of {max_len} tokens: "
                 + (f"fit with {'; '.join(answers)}" if answers else "do not fit in any combination"))  # fmt: skip
    return "\n".join(lines)
