"""The LLaMA architecture over the paged KV cache; also Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3,
Gemma 2/3, Cohere 2, Qwen3-MoE, Llama 4 and gpt-oss, each a variation on it.

    tokens [T] -> embed -> L x ( x + attn(rmsnorm(x)),  x + mlp(rmsnorm(x)) ) -> rmsnorm -> lm_head

T is the number of new tokens of the whole ragged batch; there is no batch dimension and no
padding. Each layer's attention writes the new K/V into that layer's cache (via the backend) and
reads every earlier key through the block tables in `AttentionMetadata`, which is passed in
explicitly. The arithmetic follows Hugging Face's LlamaForCausalLM (float32 RoPE tables and RMSNorm
statistics) so float32 outputs agree with it to rounding.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

import torch
from torch import nn

from kvpage.attention import AttentionBackend, AttentionMetadata, LayerKV, get_backend
from kvpage.models.config import ModelConfig
from kvpage.models.layer_hook import LayerHook
from kvpage.models.layer_ops import TorchLayerOps, rms_norm_ref
from kvpage.models.mamba import MambaMixer

# one expert's projection in a checkpoint of a mixture of experts (Qwen3-MoE's per-expert names)
_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class RMSNorm(nn.Module):
    """Holds the weight; the arithmetic is the layer ops' (rms_norm / add_rms_norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with linear or llama3 scaling when asked."""
    # RoPE on the first rotary_dim dims of a head (Bamba): their frequencies, then zeros (cos 1, sin 0) for
    # the rest, which the loader's row order (loader.rope_row_order) pairs among themselves
    d = cfg.rotary_dim or cfg.head_dim
    # explicit device: the model may be built under torch.device("meta"), and these are not weights
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    if d != cfg.head_dim:
        return torch.cat([inv_freq, torch.zeros((cfg.head_dim - d) // 2, device="cpu")])
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope_type == "yarn":
        inv_freq = _yarn(inv_freq, cfg, scaling)
    elif rope_type == "factors":  # (each frequency's divisor, as a GGUF's rope_freqs holds llama3's scaling)
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    return inv_freq


def _yarn(inv_freq: torch.Tensor, cfg: ModelConfig, scaling: dict) -> torch.Tensor:
    """YaRN (gpt-oss): each frequency between extrapolated (as trained) and interpolated (divided by the
    factor), by a linear ramp over the dimensions whose wavelengths the original context turned between
    beta_slow and beta_fast times (transformers' arithmetic)."""
    d, base, factor = cfg.head_dim, cfg.rope_theta, scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:
        return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = (
        (torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / (high - low if high != low else 0.001)
    ).clamp(0, 1)
    keep = 1 - ramp  # the share of each frequency kept as trained
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (0.1 ln(factor) + 1 unless the config names it); 1 otherwise."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return float(get(mscale) / get(mscale_all)) if mscale and mscale_all else get()


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = rope_inv_freq(cfg)
        self.attention_factor = rope_attention_factor(cfg)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, d/2], float32
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: TorchLayerOps, rope: bool = True):
        super().__init__()
        self.rope = rope  # False: a NoPE layer (SmolLM3), q and k as projected
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v in one matmul: rows [0, q) are q, then k, then v
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        # gpt-oss: a sink logit per head; the layer's cache view carries it to the attention (LayerKV.sinks)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attn_sinks else None
        self.scale = float(cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.backend, self.ops = backend, ops
        self.eps = cfg.rms_norm_eps
        self.q_norm = self.k_norm = None
        # Llama 4's RoPE layers: q and k L2-normalized per head (an RMSNorm without weight; after RoPE there,
        # before it here: RoPE turns pairs, which keeps a head's norm); its NoPE layers scale each query
        self.l2_norm = cfg.qk_l2_norm and rope
        self._ones: torch.Tensor | None = None  # (the L2 norm's weight)
        self.temperature = cfg.attn_temperature is not None and not rope
        if cfg.qk_norm:  # Qwen3: each head of q and of k RMS-normalized before RoPE, one weight per head dim
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        if self.q_norm is not None or self.l2_norm:
            qkv = self._norm_qk(qkv)
        if self.rope:
            q, k, v = self.ops.qkv_rope(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            d = self.head_dim
            q, k, v = (
                q.reshape(-1, self.num_heads, d),
                k.reshape(-1, self.num_kv_heads, d),
                v.reshape(-1, self.num_kv_heads, d),
            )
            if self.temperature:  # (this layer's table: each token's query scale, DecoderLayer.rope_table)
                q = q * cos[:, None, :1]
        if self.sinks is not None:
            kv.sinks = self.sinks
        o = self.backend.forward(q, k, v, kv, meta, self.scale)
        return self.ops.linear(o.reshape(-1, self.q_size), self.o_proj.weight, self.o_proj.bias)

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """[T, q + 2 kv] with every head of q and k normalized over its head_dim (v as it was)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        d = self.head_dim
        if self.q_norm is None:  # (weightless: a weight of ones, made once per dtype and device)
            if self._ones is None or self._ones.dtype != qkv.dtype or self._ones.device != qkv.device:
                self._ones = torch.ones(d, dtype=qkv.dtype, device=qkv.device)
            eps, wq, wk = self.eps, self._ones, self._ones
        else:
            eps, wq, wk = self.q_norm.eps, self.q_norm.weight, self.k_norm.weight
        q = self.ops.rms_norm(q.reshape(-1, d), wq, eps).view(-1, self.q_size)
        k = self.ops.rms_norm(k.reshape(-1, d), wk, eps).view(-1, self.kv_size)
        return torch.cat([q, k, v], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchLayerOps):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma's GeGLU, else SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.ops.linear(x, self.gate_up_proj.weight)
        act = self.ops.gelu_tanh_mul(gate_up) if self.gelu else self.ops.silu_mul(gate_up)
        return self.ops.linear(act, self.down_proj.weight)


class SparseMoE(nn.Module):
    """A mixture of SwiGLU experts, the plain torch way: each chosen expert run on its tokens in expert
    order, its output added into theirs. Qwen3-MoE: the router's softmax over every expert, its top k per
    token (renormalized when the config says), each output weighted. Llama 4: the top k logits'
    sigmoids scale each expert's input instead, and a shared expert's output (`shared_expert`, an MLP)
    comes first. Experts are stacked: gate_up_proj [E, 2I, H] (gate rows, then up), down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig, ops: TorchLayerOps):
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=moe.bias)  # the router
        self.experts = nn.Module()
        e, i, h = moe.num_experts, moe.intermediate_size, cfg.hidden_size
        self.experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.experts.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.experts.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i)) if moe.bias else None
        self.experts.down_proj_bias = nn.Parameter(torch.empty(e, h)) if moe.bias else None
        self.moe, self.sigmoid = moe, moe.router == "sigmoid"
        self.shared_expert = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(dataclasses.replace(cfg, intermediate_size=moe.shared_intermediate_size), ops)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe, experts = self.moe, self.experts
        logits = self.ops.linear(x, self.gate.weight, self.gate.bias)  # [T, E]
        if moe.router == "softmax":
            weights, chosen = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), moe.top_k, dim=-1)
            if moe.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            top, chosen = torch.topk(logits, moe.top_k, dim=-1)
            weights = torch.sigmoid(top.float()) if self.sigmoid else torch.softmax(top, dim=-1)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x) if self.shared_expert is None else self.shared_expert(x)
        for e in torch.unique(chosen).tolist():  # (ascending: transformers' order of the adds)
            rows, slot = torch.where(chosen == e)
            w = weights[rows, slot, None]
            bias = (None, None) if experts.down_proj_bias is None else \
                (experts.gate_up_proj_bias[e], experts.down_proj_bias[e])  # fmt: skip
            h = self.ops.linear(x[rows] * w if self.sigmoid else x[rows], experts.gate_up_proj[e], bias[0])
            y = self.ops.linear(self._act(h), experts.down_proj[e], bias[1])
            out.index_add_(0, rows, y if self.sigmoid else y * w)
        return out

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.moe.swiglu is None:
            return self.ops.silu_mul(gate_up)
        alpha, limit = self.moe.swiglu  # (gpt-oss's clamped SwiGLU)
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)). The residual add of each branch is done by the next
    norm (add_rms_norm): a layer takes the residual stream and the previous layer's MLP output still
    to be added, and returns the same pair."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: TorchLayerOps, comm=None, index: int = 0):
        super().__init__()
        self.comm = comm  # a tensor-parallel shard's group: o_proj and down_proj are row-parallel
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the token mixer: attention, or on a state-space layer (Bamba) Mamba-2's mixer, called alike
        state = cfg.layer_specs[index].kind == "state"
        self.self_attn = None if state else Attention(cfg, backend, ops, rope=cfg.rope_layers is None or
                                                      cfg.rope_layers[index])  # fmt: skip
        self.mamba = MambaMixer(cfg, ops) if state else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, ops) if cfg.moe is not None and cfg.moe.on(index) else MLP(cfg, ops)
        self.ops = ops
        # which position table this layer reads where the model has two ([T, 2, d], LlamaForCausalLM.embed):
        # Gemma 3's sliding layers their local RoPE base, Llama 4's NoPE layers their queries' temperature
        rope = cfg.rope_layers is None or cfg.rope_layers[index]
        self.rope_table = int((cfg.local_rope_theta is not None and cfg.layer_specs[index].kind == "sliding")
                              or (cfg.attn_temperature is not None and not rope))  # fmt: skip

    def forward(self, x, delta, cos, sin, kv: LayerKV, meta):
        x, attn = self._attention(x, delta, cos, sin, kv, meta)
        norm2 = self.post_attention_layernorm
        x, h = self.ops.add_rms_norm(x, attn, norm2.weight, norm2.eps)
        return x, self._mlp(h)

    def _attention(self, x, delta, cos, sin, kv: LayerKV, meta):
        """(the residual with the pending delta added, the attention branch's output)."""
        if cos.dim() == 3:  # [T, tables, d]: this layer's own
            cos, sin = cos[:, self.rope_table].contiguous(), sin[:, self.rope_table].contiguous()
        norm1 = self.input_layernorm
        if delta is None:
            h = self.ops.rms_norm(x, norm1.weight, norm1.eps)
        else:
            x, h = self.ops.add_rms_norm(x, delta, norm1.weight, norm1.eps)
        attn = (self.self_attn or self.mamba)(h, cos, sin, kv, meta)
        if self.comm is not None:
            self.comm.all_reduce(attn)  # the heads' partial sums of o_proj
        return x, attn

    def _mlp(self, h):
        mlp = self.mlp(h)
        if self.comm is not None:
            self.comm.all_reduce(mlp)  # the MLP slices' partial sums of down_proj
        return mlp


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's LayerNorm: mean-centred, scaled by the weight, no bias; in float32, back to x's dtype."""
    h = x.float()
    h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


class ParallelDecoderLayer(nn.Module):
    """Cohere's layer: x + attn(norm(x)) + mlp(norm(x)), one LayerNorm for both branches; the same
    (residual, pending delta) contract as DecoderLayer (the branches' sum is the delta)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: TorchLayerOps, comm=None, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # (a LayerNorm's weight: same holder)
        self.self_attn = Attention(cfg, backend, ops, rope=cfg.rope_layers is None or cfg.rope_layers[index])
        self.mlp = MLP(cfg, ops)

    def forward(self, x, delta, cos, sin, kv: LayerKV, meta):
        if delta is not None:
            x = x + delta
        h = layer_norm(x, self.input_layernorm.weight, self.input_layernorm.eps)
        return x, self.self_attn(h, cos, sin, kv, meta) + self.mlp(h)


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 3's layer: a norm before and after each branch, the branch's output normalized before it
    is added (post_attention_layernorm is on the attention's output here, pre_feedforward_layernorm before
    the MLP); the same (residual, pending delta) contract as DecoderLayer. Sliding layers take the
    second RoPE table (the local base) when the model has one."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: TorchLayerOps, comm=None, index: int = 0):
        super().__init__(cfg, backend, ops, comm, index)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, delta, cos, sin, kv: LayerKV, meta):
        x, attn = self._attention(x, delta, cos, sin, kv, meta)
        post1, norm2, post2 = (
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )
        x, h = self.ops.add_rms_norm(x, self.ops.rms_norm(attn, post1.weight, post1.eps), norm2.weight, norm2.eps)
        return x, self.ops.rms_norm(self._mlp(h), post2.weight, post2.eps)


class LlamaForCausalLM(nn.Module):
    # Hugging Face weights that we hold fused: HF name part -> (our fused parameter, shard index);
    # shards are stacked along dim 0 in index order (q, k, v; gate, up)
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None, ops: TorchLayerOps | None = None,
                 comm=None):  # fmt: skip
        super().__init__()
        # under tensor parallelism (kvpage/distributed): this rank's config (its heads, its MLP slice) and
        # its group, whose all-reduce completes each layer's row-parallel projections
        self.config, self.comm = cfg, comm
        self.attention_backend = backend = backend or get_backend("torch")
        self.ops = ops = ops or TorchLayerOps()
        # (an uninitialised weight: the loader fills it, and Embedding's own init on the meta device
        # imports torch._dynamo and triton, 143 MB resident)
        table = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        layer = ParallelDecoderLayer if cfg.parallel_block else SandwichDecoderLayer if cfg.sandwich_norms else \
            DecoderLayer  # fmt: skip
        self.layers = nn.ModuleList(layer(cfg, backend, ops, comm, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        # Gemma 3's sliding layers: their own RoPE base, unscaled (a second table, [T, 2, d] with the first)
        self.local_rotary = None
        if cfg.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None)
            )
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_weight = None  # set by weight_quant.quantize_model

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms stay in it under weight-only quantization)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[LayerKV],  # per layer
        meta: AttentionMetadata | list[AttentionMetadata],  # per layer where its KV-cache groups differ
        hook: LayerHook | None = None,  # runs around each layer (the model runner's step hooks give it)
    ) -> torch.Tensor:  # hidden states [T, hidden]
        return self.run_layers(*self.embed(input_ids, positions), kv_caches, meta, hook)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """(embeddings [T, hidden], cos, sin): what every layer starts from."""
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:  # (Gemma: times sqrt(hidden), the factor in the activations' dtype)
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        if self.local_rotary is not None:
            local = self.local_rotary(positions, x.dtype)
            cos, sin = torch.stack([cos, local[0]], dim=1), torch.stack([sin, local[1]], dim=1)
        if self.config.attn_temperature is not None:  # (Llama 4's NoPE layers: each query's scale, as a table)
            floor, strength = self.config.attn_temperature
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor)) * strength + 1.0
            cos = torch.stack([cos, scale[:, None].expand_as(cos).to(cos.dtype)], dim=1)
            sin = torch.stack([sin, torch.zeros_like(sin)], dim=1)
        return x, cos, sin

    def run_layers(self, x, cos, sin, kv_caches: list[LayerKV], meta: AttentionMetadata | list[AttentionMetadata],
                   hook: LayerHook | None = None):  # fmt: skip
        """Every decoder layer, then the final norm: hidden states [T, hidden]. A `hook` sees each
        layer's cache before and after it runs, may narrow the rows (and metadata) the later layers
        run, and gives the final hidden states back at the step's rows."""
        delta = None
        metas = meta if isinstance(meta, list) else None  # per layer: a model of several KV-cache groups
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if hook is not None:
                hook.before_layer(i, kv)
            x, delta = layer(x, delta, cos, sin, kv, meta if metas is None else metas[i])
            if hook is not None:
                rows, narrowed = hook.after_layer(i, kv)
                if rows is not None:
                    x, delta, cos, sin, meta = x[rows], delta[rows], cos[rows], sin[rows], narrowed
        if self.config.layer_norm:  # (Cohere)
            hidden = layer_norm(x if delta is None else x + delta, self.norm.weight, self.norm.eps)
        else:
            hidden = self.ops.add_rms_norm(x, delta, self.norm.weight, self.norm.eps)[1]
        return hidden if hook is None else hook.finish(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head_weight  # a QuantizedWeight under weight-only quantization
        if weight is None:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.ops.linear(hidden, weight)
        if self.config.logit_scale is not None:  # (Cohere)
            logits = logits * self.config.logit_scale
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap  # (Gemma 2)

    def _expert_slice(self, params: dict, base: str, e: str, part: str) -> tuple[str, str, torch.Tensor]:
        """(the stacked parameter, the loaded-key, the slice) of expert `e`'s `part` (gate/up/down_proj)."""
        i = self.config.moe.intermediate_size  # type: ignore[union-attr]
        if part == "down_proj":
            return f"{base}.down_proj", f"{base}.down_proj#{e}", params[f"{base}.down_proj"][int(e)]
        shard = int(part == "up_proj")
        name = f"{base}.gate_up_proj"
        return name, f"{name}#{e}.{shard}", params[name][int(e)].narrow(0, shard * i, i)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors ("model.layers.0.self_attn.q_proj.weight", ...), fusing
        q/k/v and gate/up. Every parameter must be covered exactly; a missing or unexpected name,
        or a wrong shape, raises ValueError naming it."""
        params = dict(self.named_parameters())
        cfg = self.config
        qkv_sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        shard_sizes = {"qkv_proj": qkv_sizes, "gate_up_proj": None}  # (gate/up: halves of the parameter)
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue  # some checkpoints store the tied copy too
            expert = _EXPERT.fullmatch(name)
            if expert is not None:  # one expert's projection of a mixture: a slice of the stacked tensors
                name, key, target = self._expert_slice(params, *expert.groups())
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(target.shape)}")  # fmt: skip
                target.copy_(tensor)
                loaded.add(key)
                continue
            shard = None
            for hf_part, (ours, idx) in self._FUSED.items():
                if f".{hf_part}." in name:
                    name, shard = name.replace(hf_part, ours), idx
                    break
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for a {cfg.architecture} model")
            param = params[name]
            if shard is None:
                target = param
            else:
                sizes = shard_sizes[name.split(".")[-2]] or [param.shape[0] // 2] * 2
                target = param.narrow(0, sum(sizes[:shard]), sizes[shard])
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        expected = set()
        for name in params:
            part = name.split(".")[-2] if "." in name else ""
            if part in shard_sizes:
                expected.update(f"{name}#{i}" for i in range(len(shard_sizes[part] or (0, 1))))
            elif name.endswith("experts.gate_up_proj") and name not in loaded:  # (loaded whole, or expert by expert)
                expected.update(f"{name}#{e}.{i}" for e in range(params[name].shape[0]) for i in (0, 1))
            elif name.endswith("experts.down_proj") and name not in loaded:
                expected.update(f"{name}#{e}" for e in range(params[name].shape[0]))
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
