"""kvpage's side of benchmarks/peers.py --openvino: one repeat of the offline workloads of
offline_workloads.py through `LLM.generate` (the same pool, batch limits and prefix caching as the
OpenVINO side), at the dtype asked; prints one JSON line.

    python kvpage_offline.py --dtype auto|bfloat16|float32 [--repeat R] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_workloads import KV_POOL_GIB, MAX_BATCHED_TOKENS, MAX_NUM_SEQS, measure  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeat", type=int, default=0)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    from kvpage import LLM, SamplingParams

    llm = LLM("smollm2", dtype=args.dtype, kv_cache_memory=f"{KV_POOL_GIB}GiB", max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_BATCHED_TOKENS, enable_prefix_caching=True)  # fmt: skip

    def run(reqs) -> float:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in reqs]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in reqs]
        return dt

    result = measure(run, args.repeat, args.only)
    engine = llm.llm_engine
    print(json.dumps({"result": result, "info": {"dtype": engine.dtype_name, "why": engine.dtype_reason}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
