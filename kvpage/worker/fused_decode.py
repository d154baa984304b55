"""A decode step's layers in one compiled call (torch.ops.kvpage.decode_layers): the model runner's
fast path, chosen by the runner (as nano-vllm and vLLM choose CUDA graphs there), never by the model.

At one to a few sequences a step is bound by reading the weights (~17 ms for SmolLM2's 270 MB of
bfloat16 here), and the ~12 Python-side calls per layer (module calls, dispatch, views, the
backend's checks) add ~15% to it. When every sequence of a step decodes one token, the model's
layers use the CPU kernels for both their math and attention, and the cache is in the model's dtype
or int8, `FusedDecode.run` hands the whole stack to C++, which calls the same kernels in the same
order: the hidden states are bit-identical to the layer-by-layer path. A tensor-parallel rank calls
the two halves of each layer instead (decode_attention_part, decode_mlp_part: the same functions),
all-reducing o_proj's and down_proj's partial sums between them. Anything else (prefill
chunks, H2O's attention mass, fp8 caches, the reference ops, a backend whose `fuses_decode` is
False) runs the model layer by layer.
"""

from __future__ import annotations

import weakref

import torch

from kvpage.attention.backend import BOUNDED, DENSE, decodes_path
from kvpage.attention.key_bounds import RECENT_BLOCKS, SINK_BLOCKS
from kvpage.attention.layer_kv import LayerKV
from kvpage.attention.metadata import AttentionMetadata
from kvpage.models.layer_ops import KernelLayerOps
from kvpage.models.weight_quant import QuantizedWeight
from kvpage.ops import KERNEL_DTYPES


class FusedDecode:
    def __init__(self, model) -> None:
        self._model = weakref.ref(model)  # the model holds this object: no cycle keeping its weights alive
        # (flat list, bits (0: plain), the plain weights' dtype, qkv biases); () when the weights do not fit
        self._weights: tuple | None = None

    @staticmethod
    def applies_to(model) -> bool:
        """Whether the model's layers could ever take this path (kernel ops, and a backend whose
        cache layout and decode are the compiled kernels': `AttentionBackend.fuses_decode`)."""
        return (
            isinstance(model.ops, KernelLayerOps)
            and not model.config.qk_norm  # (the compiled layers have no per-head norm of q and k,
            and model.config.rope_layers is None  # and rotate q and k on every layer,
            and model.config.moe is None  # and have one MLP a layer after the attention)
            and not model.config.parallel_block
            and model.config.mamba is None  # (attention on every layer)
            and all(layer.self_attn.backend.fuses_decode for layer in model.layers)
        )

    @property
    def model(self):
        return self._model()

    def forward(self, input_ids, positions, kv_caches: list[LayerKV], meta: AttentionMetadata) -> torch.Tensor:
        """The model's final-norm hidden states for a step: in one call when it is a pure decode
        this path runs, else the model layer by layer (same bits either way)."""
        model = self.model
        x, cos, sin = model.embed(input_ids, positions)
        hidden = self.run(x, cos, sin, kv_caches, meta) if isinstance(meta, AttentionMetadata) else None
        return hidden if hidden is not None else model.run_layers(x, cos, sin, kv_caches, meta)

    def run(self, x, cos, sin, kv_caches: list[LayerKV], meta: AttentionMetadata) -> torch.Tensor | None:
        """The final-norm hidden states [T, hidden] of a pure decode step, or None if it does not apply."""
        bounded = not meta.reads.empty and any(kv.bounded for kv in kv_caches)
        path = decodes_path(meta, bounded, any(kv.shaped for kv in kv_caches))
        if meta.num_decodes != meta.num_seqs or path not in (DENSE, BOUNDED) or not self.applies_to(self.model):
            return None  # (H2O's mass, demoted blocks, a window: the reference, layer by layer)
        budgets = meta.reads.budgets if path == BOUNDED else None  # blocks each decode reads (key_bounds.py)
        if x.dtype not in KERNEL_DTYPES:
            return None
        weights = self._layer_weights()
        caches = _cache_lists(kv_caches, x.dtype)
        if weights is None or caches is None:
            return None
        flat, bits, weight_dtype, bias = weights
        if bits == 0 and weight_dtype != x.dtype:  # plain weights of another dtype: torch's path
            return None
        ops, rows = self.model.ops, x.shape[0]
        limit = (ops.policy.quantized if bits else ops.policy.plain)[x.dtype]
        cfg, attn = self.model.config, self.model.layers[0].self_attn
        if self.model.comm is not None:
            return self._run_sharded(x, cos, sin, flat, bits, bias, caches, kv_caches, meta, 0 < rows <= limit, budgets)
        return torch.ops.kvpage.decode_layers(
            x, cos, sin, flat, bits, bias, *caches, meta.block_tables, meta.seq_lens, meta.slot_mapping,
            self.model.norm.weight, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, attn.scale,
            0 < rows <= limit, ops.policy.one_order, *_bounds_lists(kv_caches), budgets, SINK_BLOCKS, RECENT_BLOCKS,
        )  # fmt: skip

    def _run_sharded(self, x, cos, sin, flat, bits, bias, caches, kv_caches, meta, kernel_linear: bool, budgets):
        """A tensor-parallel rank's decode: decode_layers' two halves of each layer in one call each (the
        same C++ functions), the row-parallel outputs all-reduced between them."""
        model, k = self.model, torch.ops.kvpage
        cfg, comm, one_order = model.config, model.comm, model.ops.policy.one_order
        ks, vs, kscales, vscales = caches
        mins, maxs = _bounds_lists(kv_caches)
        scale, eps, per = model.layers[0].self_attn.scale, cfg.rms_norm_eps, len(flat) // len(kv_caches)
        delta = None
        for i in range(len(kv_caches)):
            w = flat[i * per : (i + 1) * per]
            bounded = bool(mins) and mins[i].numel() > 0
            attn = k.decode_attention_part(
                x, delta, cos, sin, w, bits, bias[i] if bias else None, ks[i], vs[i],
                kscales[i] if kscales else None, vscales[i] if vscales else None, meta.block_tables, meta.seq_lens,
                meta.slot_mapping, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, eps, scale, kernel_linear,
                one_order, mins[i] if bounded else None, maxs[i] if bounded else None, budgets, SINK_BLOCKS,
                RECENT_BLOCKS,
            )  # fmt: skip
            comm.all_reduce(attn)
            delta = k.decode_mlp_part(x, attn, w, bits, eps, kernel_linear, one_order)
            comm.all_reduce(delta)
        return k.add_rms_norm(x, delta, model.norm.weight, eps)

    def _layer_weights(self):
        """Per layer: the two norms, then (weight, scales, mins) of qkv, o, gate_up, down; built once."""
        first = self.model.layers[0].self_attn.qkv_proj.weight
        if self._weights and self._weights[0][2] is not _tensor_of(first):
            self._weights = None  # the weights were replaced (quantized) since they were gathered
        if self._weights is None:
            flat, kinds, bias = [], set(), []
            none = torch.empty(0)
            for layer in self.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                flat += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
                for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                    w = lin.weight
                    if isinstance(w, QuantizedWeight):
                        flat += [w.q, w.scales, none if w.mins is None else w.mins]
                        kinds.add((w.bits, None))
                    else:
                        flat += [w, none, none]
                        kinds.add((0, w.dtype))
                if attn.qkv_proj.bias is not None:
                    bias.append(attn.qkv_proj.bias)
            ok = len(kinds) == 1 and len(bias) in (0, len(self.model.layers))
            self._weights = (flat, *kinds.pop(), bias) if ok else ()
        return self._weights or None


def _tensor_of(w):
    return w.q if isinstance(w, QuantizedWeight) else w


def _cache_lists(kv_caches: list[LayerKV], dtype: torch.dtype):
    """(k caches, v caches, k scales, v scales) as the kernels take them, or None for other caches."""
    first = kv_caches[0]
    kv_dtype, kdtype = first.kv_dtype, first.k.dtype
    if any(kv.kv_dtype != kv_dtype or kv.k.dtype != kdtype for kv in kv_caches):
        return None
    ks, vs = [kv.k for kv in kv_caches], [kv.v for kv in kv_caches]
    if kv_dtype == "int8":
        return ks, vs, [kv.k_scale for kv in kv_caches], [kv.v_scale for kv in kv_caches]
    return (ks, vs, [], []) if not first.quantized and kdtype == dtype else None


def _bounds_lists(kv_caches: list[LayerKV]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, its key bounds (an empty tensor where it keeps none), or two empty lists when no
    layer keeps any (attention/key_bounds.py: the kernel refreshes them and reads within a budget)."""
    if not any(kv.bounded for kv in kv_caches):
        return [], []
    none = torch.empty(0)
    return ([kv.k_min if kv.bounded else none for kv in kv_caches],
            [kv.k_max if kv.bounded else none for kv in kv_caches])  # fmt: skip


def step_forward(model):
    """What runs a step of `model` (input_ids, positions, kv caches, metadata -> hidden states): the
    fused path where it can ever apply, else the model itself. The model runner, the static-cache
    baseline and the forward-pass benchmark all run steps this way."""
    return FusedDecode(model).forward if FusedDecode.applies_to(model) else model
