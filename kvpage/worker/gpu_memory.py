"""How much of a GPU the KV pool takes: vLLM's rule, `gpu_memory_utilization` of the device's memory.

    budget = utilization x total  -  memory other processes hold  -  this process's peak
             (the weights plus the activations of a profiling forward of the largest step)

The profiling forward runs max_num_batched_tokens tokens as one prefill through the model on a
scratch cache just big enough for them (not counted: the pool will hold those tokens), with the
logits of a full step's rows and a softmax and sort of them as sampling does, so the peak is what
the largest step the scheduler may send needs; the KV pool is then sized into what is left. Unlike
vLLM v1, memory other processes hold is subtracted: two engines on one GPU share its memory.
"""

from __future__ import annotations

import torch

from kvpage.core.block import cdiv


def kv_cache_budget(total: int, used_elsewhere: int, peak: int, utilization: float) -> int:
    """Bytes the KV pool may take (see the module docstring); ValueError when nothing is left."""
    budget = int(total * utilization) - used_elsewhere - peak
    if budget <= 0:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no memory for the KV cache: "
            f"{total * utilization / gib:.2f} GiB allowed, {used_elsewhere / gib:.2f} GiB held by other "
            f"processes, {peak / gib:.2f} GiB needed by the model's weights and largest step; raise it or "
            "lower max_num_batched_tokens"
        )
    return budget


@torch.inference_mode()
def profile_kv_budget(model, cfg, device, dtype, block_size: int, max_tokens: int, max_seqs: int,
                      kv_cache_dtype: str, utilization: float) -> tuple[int, str]:  # fmt: skip
    """(bytes for the KV pool, a line saying how they were found) after one profiling forward."""
    from kvpage.attention.metadata import AttentionMetadata
    from kvpage.worker.kv_cache import KVCache

    device = torch.device(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    blocks = cdiv(max_tokens, block_size)
    scratch = KVCache(cfg, blocks, block_size, dtype, device, kv_cache_dtype=kv_cache_dtype,
                      backend=model.attention_backend)  # fmt: skip
    meta = AttentionMetadata.build([max_tokens], [max_tokens], [list(range(blocks))], block_size, device)
    ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
    hidden = model(ids, torch.arange(max_tokens, device=device), scratch.layers, meta)
    logits = model.compute_logits(hidden[: min(max_seqs, max_tokens)]).float()  # a full step's logit rows,
    torch.softmax(logits, dim=-1).sort(dim=-1)  # and what sampling them allocates (top-p sorts)
    torch.cuda.synchronize(device)
    scratch_bytes = sum(t.numel() * t.element_size() for layer in scratch.layers for t in layer.tensors())
    peak = torch.cuda.max_memory_allocated(device) - scratch_bytes  # the scratch cache is the pool's to be
    del scratch, hidden, logits
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_elsewhere = max(0, total - free - torch.cuda.memory_reserved(device))  # other processes + CUDA context
    budget = kv_cache_budget(total, used_elsewhere, peak, utilization)
    note = (f"KV pool {budget / 2**30:.2f} GiB: {utilization:.0%} of {total / 2**30:.1f} GiB, less "
            f"{used_elsewhere / 2**30:.2f} GiB outside torch's allocator (other processes, CUDA context) and "
            f"{peak / 2**30:.2f} GiB peak of a "
            f"{max_tokens}-token profiling step")  # fmt: skip
    return budget, note
