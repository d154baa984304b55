"""Read a GGUF file (llama.cpp's format) through the `gguf` library: config, tokenizer and weights.

Weights are dequantized by `gguf.quants.dequantize` (Q4_0, Q4_1, Q8_0, the K-quants, F16, BF16,
F32, ...) into float32 and renamed to Hugging Face names; `read_gguf_blocks` keeps each matrix as
the file holds it instead (for the conversion cache: gguf_blocks.py). llama.cpp's converter permutes the rows
of q and k of LLaMA models (its RoPE rotates adjacent pairs; Hugging Face rotates the two halves of
each head); `unpermute_qk` undoes that, per head:

    llama.cpp rows of one head:  r0 r_{d/2} r1 r_{d/2+1} ...     ->   r0 r1 ... r_{d/2} r_{d/2+1} ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvpage.models.config import ModelConfig, MoE
from kvpage.models.tokenizer import Tokenizer, end_of_generation_ids

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k and v in one matrix (split by the loader)
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # a mixture of experts: the router, and each projection of every expert stacked ([E, out, in]); gate and
    # up are joined into one stacked gate_up_proj after reading (`_join_experts`)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "attn_sinks": "self_attn.sinks",
    # Llama 4's shared expert
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "qwen3moe": "qwen3_moe",
                  "gpt-oss": "gpt_oss", "smollm3": "smollm3", "cohere2": "cohere2",
                  "llama4": "llama4_text", "gemma2": "gemma2", "gemma3": "gemma3_text",
                  "granitehybrid": "bamba"}  # fmt: skip
# llama.cpp's converter permutes q and k rows of these (LLaMA's, SmolLM3's and Bamba's: LLaMAs to it; Bamba's
# whole heads, though RoPE turns half of each)
_PERMUTED_QK = ("llama", "smollm3", "bamba")
# what llama.cpp's GGUFs of these families leave to its code: SmolLM3 drops RoPE on every 4th layer,
# Cohere 2 slides on three layers of four (the fourth global, NoPE)
SMOLLM3_NOPE_EVERY, COHERE2_PATTERN = 4, 4
# ... and Llama 4 chunks of 8,192 tokens on three layers of four (the fourth NoPE, its queries scaled with a
# floor of 8,192 tokens and a strength of 0.1), q/k norms but on its 128-expert model
LLAMA4_CHUNK, LLAMA4_NOPE_EVERY, LLAMA4_TEMPERATURE = 8192, 4, (8192.0, 0.1)
# ... and Gemma's: windows on one layer of two (Gemma 2; 4,096 tokens unless the file says) or five of six (Gemma
# 3, whose local layers' RoPE base is 10,000 unless the file says); queries scaled by 1/sqrt(head_dim), but by
# 1/sqrt(hidden / heads) on the 27B models (known by their layer count)
GEMMA_PATTERN, GEMMA2_WINDOW, GEMMA3_LOCAL_THETA = {"gemma2": 2, "gemma3": 6}, 4096, 10_000.0
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}  # fmt: skip
_ARCH_LAYER_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # Phi-3's ffn_up holds gate and up, fused
    "gpt_oss": {"post_attention_norm": "post_attention_layernorm"},  # (its norm before the mixture)
    "gemma2": _GEMMA_NORMS,  # (four norms a layer: before and after attention and the MLP)
    "gemma3_text": _GEMMA_NORMS,
    # Bamba (llama.cpp's granitehybrid) on its Mamba-2 layers: in_proj, the convolution, dt's bias, A (stored as
    # -exp(A_log)), D, the gated norm, out_proj
    "bamba": {
        "ssm_in": "mamba.in_proj",
        "ssm_conv1d": "mamba.conv1d",
        "ssm_dt": "mamba.dt_bias",
        "ssm_a": "mamba.A_log",
        "ssm_d": "mamba.D",
        "ssm_norm": "mamba.norm",
        "ssm_out": "mamba.out_proj",
    },
}
GPT_OSS_SWIGLU = (1.702, 7.0)  # llama.cpp's constants for gpt-oss's clamped SwiGLU (alpha, limit)


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    names = _LAYER_NAMES | _ARCH_LAYER_NAMES.get(arch, {})
    if len(parts) in (3, 4) and parts[0] == "blk" and parts[2] in names:
        if len(parts) == 3 or parts[2] in ("attn_sinks", "ssm_dt"):  # (bare parameters in transformers)
            return f"model.layers.{parts[1]}.{names[parts[2]]}"
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(reader) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - a field this gguf version cannot decode is not one we need
            continue
    return out


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}")

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    kv_heads = get("attention.head_count_kv", heads)  # (a list per layer in hybrids: 0 on the state layers)
    kv_heads = max(kv_heads) if isinstance(kv_heads, list) else kv_heads
    rope_scaling = None
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    fields = dict(
        vocab_size=int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        # (Cohere's LayerNorm has its own key)
        rms_norm_eps=float(
            meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or get("attention.layer_norm_epsilon")
        ),  # fmt: skip
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        architecture=_ARCHITECTURES[arch],
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=end_of_generation_ids(meta),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=meta.get(f"{arch}.attention.sliding_window") if arch in ("phi3", "gpt-oss", "cohere2") else None,
    )
    return ModelConfig(**(fields | _family(arch, meta, tensor_names, int(get("block_count")))))


def _family(arch: str, meta: dict[str, Any], tensor_names: set[str], n: int) -> dict[str, Any]:
    """The ModelConfig fields of a family beyond LLaMA's: the mixture of experts (on the layers that have
    a router), and gpt-oss's windows on every other layer, sinks, biases and YaRN (llama.cpp's constants
    where its GGUFs carry none: the window pattern, the SwiGLU clamp)."""
    out: dict[str, Any] = {}
    if arch == "smollm3":
        out["rope_layers"] = tuple((i + 1) % SMOLLM3_NOPE_EVERY != 0 for i in range(n))
    if arch == "cohere2":
        sliding = tuple((i + 1) % COHERE2_PATTERN != 0 for i in range(n))
        out |= dict(layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
                    rope_layers=sliding, layer_norm=True, parallel_block=True, rope_interleaved=True,
                    logit_scale=float(meta.get(f"{arch}.logit_scale", 0.0625)))  # fmt: skip
    if arch == "llama4":
        out |= _llama4(meta, tensor_names, n)
    if arch in GEMMA_PATTERN:
        out |= _gemma(arch, meta, n)
    if arch == "granitehybrid":
        out |= _bamba(meta, tensor_names, n)
    if arch in ("qwen3moe", "gpt-oss"):
        common = dict(num_experts=int(meta[f"{arch}.expert_count"]), top_k=int(meta[f"{arch}.expert_used_count"]),
                      intermediate_size=int(meta[f"{arch}.expert_feed_forward_length"]),
                      layers=_moe_layers(tensor_names, n))  # fmt: skip
        if arch == "qwen3moe":  # (llama.cpp renormalizes Qwen3-MoE's top k unless the file says otherwise)
            out["moe"] = MoE(**common, norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)))
        else:
            clamp = meta.get(f"{arch}.swiglu_clamp_exp")
            swiglu = (GPT_OSS_SWIGLU[0], float(clamp[0])) if clamp else GPT_OSS_SWIGLU
            out["moe"] = MoE(**common, router="topk_softmax", bias=True, swiglu=swiglu)
    if arch == "gpt-oss":
        out |= dict(layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)),
                    attn_sinks=True, o_proj_bias="blk.0.attn_output.bias" in tensor_names)  # fmt: skip
        if meta.get(f"{arch}.rope.scaling.type") == "yarn":
            out["rope_scaling"] = {
                "rope_type": "yarn", "factor": float(meta[f"{arch}.rope.scaling.factor"]),
                "original_max_position_embeddings": int(meta[f"{arch}.rope.scaling.original_context_length"]),
                "beta_fast": float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)), "truncate": False,
            }  # fmt: skip
    return out


def _moe_layers(tensor_names: set[str], n: int) -> tuple[bool, ...] | None:
    """Which layers' MLP is a mixture (those with a router); None: every layer."""
    on = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(n))
    return None if all(on) else on


def _llama4(meta: dict[str, Any], tensor_names: set[str], n: int) -> dict[str, Any]:
    """Llama 4's layout as llama.cpp derives it (its GGUFs carry the mixture's sizes and step only); a window
    of 0 means no chunks and RoPE on every layer (MobileLLM)."""
    experts = int(meta.get("llama4.expert_count", 0))
    chunked = meta.get("llama4.attention.sliding_window", LLAMA4_CHUNK) != 0
    rope = tuple((i + 1) % LLAMA4_NOPE_EVERY != 0 or not chunked for i in range(n))
    size = int(meta.get("llama4.expert_feed_forward_length", 0))
    moe = MoE(experts, int(meta["llama4.expert_used_count"]), size, layers=_moe_layers(tensor_names, n),
              router="sigmoid", shared_intermediate_size=size) if experts else None  # fmt: skip
    return dict(
        layer_types=tuple("chunked_attention" if r else "full_attention" for r in rope) if chunked else None,
        attention_chunk_size=LLAMA4_CHUNK if chunked else None, rope_layers=rope, rope_interleaved=True,
        qk_l2_norm=experts != 128, attn_temperature=LLAMA4_TEMPERATURE if chunked else None, moe=moe,
    )  # fmt: skip


def _gemma(arch: str, meta: dict[str, Any], n: int) -> dict[str, Any]:
    """Gemma 2 / 3 as llama.cpp reads them: the window from the file, the window pattern, the local RoPE base and
    the query scale its constants (a pattern in the file wins); soft caps where the file has them."""
    window = meta.get(f"{arch}.attention.sliding_window") or (GEMMA2_WINDOW if arch == "gemma2" else 0)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", GEMMA_PATTERN[arch])
    if isinstance(pattern, list | tuple):
        sliding = tuple(bool(p) for p in pattern)
    else:  # (a Gemma 3 converted with no window: every layer global)
        sliding = tuple(bool(window) and i % int(pattern) < int(pattern) - 1 for i in range(n))
    heads, hidden = int(meta[f"{arch}.attention.head_count"]), int(meta[f"{arch}.embedding_length"])
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    caps = {k: (float(meta[f"{arch}.{k}"]) if meta.get(f"{arch}.{k}") else None)
            for k in ("attn_logit_softcapping", "final_logit_softcapping")}  # fmt: skip
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") == "linear":  # (Gemma 3's global layers only)
        scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    return dict(
        layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding) if any(sliding) else None,
        sliding_window=int(window) if any(sliding) else None,
        hidden_act="gelu_pytorch_tanh", sandwich_norms=True, qk_norm=arch == "gemma3",
        query_pre_attn_scalar=hidden // heads if n == GEMMA_27B_LAYERS[arch] else head_dim,
        embed_scale=float(hidden) ** 0.5,
        local_rope_theta=float(meta.get(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_THETA)) if arch == "gemma3"
        else None,
        rope_scaling=scaling, bos_token_id=meta.get("tokenizer.ggml.bos_token_id", 2), **caps,
    )  # fmt: skip


def _bamba(meta: dict[str, Any], tensor_names: set[str], n: int) -> dict[str, Any]:
    """Bamba as llama.cpp's granitehybrid holds it: attention where a layer has KV heads, Mamba-2 elsewhere (its
    heads the time-step rank), RoPE on `rope.dimension_count` of each head. The rest of that architecture (Granite
    4's NoPE attention, its multipliers, its mixture) is refused by name."""
    from kvpage.models.config import Mamba

    a = "granitehybrid"
    granite = [k for k in ("embedding_scale", "residual_scale", "attention.scale", "logit_scale", "expert_count")
               if meta.get(f"{a}.{k}")]  # fmt: skip
    if granite or not meta.get(f"{a}.rope.scaling.finetuned", False):
        raise ValueError(f"GGUF granitehybrid: only Bamba's layout loads (RoPE, no multipliers, no mixture); this "
                         f"file is a Granite 4 hybrid ({', '.join(granite) or 'no RoPE'})")  # fmt: skip
    kv = meta[f"{a}.attention.head_count_kv"]
    kv = kv if isinstance(kv, list) else [kv] * n
    state = [i for i in range(n) if not kv[i]]
    heads, inner = int(meta[f"{a}.ssm.time_step_rank"]), int(meta[f"{a}.ssm.inner_size"])
    first = state[0] if state else 0
    mamba = Mamba(heads, inner // heads, int(meta[f"{a}.ssm.group_count"]), int(meta[f"{a}.ssm.state_size"]),
                  int(meta[f"{a}.ssm.conv_kernel"]), f"blk.{first}.ssm_conv1d.bias" in tensor_names,
                  f"blk.{first}.ssm_in.bias" in tensor_names)  # fmt: skip
    hidden, q_heads = int(meta[f"{a}.embedding_length"]), int(meta[f"{a}.attention.head_count"])
    head_dim = int(meta.get(f"{a}.attention.key_length") or hidden // q_heads)
    return dict(layer_types=tuple("full_attention" if kv[i] else "linear_attention" for i in range(n)), mamba=mamba,
                rotary_dim=int(meta.get(f"{a}.rope.dimension_count") or head_dim))  # fmt: skip


def _state_layers(weights: dict[str, np.ndarray], cfg: ModelConfig) -> None:
    """Bamba's Mamba-2 tensors as its checkpoints hold them: A_log from llama.cpp's A = -exp(A_log) (in float64, so
    exp gives A back to within float32's rounding), D and the norm flat, the convolution [channels, 1, taps]."""
    for name in [n for n in weights if ".mamba." in n]:
        w = weights[name]
        if name.endswith(".A_log"):
            w = np.log(-w.astype(np.float64)).astype(np.float32)
        if name.endswith((".A_log", ".D", ".norm.weight", ".dt_bias")):
            w = w.reshape(-1)
        elif name.endswith(".conv1d.weight"):
            w = w.reshape(w.shape[0], 1, w.shape[-1])
        weights[name] = np.ascontiguousarray(w)


def _gemma_norms(weights: dict[str, np.ndarray], cfg: ModelConfig) -> None:
    """llama.cpp's converter adds 1 to each Gemma norm weight (its norms multiply by the weight, Gemma's by 1 + w);
    the conversion holds them as Gemma's checkpoints do (the loader adds the 1 back: loader.unit_offset_norms)."""
    if cfg.sandwich_norms:
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = weights[name].astype(np.float32) - np.float32(1.0)


def _join_experts(weights: dict[str, np.ndarray], cfg: ModelConfig) -> None:
    """Each layer's stacked gate and up projections (and biases) joined as one gate_up_proj, gates first,
    as kvpage holds them, then laid out as the family's checkpoints are (loader.checkpoint_names reads
    them back); down_proj likewise."""
    import torch

    from kvpage.models.loader import expert_to_checkpoint

    for gate in [n for n in weights if ".mlp.experts.gate_proj." in n]:
        up = gate.replace("gate_proj", "up_proj")
        joined = "mlp.experts.gate_up_proj" + ("" if gate.endswith(".weight") else "_bias")
        name = gate.split(".mlp.")[0] + "." + joined
        t = torch.from_numpy(np.concatenate([weights.pop(gate), weights.pop(up)], axis=1))
        weights[name] = np.ascontiguousarray(expert_to_checkpoint(name, t, cfg.architecture).numpy())
    for down in [n for n in weights if ".mlp.experts.down_proj." in n]:
        name = down.removesuffix(".weight").removesuffix(".bias") + ("" if down.endswith(".weight") else "_bias")
        t = torch.from_numpy(weights.pop(down))
        weights[name] = np.ascontiguousarray(expert_to_checkpoint(name, t, cfg.architecture).numpy())


def read_gguf(path: Path) -> tuple[ModelConfig, Tokenizer, dict[str, np.ndarray]]:
    """Config, tokenizer and float32 weights (Hugging Face names) of a GGUF file."""
    cfg, tokenizer, weights, _ = _read(path, keep_blocks=False)
    return cfg, tokenizer, weights


def read_gguf_blocks(path: Path) -> tuple[ModelConfig, Tokenizer, dict[str, np.ndarray], dict[str, str]]:
    """As read_gguf, but every matrix not stored as F32 stays as the file holds it: F16 as float16,
    other types as uint8 rows of blocks, their type's name in the fourth value (gguf_blocks.py)."""
    return _read(path, keep_blocks=True)


def _read(path: Path, keep_blocks: bool):
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises many types for a damaged file
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    meta = _metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = config_from_metadata(meta, names)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    weights: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # llama3-scaled RoPE (Llama 3.1+, Llama 4): each frequency's divisor
            factors = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
            cfg.rope_scaling = {"rope_type": "factors", "factors": [float(f) for f in factors]}
            continue
        name = hf_name(t.name, cfg.architecture)
        keep = keep_blocks and t.tensor_type != GGMLQuantizationType.F32 and t.data.ndim == 2
        try:  # kept blocks are checked on their first row: a type gguf cannot read fails here, not at load
            w = np.asarray(dequantize(t.data[:1] if keep else t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError, KeyError) as e:
            raise ValueError(
                f"tensor {t.name!r} has type {t.tensor_type.name}, which cannot be dequantized: {e}"
            ) from e
        if keep:
            w = np.asarray(t.data)  # F16: float16; other types: uint8 rows of blocks (whole rows of a matrix)
            if t.tensor_type != GGMLQuantizationType.F16:
                types[name] = t.tensor_type.name
        if cfg.architecture in _PERMUTED_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, cfg.num_heads)
        elif cfg.architecture in _PERMUTED_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, cfg.num_kv_heads)
        w = np.ascontiguousarray(w)
        weights[name] = w if w.flags.writeable else w.copy()  # F32 tensors come as read-only file maps
    _join_experts(weights, cfg)
    _gemma_norms(weights, cfg)
    _state_layers(weights, cfg)
    return cfg, tokenizer, weights, types
