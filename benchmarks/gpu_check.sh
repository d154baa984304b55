#!/usr/bin/env bash
# The GPU path in one go, on a machine with an NVIDIA GPU (under ten minutes on one H200):
#   1. the attention tests on CUDA tensors, compiled Triton kernels (not the interpreter), and the
#      tests marked `gpu` (the engine on CUDA: greedy equal to the CPU reference in float32)
#   2. the kernel benchmark: effective HBM bandwidth of paged decode attention, batch 1-256 x
#      context 512-8k, as a fraction of the device's peak (benchmarks/gpu_kernels.py)
#   3. end-to-end: 256 requests through kvpage on CUDA against transformers' batched generate on
#      the same GPU in the same run (benchmarks/throughput.py --device cuda)
# Results land in benchmarks/results/ and benchmarks/RESULTS.md like every benchmark's.
#
#   benchmarks/gpu_check.sh            (after `make install`; set PY to use another interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), 'triton', triton.__version__)"
export TRITON_INTERPRET=0
echo "== 1. tests on CUDA"
timeout 240 "$PY" -m pytest -q -x tests/attention/test_triton_backend.py tests/engine/test_gpu.py
echo "== 2. kernel bandwidth"
timeout 180 "$PY" benchmarks/gpu_kernels.py
echo "== 3. end to end against transformers on the same GPU"
timeout 240 "$PY" benchmarks/throughput.py --device cuda --dtype bfloat16 --hf-attn sdpa --hf-batch 64
