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


LLAMA_CPP_ARCH = {"qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "llama4_text": "llama4", "gemma3_text": "gemma3",
                  "bamba": "granitehybrid"}  # fmt: skip
GEMMA = ("gemma2", "gemma3_text")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]  # Gemma's first ids, in order


def sentencepiece_vocab(size: int, space_prefix: bool = False) -> tuple[list[str], list[float], list[int], bytes]:
    """A real SentencePiece BPE vocabulary of `size` pieces, trained by the sentencepiece library on this
    repository's documentation as Gemma's was set up (byte fallback, digits split, no normalization, spaces
    kept; `space_prefix`: SentencePiece's dummy prefix, as Llama 2's): pieces, scores and types as llama.cpp's
    converter reads them, and the model itself (for sentencepiece's own encoder)."""
    import io

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    root = Path(__file__).resolve().parents[2]
    text = "\n".join(f.read_text() for f in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in text.splitlines() if line.strip()]), model_writer=buf,
        model_type="bpe", vocab_size=size, byte_fallback=True, split_digits=True, add_dummy_prefix=space_prefix,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        character_coverage=1.0, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece=SPECIALS[0], eos_piece=SPECIALS[1],
        bos_piece=SPECIALS[2], unk_piece=SPECIALS[3], user_defined_symbols=SPECIALS[4:],
        num_threads=1, minloglevel=2,
    )  # fmt: skip
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(buf.getvalue())
    pieces = list(proto.pieces)
    return [p.piece for p in pieces], [p.score for p in pieces], [int(p.type) for p in pieces], buf.getvalue()


def _add_sentencepiece_vocab(w: GGUFWriter, size: int) -> None:
    """Gemma's kind of vocabulary, as llama.cpp's converter writes it (checked against its output for a Gemma
    directory with this tokenizer.model, special tokens named special in tokenizer_config.json): SentencePiece
    pieces, scores and types, the specials CONTROL scored -1000, no space prefix, <bos> 2, <eos> 1, <end_of_turn>
    found by its text. A real vocabulary where the model's is big enough to hold the 256 byte pieces; else the
    specials and single characters."""
    if size >= 320:
        tokens, scores, types, _ = sentencepiece_vocab(size)
        scores[:6], types[:6] = [-1000.0] * 6, [3] * 6
    else:
        chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
        tokens = (SPECIALS + ["\u2581", *chars])[:size]
        tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
        scores = [-float(i) for i in range(size)]
        types = [3, 3, 3, 2, 3, 3] + [1] * (size - 6)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(False)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(GEMMA_TEMPLATE)


def rope_factors(hf: dict) -> np.ndarray | None:
    """llama.cpp's `rope_freqs` for a llama3-scaled RoPE: each frequency's divisor, as its converter works
    them out (1 above the high-frequency wavelength, the factor below the low one, smoothed between)."""
    import math

    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type") != "llama3":
        return None
    dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _experts(tensors: dict[str, np.ndarray], arch: str) -> dict[str, np.ndarray]:
    """A mixture's tensors as llama.cpp's converter writes them: each projection of every expert stacked,
    [E, out, in] (`mlp.experts.gate_proj` / `up_proj` / `down_proj`, biases `..._bias`), gate and up apart;
    Qwen3-MoE's per-expert tensors stacked, gpt-oss's [E, in, out] tensors transposed and its interleaved
    gate/up pairs split."""
    out, per_expert = {}, {}
    for name, t in tensors.items():
        parts = name.split(".")
        if ".mlp.experts." in name and parts[5].isdigit():  # model.layers.N.mlp.experts.E.<proj>.weight
            per_expert.setdefault((parts[2], parts[6]), {})[int(parts[5])] = t
        elif arch == "gpt_oss" and name.endswith("experts.gate_up_proj"):
            t = t.transpose(0, 2, 1)
            base = name.removesuffix("gate_up_proj")
            out[base + "gate_proj"], out[base + "up_proj"] = t[:, 0::2], t[:, 1::2]
        elif arch == "gpt_oss" and name.endswith("experts.gate_up_proj_bias"):
            base = name.removesuffix("gate_up_proj_bias")
            out[base + "gate_proj_bias"], out[base + "up_proj_bias"] = t[:, 0::2], t[:, 1::2]
        elif arch == "gpt_oss" and name.endswith("experts.down_proj"):
            out[name] = t.transpose(0, 2, 1)
        elif arch == "llama4_text" and ".feed_forward." in name:  # (its stacked experts [E, in, out], gate | up)
            name = name.replace(".feed_forward.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
            if name.endswith("experts.gate_up_proj"):
                t = t.transpose(0, 2, 1)
                half = t.shape[1] // 2
                base = name.removesuffix("gate_up_proj")
                out[base + "gate_proj"], out[base + "up_proj"] = t[:, :half], t[:, half:]
            else:
                out[name] = t.transpose(0, 2, 1) if name.endswith("experts.down_proj") else t
        else:
            out[name] = t
    for (layer, proj), by_expert in per_expert.items():
        out[f"model.layers.{layer}.mlp.experts.{proj}"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _bamba_keys(w: GGUFWriter, hf: dict) -> None:
    """Bamba's keys as llama.cpp's converter writes its granitehybrid: KV heads per layer (0 on the Mamba layers),
    the RoPE'd width of a head, the mixer's sizes (its heads as the time-step rank), RoPE on."""
    n, heads, hidden = hf["num_hidden_layers"], hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or hidden // heads
    attn = set(hf["attn_layer_indices"])
    w.add_head_count_kv([hf["num_key_value_heads"] if i in attn else 0 for i in range(n)])
    w.add_rope_dimension_count(int(head_dim * (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5)))
    w.add_ssm_conv_kernel(hf["mamba_d_conv"])
    w.add_ssm_state_size(hf["mamba_d_state"])
    w.add_ssm_group_count(hf["mamba_n_groups"])
    w.add_ssm_inner_size(hf["mamba_expand"] * hidden)
    w.add_ssm_time_step_rank(hf["mamba_n_heads"])
    w.add_rope_scaling_finetuned(True)


def _bamba_tensor(name: str, t: np.ndarray, groups: int) -> tuple[str, np.ndarray]:
    """A Bamba checkpoint tensor as llama.cpp's converter writes it: LLaMA's names for the MLP and norms, the
    mixer's as its ssm_* tensors, A as -exp(A_log), D and the norm as rows, the convolution [channels, taps]."""
    import torch

    from kvpage.models.loader import RENAMES

    for a, b in RENAMES["bamba"]:
        name = name.replace(a, b)
    if ".mamba." not in name:
        return name, t
    i, part = name.split(".")[2], name.split(".mamba.")[1]
    if part == "A_log":  # (as the converter computes it: in torch)
        return f"blk.{i}.ssm_a", -torch.exp(torch.from_numpy(t).float()).numpy().reshape(-1, 1)
    if part in ("D", "dt_bias"):
        return (f"blk.{i}.ssm_d", t.reshape(-1, 1)) if part == "D" else (f"blk.{i}.ssm_dt.bias", t)
    if part == "conv1d.weight":
        return f"blk.{i}.ssm_conv1d.weight", t.reshape(t.shape[0], t.shape[-1])
    if part == "norm.weight":  # (the inner width in its groups)
        return f"blk.{i}.ssm_norm.weight", t.reshape(groups, -1)
    module, kind = part.split(".")
    return f"blk.{i}.{dict(conv1d='ssm_conv1d', in_proj='ssm_in', out_proj='ssm_out')[module]}.{kind}", t


def write_gguf_of(hf_dir: Path, path: Path, expert_type: Q = Q.F32) -> None:
    """The Hugging Face model saved in `hf_dir` (config.json, model.safetensors) as llama.cpp's converter
    writes it: llama.cpp's tensor names and metadata keys for its architecture, float32 tensors (a mixture's
    expert matrices in `expert_type`: gpt-oss's GGUFs hold them in MXFP4), q and k rows permuted for LLaMA,
    Gemma's norms plus 1, and a vocabulary of the model's size (byte-level; SentencePiece's for Gemma)."""
    import json

    from safetensors.numpy import load_file

    from kvpage.models.gguf_loader import _ARCH_LAYER_NAMES, _GLOBAL_NAMES, _LAYER_NAMES

    hf = json.loads((hf_dir / "config.json").read_text())
    arch = hf["model_type"]
    assert arch in ("llama", "qwen2", "qwen3", "phi3", "qwen3_moe", "gpt_oss", "smollm3", "cohere2", "llama4_text",
                    "bamba", *GEMMA), arch  # fmt: skip
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    kv_heads = hf.get("num_key_value_heads") or heads
    w = GGUFWriter(str(path), LLAMA_CPP_ARCH.get(arch, arch))
    if arch == "bamba":
        _bamba_keys(w, hf)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hf.get("intermediate_size_mlp") or hf["intermediate_size"])
    w.add_head_count(heads)
    if arch != "bamba":  # (a list per layer there)
        w.add_head_count_kv(kv_heads)
        w.add_key_length(hf.get("head_dim") or hidden // heads)
        w.add_value_length(hf.get("head_dim") or hidden // heads)
    rope = hf.get("rope_parameters") or {}
    local = rope.get("sliding_attention")  # (Gemma 3's: the global layers' RoPE, and the local layers' base)
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0))
    if local is not None:
        w.add_rope_freq_base_swa(float(local["rope_theta"]))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "cohere2":  # (a LayerNorm's epsilon, its logit scale)
        w.add_layer_norm_eps(hf["layer_norm_eps"])
        w.add_logit_scale(hf["logit_scale"])
    else:
        w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if arch in ("phi3", "gpt_oss", "cohere2", *GEMMA) and hf.get("sliding_window"):
        w.add_sliding_window(hf["sliding_window"])
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if arch in GEMMA and hf.get(cap):
            getattr(w, f"add_{cap}")(hf[cap])
    if arch == "llama4_text":
        w.add_interleave_moe_layer_step(hf["interleave_moe_layer_step"])
    if arch in ("qwen3_moe", "gpt_oss", "llama4_text"):
        w.add_expert_count(hf.get("num_experts") or hf["num_local_experts"])
        w.add_expert_used_count(hf["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    if arch not in GEMMA:  # (its converter writes no vocabulary size: the token list's)
        w.add_vocab_size(hf["vocab_size"])
    if arch in GEMMA:
        _add_sentencepiece_vocab(w, hf["vocab_size"])
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(byte_alphabet()[: hf["vocab_size"]])
        w.add_token_types([1] * hf["vocab_size"])
        w.add_token_merges([])
        w.add_eos_token_id(hf["vocab_size"] - 1)
    to_gguf = {v: k for k, v in _GLOBAL_NAMES.items()}
    layer_parts = {v: k for k, v in (_LAYER_NAMES | _ARCH_LAYER_NAMES.get(arch, {})).items()}
    layer_parts |= {"mlp.gate_up_proj": "ffn_up", "mlp.router": "ffn_gate_inp"}  # (Phi-3's fused; gpt-oss's router)
    for name, t in _experts(load_file(str(hf_dir / "model.safetensors")), arch).items():
        if arch == "bamba":
            name, t = _bamba_tensor(name, t, hf["mamba_n_groups"])
        if name.startswith("blk."):  # (named as llama.cpp names it already)
            out = name
        elif name in to_gguf:
            out = to_gguf[name]
        elif name.endswith(".sinks"):  # model.layers.N.self_attn.sinks
            out = f"blk.{name.split('.')[2]}.attn_sinks.weight"
        else:  # model.layers.N.<part>.<weight|bias>, or a stacked expert tensor: model.layers.N.<part>[_bias]
            _, _, i, *part = name.split(".")
            kind = "bias" if part[-1].endswith("_bias") else "weight"
            if part[-1] in ("weight", "bias"):
                kind = part.pop()
            part[-1] = part[-1].removesuffix("_bias")
            out = f"blk.{i}.{layer_parts['.'.join(part)]}.{kind}"
        t = t.astype(np.float32)
        if arch in GEMMA and out.endswith("norm.weight"):  # (its norms multiply by 1 + w: llama.cpp's by the weight)
            t = t + np.float32(1.0)
        if arch in ("llama", "smollm3", "bamba") and ".attn_q." in out:
            t = permute_qk(t, heads)
        elif arch in ("llama", "smollm3", "bamba") and ".attn_k." in out:
            t = permute_qk(t, kv_heads)
        if out.endswith("_exps.weight") and expert_type != Q.F32:
            w.add_tensor(out, quantize(np.ascontiguousarray(t), expert_type), raw_dtype=expert_type)
            continue
        w.add_tensor(out, np.ascontiguousarray(t))
    factors = rope_factors(hf)
    if factors is not None:
        w.add_tensor("rope_freqs.weight", factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
