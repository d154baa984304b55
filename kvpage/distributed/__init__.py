"""Tensor parallelism over torch.distributed (gloo on CPU, nccl on CUDA), Megatron-style.

    shard.py      which slice of every weight a rank holds, and the model config it runs (torch-free math)
    group.py      the process group: all-reduce (timed), broadcast of plain data, min over ranks
    launch.py     where the ranks come from: spawned here, or launched per rank (torchrun, --master-addr)
    rank_runner.py  rank 0's runner (broadcast the step, then run its own shard) and the other ranks' loop

Rank 0 owns the tokenizer, the scheduler and the one KV-cache manager; every step it broadcasts the
`SchedulerOutput` and every rank executes it on its own shard of the heads, so block ids and every
decision are the same on all ranks by construction.
"""
