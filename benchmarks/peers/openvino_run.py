"""OpenVINO GenAI's side of benchmarks/peers.py --openvino, run with the python of
benchmarks/peers/openvino_env.sh: exports SmolLM2 (the GGUF kvpage reads, de-quantized by
transformers) with optimum-intel once, then times one repeat of the offline workloads of
offline_workloads.py with its continuous-batching pipeline (paged attention, prefix caching) at the
precision asked (inference and KV cache alike), and prints one JSON line.

    python openvino_run.py --gguf PATH --precision bf16|f32 --out-dir DIR [--repeat R] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_workloads import KV_POOL_GIB, MAX_BATCHED_TOKENS, MAX_NUM_SEQS, measure  # noqa: E402


def export(gguf: Path, out: Path) -> Path:
    """The model as OpenVINO IR (float32 weights: the precision is chosen when it is compiled)."""
    ir = out / "openvino-f32"
    if (ir / "openvino_model.xml").exists():
        return ir
    import torch
    import transformers
    from optimum.exporters.openvino import main_export

    hf = out / "hf-f32"
    if not (hf / "config.json").exists():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                  dtype=torch.float32)  # fmt: skip
        model.save_pretrained(hf)
        transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(hf)
    main_export(str(hf), output=str(ir), task="text-generation-with-past", weight_format="fp32")
    return ir


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--precision", choices=["bf16", "f32"], required=True)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=0, help="which repeat's prompts (offline_workloads.workloads)")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    ir = export(args.gguf, args.out_dir)
    sched = og.SchedulerConfig()
    sched.cache_size = KV_POOL_GIB
    sched.max_num_seqs = MAX_NUM_SEQS
    sched.max_num_batched_tokens = MAX_BATCHED_TOKENS
    sched.enable_prefix_caching = True
    sched.dynamic_split_fuse = True
    props = {"INFERENCE_PRECISION_HINT": args.precision, "KV_CACHE_PRECISION": args.precision}
    pipe = og.ContinuousBatchingPipeline(str(ir), sched, "CPU", props)

    def run(reqs) -> float:
        ids = [ov.Tensor(np.array([p], dtype=np.int64)) for p, _ in reqs]
        cfgs = []
        for _, n in reqs:
            c = og.GenerationConfig()
            c.max_new_tokens, c.min_new_tokens, c.ignore_eos, c.do_sample = n, n, True, False
            cfgs.append(c)
        t0 = time.perf_counter()
        outs = pipe.generate(ids, cfgs)
        dt = time.perf_counter() - t0
        got = [len(o.m_generation_ids[0]) for o in outs]
        assert got == [n for _, n in reqs], (got, [n for _, n in reqs])
        return dt

    result = measure(run, args.repeat, args.only)
    info = {"openvino": ov.__version__, "openvino_genai": og.__version__, "precision": args.precision}
    print(json.dumps({"result": result, "info": info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
