"""Models of the shapes users run, with random weights, as GGUF files both kvpage and llama-server read
(benchmarks/peers.py --model-shape): speed does not depend on the values, only on the shapes and the bytes
each step reads. The weights are kvpage's seeded dummies (`dummy_weights`) in bfloat16, saved as a Hugging
Face directory with SmolLM2's tokenizer, then converted by the `convert_hf_to_gguf.py` of the llama.cpp that
benchmarks/peers/build_llama_server.sh unpacked (the vocabulary padded to the shape's size), and Q4_1 made
by its `llama-quantize`. Built once into $KVPAGE_PEERS_DIR/shapes/ (a 1B model: ~2.5 GB for BF16).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# the real models' shapes (their config.json), the vocabulary included: the head is a fifth of a 1B model
SHAPES = {
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                         num_kv_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True),
    "qwen2.5-3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16,
                       num_kv_heads=2, head_dim=128, rope_theta=1000000.0, tie_word_embeddings=True,
                       attention_bias=True, architecture="qwen2"),
}  # fmt: skip


def shaped_gguf(shape: str, kind: str, bindir: Path, out_dir: Path) -> Path:
    """The GGUF of `shape` in `kind` ("BF16" or "Q4_1"), built if missing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    bf16 = out_dir / f"{shape}.BF16.gguf"
    if not bf16.exists():
        hf = _hf_dir(shape, out_dir / f"{shape}-hf")
        converter = bindir.parent.parent / "convert_hf_to_gguf.py"
        tmp = bf16.with_suffix(".tmp")
        subprocess.run([sys.executable, str(converter), str(hf), "--outtype", "bf16", "--outfile", str(tmp)],
                       check=True, capture_output=True)  # fmt: skip
        tmp.rename(bf16)
    if kind == "BF16":
        return bf16
    out = out_dir / f"{shape}.{kind}.gguf"
    if not out.exists():
        subprocess.run([str(bindir / "llama-quantize"), str(bf16), str(out), kind], check=True, capture_output=True)
    return out


def _hf_dir(shape: str, path: Path) -> Path:
    import json

    import torch
    from safetensors.torch import save_file

    from kvpage.models.config import ModelConfig
    from kvpage.models.loader import dummy_weights, load_model

    if (path / "model.safetensors").exists():
        return path
    fields = dict(SHAPES[shape])
    cfg = ModelConfig(max_position_embeddings=32768, bos_token_id=1, eos_token_ids=[2], **fields)
    path.mkdir(parents=True, exist_ok=True)
    weights = {n: t.to(torch.bfloat16).contiguous() for n, t in dummy_weights(cfg, seed=0).items()}
    save_file(weights, str(path / "model.safetensors"))
    hf = cfg.to_hf()
    hf["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(hf, indent=1))
    load_model("smollm2", dtype="float32").tokenizer.save(path)
    return path
