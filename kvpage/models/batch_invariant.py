"""Deterministic mode: a model whose every token and logprob are the same bits whatever the batch.

A request's numbers change with its company when a reduction's order depends on the step: torch's
GEMM chooses its blocking (and so its order of additions) by the number of rows, a prefill chunk
attends by SDPA over fresh K/V in one order while a decode of the same query reads the cache in
another, and the chunk size decides which queries take which path. kvpage owns its kernels, so
deterministic mode takes those choices away rather than seeding around them:

    linears     every row through the row kernels (LinearPolicy.batch_invariant): each output is one
                float32 accumulator running over K in a fixed order, however many rows share the call
    attention   every query of every prefill chunk as a decode of its own length, through the block
                table after the write: the same keys in the same blocks, the same online-softmax
                steps, whether the query decodes, sits in a chunk of 16 or 2048, or follows a prefix hit
    the rest    row-wise already (norms, RoPE, SiLU, the logits' log-softmax and sampling)

Then a prefix hit serves exactly the K/V a miss would compute, a recompute after preemption rebuilds
the same blocks, and a swapped block comes back as it left. The cost is the speed torch's GEMM and
SDPA have on long prefills and large batches (benchmarks/determinism.py measures it).
"""

from __future__ import annotations

from kvpage.models.layer_ops import KernelLayerOps, LinearPolicy
from kvpage.ops import KERNEL_DTYPES


def make_batch_invariant(model) -> None:
    """Switch a loaded model (a LlamaForCausalLM) to the batch-invariant kernels, or say why it cannot."""
    backend, ops = model.attention_backend, model.ops
    if backend.name != "cpu" or not isinstance(ops, KernelLayerOps):
        raise ValueError(
            f"deterministic=True runs on kvpage's compiled CPU kernels (attention_backend 'cpu'); this model "
            f"has the {backend.name!r} backend"
        )
    dtype = next(model.parameters()).dtype
    if dtype not in KERNEL_DTYPES:
        names = " or ".join(str(d).removeprefix("torch.") for d in KERNEL_DTYPES)
        raise ValueError(f"deterministic=True needs dtype {names}, got {str(dtype).removeprefix('torch.')}")
    ops.policy = LinearPolicy.batch_invariant()
    backend.decode_chunks_up_to = None
