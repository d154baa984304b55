"""Writes small, real GGUF files (through the gguf library's writer) for loader tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import quantize

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
K_QUANTS = {Q.Q2_K: 84, Q.Q3_K: 110, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}  # bytes per 256 values


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


TOKENS = [*byte_alphabet(), "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKEN_TYPES = [1] * 257 + [3, 3, 3]  # 1 normal, 3 control
VOCAB = len(TOKENS)
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q and k rows (the inverse of the loader's unpermute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16)
    if qtype in K_QUANTS:  # the library cannot quantize these; any small bytes are a valid block
        return rng.integers(0, 0x20, size=(w.shape[0], w.shape[1] // 256 * K_QUANTS[qtype]), dtype=np.uint8)
    return quantize(w, qtype)


def write_tiny_llama(path: Path, types: dict[str, Q], *, tied: bool = False, seed: int = 0) -> None:
    """A 2-layer LLaMA of hidden size 256; `types` maps GGUF tensor names to their storage type."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(["h e"])
    w.add_bos_token_id(VOCAB - 2)
    w.add_eos_token_id(VOCAB - 1)
    w.add_chat_template(TEMPLATE)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        t = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        if name.endswith("attn_q.weight"):
            t = permute_qk(t, HEADS)
        elif name.endswith("attn_k.weight"):
            t = permute_qk(t, KV_HEADS)
        qtype = types.get(name, Q.F32)
        data = _encode(t, qtype, rng)
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf_of(hf_dir: Path, path: Path) -> None:
    """The Hugging Face model saved in `hf_dir` (config.json, model.safetensors) as llama.cpp's converter
    writes it: llama.cpp's tensor names and metadata keys for its architecture, float32 tensors, q and k
    rows permuted for LLaMA, and a byte-level vocabulary of the model's size."""
    import json

    from safetensors.numpy import load_file

    from kvpage.models.gguf_loader import _GLOBAL_NAMES, _LAYER_NAMES

    hf = json.loads((hf_dir / "config.json").read_text())
    arch = hf["model_type"]
    assert arch in ("llama", "qwen2", "qwen3", "phi3"), arch
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    kv_heads = hf.get("num_key_value_heads") or heads
    w = GGUFWriter(str(path), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(hf.get("head_dim") or hidden // heads)
    w.add_value_length(hf.get("head_dim") or hidden // heads)
    rope = hf.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if arch == "phi3" and hf.get("sliding_window"):
        w.add_sliding_window(hf["sliding_window"])
    w.add_vocab_size(hf["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(byte_alphabet()[: hf["vocab_size"]])
    w.add_token_types([1] * hf["vocab_size"])
    w.add_token_merges([])
    w.add_eos_token_id(hf["vocab_size"] - 1)
    to_gguf = {v: k for k, v in _GLOBAL_NAMES.items()}
    layer_parts = {v: k for k, v in _LAYER_NAMES.items()} | {"mlp.gate_up_proj": "ffn_up"}  # (Phi-3's fused)
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if name in to_gguf:
            out = to_gguf[name]
        else:  # model.layers.N.<part>.<weight|bias>
            _, _, i, *part, kind = name.split(".")
            out = f"blk.{i}.{layer_parts['.'.join(part)]}.{kind}"
        t = t.astype(np.float32)
        if arch == "llama" and ".attn_q." in out:
            t = permute_qk(t, heads)
        elif arch == "llama" and ".attn_k." in out:
            t = permute_qk(t, kv_heads)
        w.add_tensor(out, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
