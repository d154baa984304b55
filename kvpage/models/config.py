"""`ModelConfig`: the shape of a LLaMA-family model, read from config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpage.core.kv_bytes import kv_bytes_per_token
from kvpage.core.kv_spec import FULL, KVGroup, LayerSpec, SlidingWindow, group_layers, layer_specs

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "smollm3",
    "gemma2",
    "gemma3_text",
    "cohere2",
    "llama4_text",
    "gpt_oss",
    "bamba",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "factors")  # factors: a GGUF's rope_freqs
ROUTERS = ("softmax", "sigmoid", "topk_softmax")


@dataclass(frozen=True, slots=True)
class MoE:
    """A mixture of experts in place of the MLP: a router picks `top_k` of `num_experts` SwiGLU experts per
    token. `router`: "softmax" (Qwen3-MoE: a softmax over all, then the top k, renormalized when
    `norm_topk_prob`, each output weighted); "sigmoid" (Llama 4: the top k logits' sigmoids scale each chosen
    expert's input, and a shared expert of `shared_intermediate_size` > 0 runs on every token beside them);
    "topk_softmax" (gpt-oss: a softmax over the top k logits weights the outputs). gpt-oss's router and
    experts carry biases (`bias`) and its SwiGLU is clamped: gate <= limit, |up| <= limit,
    (up + 1) * gate * sigmoid(alpha * gate), `swiglu` = (alpha, limit)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool = False
    layers: tuple[bool, ...] | None = None  # which layers' MLP is the mixture (None: every layer)
    router: str = "softmax"
    shared_intermediate_size: int = 0
    bias: bool = False
    swiglu: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; one of {ROUTERS}")

    def on(self, layer: int) -> bool:
        return self.layers is None or self.layers[layer]


@dataclass(frozen=True, slots=True)
class Mamba:
    """Mamba-2's mixer on a model's state-space layers (Bamba's `mamba_*` keys): `num_heads` heads of
    `head_dim` over an inner width of num_heads * head_dim, B and C in `num_groups` groups of `state_size`,
    a causal depthwise convolution of `conv_kernel` taps over x, B and C."""

    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def ssm_numel(self) -> int:
        return self.num_heads * self.head_dim * self.state_size

    @property
    def conv_numel(self) -> int:
        return (self.conv_kernel - 1) * self.conv_dim


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear" | "llama3", "factor": ..., ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None  # the layers that slide read the last `sliding_window` keys
    qk_norm: bool = False  # q and k RMS-normalized per head before RoPE (Qwen3)
    # transformers' kind of each layer ("full_attention", "sliding_attention"); None: every layer alike, a
    # window on each when `sliding_window` is set (Mistral)
    layer_types: tuple[str, ...] | None = None
    # which layers rotate q and k (SmolLM3's `no_rope_layers`: 1 = RoPE, 0 = none, "NoPE"); None: every layer
    rope_layers: tuple[bool, ...] | None = None
    # Gemma 2 and 3: GELU (tanh) gating, an attention scale of query_pre_attn_scalar ** -0.5, embeddings
    # times sqrt(hidden), norms around both branches of a layer (weights stored as 1 + w); Gemma 3 the
    # sliding layers' own RoPE base
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # the attention scale is its ** -0.5; None: head_dim
    embed_scale: float | None = None
    sandwich_norms: bool = False
    local_rope_theta: float | None = None
    # Gemma 2: attention scores soft-capped, cap * tanh(scores / cap), and the final logits likewise
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    moe: MoE | None = None  # a mixture of experts for the MLP (Qwen3-MoE)
    # Cohere 2: LayerNorm (mean-centred, no bias) for RMSNorm, attention and MLP side by side on one norm
    # (a parallel block), RoPE on interleaved pairs (q/k rows permuted at load: kvpage rotates halves),
    # the logits times logit_scale
    layer_norm: bool = False
    parallel_block: bool = False
    rope_interleaved: bool = False
    logit_scale: float | None = None
    # Llama 4: chunked attention on its RoPE layers (a query reads its own chunk of this many tokens), q and
    # k L2-normalized (an RMSNorm without weight) on those layers, and on the NoPE layers each query scaled
    # by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) at position p: (floor_scale, attn_scale)
    attention_chunk_size: int | None = None
    qk_l2_norm: bool = False
    attn_temperature: tuple[float, float] | None = None
    # gpt-oss: each head a learned sink, a logit in its softmax that no value answers; o_proj with a bias
    attn_sinks: bool = False
    o_proj_bias: bool = False
    # Bamba: Mamba-2 mixers on its state-space layers (`layer_types` "linear_attention"); RoPE on the first
    # `rotary_dim` dims of each head only (None: all; q/k rows permuted at load so halves pair as kvpage rotates)
    mamba: Mamba | None = None
    rotary_dim: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; kvpage runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.sliding_window is not None:
            SlidingWindow(self.sliding_window)  # a bad value names itself
        if self.rope_layers is not None:
            self.rope_layers = tuple(bool(r) for r in self.rope_layers)
            if len(self.rope_layers) != self.num_layers:
                raise ValueError(
                    f"rope_layers names {len(self.rope_layers)} layers but the model has {self.num_layers}"
                )
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            # a kind that is not known, or a sliding layer without a window, names itself
            layer_specs(self.num_layers, sliding_window=self.sliding_window, layer_types=self.layer_types,
                        attention_chunk_size=self.attention_chunk_size)  # fmt: skip
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """What each layer reads (core/kv_spec.py)."""
        return layer_specs(self.num_layers, sliding_window=self.sliding_window, layer_types=self.layer_types,
                           attention_chunk_size=self.attention_chunk_size)  # fmt: skip

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The KV-cache groups of its layers (core/kv_spec.py: one for a model whose layers are alike)."""
        return group_layers(self.layer_specs)

    @property
    def layer_spec(self) -> LayerSpec:
        """The layers' one spec when they are all alike; full attention when kinds are mixed (then the
        KV-cache manager keeps a block table per group: `kv_groups`)."""
        specs = set(self.layer_specs)
        return specs.pop() if len(specs) == 1 else FULL

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """Bytes of one token's KV cache in `kv_dtype` ("float32", "bfloat16", "int8", "fp8", ...):
        K and V of every layer, of the kv heads only (grouped-query attention never repeats them),
        scales included; the one formula, in kvpage/core/kv_bytes.py."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, kv_dtype)

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face config.json that `from_hf` (and transformers) read back as this config."""
        hf = {
            "architectures": [
                {
                    "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM",
                    "qwen3_moe": "Qwen3MoeForCausalLM",
                    "mistral": "MistralForCausalLM",
                    "phi3": "Phi3ForCausalLM",
                    "smollm3": "SmolLM3ForCausalLM",
                    "gemma3_text": "Gemma3ForCausalLM",
                    "gemma2": "Gemma2ForCausalLM",
                    "cohere2": "Cohere2ForCausalLM",
                    "llama4_text": "Llama4ForCausalLM",
                    "gpt_oss": "GptOssForCausalLM",
                    "bamba": "BambaForCausalLM",
                }.get(self.architecture, "LlamaForCausalLM")
            ],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids or None,
        }
        if self.rope_layers is not None:
            hf["no_rope_layers"] = [int(r) for r in self.rope_layers]
        if self.architecture == "llama4_text":
            return hf | _llama4_hf(self)
        if self.architecture == "bamba":
            m = self.mamba
            types = self.layer_types or ("linear_attention",) * self.num_layers
            rope = {"rope_type": "default", "rope_theta": self.rope_theta,
                    "partial_rotary_factor": (self.rotary_dim or self.head_dim) / self.head_dim}  # fmt: skip
            return hf | {"attn_layer_indices": [i for i, t in enumerate(types) if t == "full_attention"],
                         "mamba_n_heads": m.num_heads, "mamba_d_head": m.head_dim, "mamba_n_groups": m.num_groups,
                         "mamba_d_state": m.state_size, "mamba_d_conv": m.conv_kernel, "mamba_conv_bias": m.conv_bias,
                         "mamba_proj_bias": m.proj_bias, "mamba_expand": m.intermediate_size // self.hidden_size,
                         "time_step_limit": list(m.time_step_limit), "rope_parameters": rope}  # fmt: skip
        if self.architecture == "gpt_oss":
            m = self.moe
            rope = {"rope_type": "default", "rope_theta": self.rope_theta} | (self.rope_scaling or {})
            return hf | {"intermediate_size": m.intermediate_size, "num_local_experts": m.num_experts,
                         "num_experts_per_tok": m.top_k, "swiglu_alpha": m.swiglu[0], "swiglu_limit": m.swiglu[1],
                         "sliding_window": self.sliding_window, "rope_parameters": rope,
                         "layer_types": list(self.layer_types or ["full_attention"] * self.num_layers)}  # fmt: skip
        if self.moe is not None:
            m = self.moe
            hf |= {"num_experts": m.num_experts, "num_experts_per_tok": m.top_k, "norm_topk_prob": m.norm_topk_prob,
                   "moe_intermediate_size": m.intermediate_size, "decoder_sparse_step": 1,
                   "mlp_only_layers": [i for i in range(self.num_layers) if not m.on(i)]}  # fmt: skip
        if self.architecture in ("gemma2", "gemma3_text"):
            full = {"rope_theta": self.rope_theta, **(self.rope_scaling or {"rope_type": "default"})}
            local = {"rope_type": "default", "rope_theta": self.local_rope_theta}
            rope = full if self.architecture == "gemma2" else {"full_attention": full, "sliding_attention": local}
            hf |= {"hidden_activation": self.hidden_act, "query_pre_attn_scalar": self.query_pre_attn_scalar,
                   "sliding_window": self.sliding_window,
                   "layer_types": list(self.layer_types or ["full_attention"] * self.num_layers),
                   "rope_parameters": rope, "attn_logit_softcapping": self.attn_logit_softcapping,
                   "final_logit_softcapping": self.final_logit_softcapping}  # fmt: skip
        elif self.architecture == "cohere2":
            hf |= {"sliding_window": self.sliding_window, "logit_scale": self.logit_scale,
                   "layer_norm_eps": self.rms_norm_eps, "rope_parameters": {"rope_type": "default",
                                                                            "rope_theta": self.rope_theta},
                   "layer_types": list(self.layer_types or ["full_attention"] * self.num_layers)}  # fmt: skip
        elif self.architecture in ("mistral", "phi3"):
            hf["sliding_window"] = self.sliding_window
        elif self.layer_types is not None:
            hf |= {"use_sliding_window": True, "sliding_window": self.sliding_window,
                   "layer_types": list(self.layer_types),
                   "max_window_layers": self.layer_types.index("sliding_attention")}  # fmt: skip
        return hf

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json."""
        model_type = hf.get("model_type", "llama")
        if model_type in ("gemma2", "gemma3_text"):
            return _gemma(cls, hf)
        if model_type == "cohere2":
            return _cohere2(cls, hf)
        if model_type == "llama4_text":
            return _llama4(cls, hf)
        if model_type == "gpt_oss":
            return _gpt_oss(cls, hf)
        if model_type == "bamba":
            return _bamba(cls, hf)
        if model_type == "llama4":
            raise ValueError(
                "Llama 4's multimodal checkpoint (model_type llama4) is not supported; kvpage loads its "
                "text model (model_type llama4_text, Llama4ForCausalLM)"
            )
        rope_scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.setdefault("rope_type", rope_scaling.get("type", "default"))
            rope_theta = rope_scaling.pop("rope_theta", None)
            if rope_scaling.pop("partial_rotary_factor", 1.0) != 1.0:
                raise ValueError("partial rotary embeddings (partial_rotary_factor below 1) are not supported")
            if rope_scaling["rope_type"] == "default" and set(rope_scaling) <= {"rope_type", "type"}:
                rope_scaling = None
        else:
            rope_theta = None
        if hf.get("mlp_bias"):
            raise ValueError("models with MLP biases (mlp_bias=true) are not supported")
        # Mistral reads a window on every layer: the KV-cache manager releases what falls behind it
        window = hf.get("sliding_window") if model_type in ("mistral", "phi3") else None
        layer_types = None
        if (
            model_type in ("qwen2", "qwen3", "qwen3_moe", "smollm3")
            and hf.get("use_sliding_window")
            and hf.get("sliding_window")
        ):
            # windows on the layers from max_window_layers up, as transformers lays them out
            n, first = hf["num_hidden_layers"], hf.get("max_window_layers", 28)
            types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
            if "sliding_attention" in types:
                window, layer_types = hf["sliding_window"], tuple(types)
        return cls(
            **_shape(hf, max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None),
            rope_theta=float(hf.get("rope_theta") or rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            architecture=model_type,
            sliding_window=window or None,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            layer_types=layer_types,
            rope_layers=_rope_layers(hf) if model_type == "smollm3" else None,
            moe=_moe(hf) if model_type == "qwen3_moe" else None,
        )


def _rope(hf: dict[str, Any], default_theta: float, refuse_scaled: str | None = None) -> tuple[float, dict | None]:
    """(RoPE base, its scaling or None) from a config's rope_parameters or rope_scaling; a family that has no
    scaled RoPE (`refuse_scaled` names it) refuses one."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or default_theta
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if refuse_scaled:
        raise ValueError(f"{refuse_scaled} with a scaled RoPE is not supported")
    rope.setdefault("rope_type", kind)
    return float(theta), rope


def _shape(hf: dict[str, Any], **defaults) -> dict[str, Any]:
    """The ModelConfig fields every family reads from config.json alike (`defaults`: the family's
    transformers defaults for the keys a config may leave out)."""
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id", defaults["eos_token_id"])
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings", defaults["max_position_embeddings"]),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", defaults["tie_word_embeddings"])),
        bos_token_id=hf.get("bos_token_id", defaults["bos_token_id"]),
        eos_token_ids=[] if eos is None else (list(eos) if isinstance(eos, list) else [eos]),
    )


def _gemma(cls, hf: dict[str, Any]) -> ModelConfig:
    """Gemma 2 (Gemma2Config: a window on every other layer, attention and final logits soft-capped) and
    Gemma 3's text model (Gemma3TextConfig: windows on five layers of six, each kind its own RoPE, q/k norm)."""
    gemma2 = hf.get("model_type") == "gemma2"
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma with hidden_activation {hf['hidden_activation']!r} is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma with use_bidirectional_attention (an encoder) is not supported")
    n = hf["num_hidden_layers"]
    pattern = 2 if gemma2 else hf.get("sliding_window_pattern", 6)
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    rope = hf.get("rope_parameters") or {}
    if gemma2:  # one RoPE for every layer
        full = dict(rope) if "rope_type" in rope or "rope_theta" in rope else {"rope_theta": hf.get("rope_theta")}
        local = {}
    else:
        full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    full_theta = full.pop("rope_theta", None) or (10_000.0 if gemma2 else 1_000_000.0)
    local_theta = local.pop("rope_theta", 10_000.0)
    if local.get("rope_type", "default") != "default":
        raise ValueError("Gemma's sliding layers with a scaled RoPE are not supported")
    scaling = full if full.get("rope_type", "default") != "default" else None
    shape = _shape(hf, max_position_embeddings=8192 if gemma2 else 131_072, tie_word_embeddings=True, bos_token_id=2,
                   eos_token_id=1)  # fmt: skip
    caps = {k: (float(hf[k]) if hf.get(k) is not None else None)
            for k in ("attn_logit_softcapping", "final_logit_softcapping")}  # fmt: skip
    return cls(
        **shape,
        rope_theta=float(full_theta),
        rope_scaling=scaling,
        attention_bias=bool(hf.get("attention_bias", False)),
        architecture="gemma2" if gemma2 else "gemma3_text",
        sliding_window=hf.get("sliding_window") if "sliding_attention" in types else None,
        qk_norm=not gemma2,
        layer_types=tuple(types) if "sliding_attention" in types else None,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", shape["head_dim"]),
        embed_scale=float(hf["hidden_size"]) ** 0.5,
        sandwich_norms=True,
        local_rope_theta=None if gemma2 else float(local_theta),
        **caps,
    )


def _cohere2(cls, hf: dict[str, Any]) -> ModelConfig:
    """Cohere 2 (Cohere2Config): windows on three layers of four, RoPE on those only (the global layers
    are NoPE), parallel blocks on a LayerNorm, interleaved RoPE, scaled logits."""
    if hf.get("use_qk_norm"):
        raise ValueError("Cohere with use_qk_norm is not supported")
    n = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", 4)
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    theta, _ = _rope(hf, 10000.0, refuse_scaled="Cohere 2")
    shape = _shape(hf, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=5, eos_token_id=255001)
    return cls(
        **(shape | {"rms_norm_eps": hf.get("layer_norm_eps", 1e-5)}),
        rope_theta=theta,
        attention_bias=bool(hf.get("attention_bias", False)),
        architecture="cohere2",
        sliding_window=hf.get("sliding_window") if "sliding_attention" in types else None,
        layer_types=tuple(types) if "sliding_attention" in types else None,
        rope_layers=tuple(t == "sliding_attention" for t in types),
        layer_norm=True,
        parallel_block=True,
        rope_interleaved=True,
        logit_scale=float(hf.get("logit_scale", 0.0625)),
    )


def _llama4(cls, hf: dict[str, Any]) -> ModelConfig:
    """Llama 4's text model (Llama4TextConfig): chunked attention and RoPE on three layers of four, the
    fourth global and NoPE with its queries temperature-scaled, weightless q/k norms on the RoPE layers,
    mixtures of experts (a sigmoid router, a shared expert) on `moe_layers`, dense MLPs of
    `intermediate_size_mlp` elsewhere."""
    n = hf["num_hidden_layers"]
    rope_flags = hf.get("no_rope_layers") or [int((i + 1) % hf.get("no_rope_layer_interval", 4) != 0) for i in range(n)]
    chunk = hf.get("attention_chunk_size", 8192)
    types = hf.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention" for r in rope_flags]
    theta, scaling = _rope(hf, 500_000.0)
    step = hf.get("interleave_moe_layer_step", 1)
    moe_layers = set(hf["moe_layers"] if hf.get("moe_layers") is not None else range(step - 1, n, step))
    experts = hf.get("num_local_experts", 16)
    expert_size = hf.get("intermediate_size", 8192)
    moe = MoE(experts, hf.get("num_experts_per_tok", 1), expert_size, False,
              None if len(moe_layers) == n else tuple(i in moe_layers for i in range(n)), router="sigmoid",
              shared_intermediate_size=expert_size) if moe_layers else None  # fmt: skip
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Llama 4 with hidden_act {hf['hidden_act']!r} is not supported")
    shape = _shape(hf, max_position_embeddings=131_072, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return cls(
        **(
            shape
            | {
                "intermediate_size": hf.get("intermediate_size_mlp", 16384),
                "rms_norm_eps": hf.get("rms_norm_eps", 1e-5),
            }
        ),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(hf.get("attention_bias", False)),
        architecture="llama4_text",
        layer_types=tuple(types) if "chunked_attention" in types else None,
        rope_layers=tuple(bool(r) for r in rope_flags),
        moe=moe,
        attention_chunk_size=chunk if "chunked_attention" in types else None,
        rope_interleaved=True,  # (transformers rotates adjacent pairs, as complex numbers)
        qk_l2_norm=bool(hf.get("use_qk_norm", True)),
        attn_temperature=(float(hf.get("floor_scale", 8192)), float(hf.get("attn_scale", 0.1)))
        if hf.get("attn_temperature_tuning", True)
        else None,
    )


def _gpt_oss(cls, hf: dict[str, Any]) -> ModelConfig:
    """gpt-oss (GptOssConfig): windows on every other layer (the first), learned sinks in every head, biases
    on q/k/v/o, YaRN-scaled RoPE, and on every layer a mixture of experts with biases and a clamped SwiGLU."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    theta, scaling = _rope(hf, 150_000.0)
    moe = MoE(hf.get("num_local_experts", 128), hf.get("num_experts_per_tok", 4), hf["intermediate_size"],
              router="topk_softmax", bias=True,
              swiglu=(float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))))  # fmt: skip
    shape = _shape(hf, max_position_embeddings=131_072, tie_word_embeddings=False, bos_token_id=None,
                   eos_token_id=None)  # fmt: skip
    return cls(
        **(shape | {"rms_norm_eps": hf.get("rms_norm_eps", 1e-5)}),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(hf.get("attention_bias", True)),
        architecture="gpt_oss",
        sliding_window=hf.get("sliding_window") if "sliding_attention" in types else None,
        layer_types=tuple(types) if "sliding_attention" in types else None,
        moe=moe,
        attn_sinks=True,
        o_proj_bias=bool(hf.get("attention_bias", True)),
    )


def _bamba(cls, hf: dict[str, Any]) -> ModelConfig:
    """Bamba (BambaConfig): Mamba-2 state-space layers, full attention on `attn_layer_indices` with RoPE on
    half of each head (transformers fixes partial_rotary_factor at 0.5), LLaMA's MLP and norms."""
    n, hidden = hf["num_hidden_layers"], hf["hidden_size"]
    attn = set(hf.get("attn_layer_indices") or ())
    types = tuple("full_attention" if i in attn else "linear_attention" for i in range(n))
    heads, expand = hf.get("mamba_n_heads", 128), hf.get("mamba_expand", 2)
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = expand * hidden // heads if head_dim in (None, "auto") else head_dim
    # (transformers writes infinity as {"__float__": "Infinity"})
    limit = [x["__float__"] if isinstance(x, dict) else x for x in hf.get("time_step_limit") or (0.0, "inf")]
    mamba = Mamba(heads, head_dim, hf.get("mamba_n_groups", 1), hf.get("mamba_d_state", 256), hf.get("mamba_d_conv", 4),
                  bool(hf.get("mamba_conv_bias", True)), bool(hf.get("mamba_proj_bias", False)),
                  (float(limit[0]), float(limit[1])))  # fmt: skip
    theta, _ = _rope(hf, 10000.0, refuse_scaled="Bamba")
    if hf.get("mlp_bias"):
        raise ValueError("models with MLP biases (mlp_bias=true) are not supported")
    shape = _shape(hf, max_position_embeddings=262_144, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return cls(
        **(shape | {"rms_norm_eps": hf.get("rms_norm_eps", 1e-5)}),
        rope_theta=theta,
        attention_bias=bool(hf.get("attention_bias", False)),
        architecture="bamba",
        layer_types=types,
        mamba=mamba,
        rotary_dim=int(shape["head_dim"] * float((hf.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5))),
    )


def _llama4_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The Llama4TextConfig keys of `cfg` (to_hf)."""
    m = cfg.moe
    temp = cfg.attn_temperature
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta} | (cfg.rope_scaling or {})
    return {"intermediate_size": m.intermediate_size if m else cfg.intermediate_size,
            "intermediate_size_mlp": cfg.intermediate_size, "num_local_experts": m.num_experts if m else 0,
            "num_experts_per_tok": m.top_k if m else 1,
            "moe_layers": [i for i in range(cfg.num_layers) if m and m.on(i)],
            "no_rope_layers": [int(r) for r in cfg.rope_layers or [True] * cfg.num_layers],
            "layer_types": list(cfg.layer_types or ["full_attention"] * cfg.num_layers),
            "attention_chunk_size": cfg.attention_chunk_size, "use_qk_norm": cfg.qk_l2_norm,
            "attn_temperature_tuning": temp is not None, "floor_scale": round(temp[0]) if temp else 8192,
            "attn_scale": temp[1] if temp else 0.1, "rope_parameters": rope}  # fmt: skip


def _moe(hf: dict[str, Any]) -> MoE | None:
    """Qwen3-MoE's mixture: on every `decoder_sparse_step`-th layer not in `mlp_only_layers`."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if not experts:
        return None
    n, step, dense = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    return MoE(experts, hf["num_experts_per_tok"], hf["moe_intermediate_size"], bool(hf.get("norm_topk_prob", False)),
               None if all(layers) else layers)  # fmt: skip


def _rope_layers(hf: dict[str, Any]) -> tuple[bool, ...]:
    """SmolLM3's layers that rotate q and k: `no_rope_layers` (1 = RoPE), else every layer but each
    `no_rope_layer_interval`-th, as transformers lays them out."""
    n = hf["num_hidden_layers"]
    flags = hf.get("no_rope_layers") or [(i + 1) % hf.get("no_rope_layer_interval", 4) != 0 for i in range(n)]
    return tuple(bool(f) for f in flags)
