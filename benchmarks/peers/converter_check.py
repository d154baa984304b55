"""Reads llama.cpp's own GGUF files of the families whose layout kvpage's loader reconstructs (Gemma 2, Gemma 3,
Bamba): tiny random models saved by transformers are converted by the `convert_hf_to_gguf.py` that llama-cpp-python's
sdist vendors, loaded by kvpage from both the directory and the GGUF, and compared: config fields and every tensor
(bit for bit, but Bamba's A_log, which llama.cpp stores as -exp(A_log): within an ulp of A). The suite's GGUF writer
(tests/models/tiny_gguf.py) is checked against the same files: the same tensors and model metadata.

    python benchmarks/peers/converter_check.py [--version 0.3.36]

Downloads the sdist (~77 MB) once into $KVPAGE_PEERS_DIR (default ~/.cache/kvpage/peers); needs no build.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def vendored_llama_cpp(version: str) -> Path:
    """The llama.cpp source that llama-cpp-python `version`'s sdist vendors (downloaded once)."""
    base = Path(os.environ.get("KVPAGE_PEERS_DIR") or Path.home() / ".cache" / "kvpage" / "peers")
    src = base / f"llama.cpp-{version}"
    if not (src / "convert_hf_to_gguf.py").exists():
        base.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                            "llama-cpp-python", "-d", tmp, f"llama-cpp-python=={version}"], check=True)  # fmt: skip
            with tarfile.open(Path(tmp) / f"llama_cpp_python-{version}.tar.gz") as tar:
                tar.extractall(tmp, filter="data")
            (Path(tmp) / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp").rename(src)
    return src


def save_tiny(family: str, out: Path) -> None:
    """A tiny random model of `family` (norms, biases and Mamba's constants drawn too), with a SentencePiece
    tokenizer.model and a tokenizer_config.json naming its special tokens."""
    import transformers

    from tests.models.tiny_gguf import SPECIALS, sentencepiece_vocab

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  initializer_range=0.2)  # fmt: skip
    if family == "gemma2":
        cfg = transformers.Gemma2Config(**common, head_dim=16, num_hidden_layers=2, sliding_window=8,
                                        query_pre_attn_scalar=16, attn_logit_softcapping=1.5,
                                        final_logit_softcapping=3.0)  # fmt: skip
    elif family == "gemma3":
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
        cfg = transformers.Gemma3TextConfig(**common, head_dim=16, num_hidden_layers=6, sliding_window=8,
                                            query_pre_attn_scalar=16, rope_parameters=rope)  # fmt: skip
    else:
        cfg = transformers.BambaConfig(**common, num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_n_heads=4,
                                       mamba_n_groups=2, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2)  # fmt: skip
    torch.manual_seed(0)
    model = {"gemma2": transformers.Gemma2ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM,
             "bamba": transformers.BambaForCausalLM}[family](cfg)  # fmt: skip
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("norm.weight", "dt_bias", "D", "A_log", "conv1d.bias")):
                p.normal_(0.0, 0.3)
    model.save_pretrained(out)
    if family == "bamba":  # (transformers 5 writes no attn_rotary_emb; a real Bamba's config has it)
        hf = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(hf | {"attn_rotary_emb": 8}))
    (out / "tokenizer.model").write_bytes(sentencepiece_vocab(512)[3])
    special = {"special": True, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    decoder = {str(i): {"content": t, **special} for i, t in enumerate(SPECIALS)}
    (out / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder, "bos_token": "<bos>",
                                                           "eos_token": "<eos>", "add_bos_token": True}))  # fmt: skip


def compare(family: str, hf_dir: Path, gguf: Path) -> list[str]:
    """What differs between the model loaded from the directory and from llama.cpp's GGUF of it."""
    from gguf import GGUFReader

    from kvpage.models import load_model
    from kvpage.models.gguf_loader import _metadata
    from tests.models.tiny_gguf import write_gguf_of

    ours = load_model(str(hf_dir), dtype="float32")
    theirs = load_model(str(gguf), dtype="float32", use_cache=False)
    fields = ("architecture", "layer_types", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
              "query_pre_attn_scalar", "qk_norm", "embed_scale", "rope_theta", "local_rope_theta", "rope_scaling",
              "tie_word_embeddings", "vocab_size", "rotary_dim", "mamba", "num_kv_heads", "head_dim")  # fmt: skip
    out = [f"config {f}: {getattr(ours.config, f)} != {getattr(theirs.config, f)}" for f in fields
           if getattr(ours.config, f) != getattr(theirs.config, f)]  # fmt: skip
    a, b = dict(ours.model.named_parameters()), dict(theirs.model.named_parameters())
    out += [f"parameter {n} missing" for n in set(a) ^ set(b)]
    for n in set(a) & set(b):
        if n.endswith("A_log"):  # (-exp(A_log) in the file: A within an ulp)
            if not torch.allclose(-torch.exp(a[n]), -torch.exp(b[n]), rtol=2.5e-7, atol=0):
                out.append(f"parameter {n}: A differs by more than an ulp")
        elif not torch.equal(a[n], b[n]):
            out.append(f"parameter {n}: max |diff| {(a[n] - b[n]).abs().max().item():.3g}")
    mine = gguf.with_suffix(".kvpage.gguf")
    write_gguf_of(hf_dir, mine)
    ra, rb = GGUFReader(str(gguf)), GGUFReader(str(mine))
    ta, tb = {t.name: np.asarray(t.data) for t in ra.tensors}, {t.name: np.asarray(t.data) for t in rb.tensors}
    out += [f"test writer: tensor {n} differs" for n in ta if n not in tb or not np.array_equal(ta[n], tb[n])]
    ma, mb = _metadata(ra), _metadata(rb)
    keys = {k for k in ma if k.split(".")[0] not in ("general", "tokenizer")}
    out += [f"test writer: {k} {ma[k]} != {mb.get(k)}" for k in sorted(keys) if ma[k] != mb.get(k)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.3.36")
    args = ap.parse_args()
    src = vendored_llama_cpp(args.version)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("gemma2", "gemma3", "bamba"):
            hf_dir, gguf = Path(tmp) / family, Path(tmp) / f"{family}.gguf"
            save_tiny(family, hf_dir)
            env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
            subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(gguf),
                            "--outtype", "f32"], check=True, env=env, capture_output=True)  # fmt: skip
            diffs = compare(family, hf_dir, gguf)
            print(f"{family}: {'the same model' if not diffs else 'DIFFERS'} (llama.cpp {args.version}'s converter)")
            for d in diffs:
                print("   ", d)
            failed |= bool(diffs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
