"""The machine's limit (suite item 7): the model's linear layers alone, timed in the same run.

Every decode step multiplies each token's hidden state by every weight matrix (q/k/v, o, gate/up,
down in every layer, and the lm_head for the rows that sample). Timing exactly those matmuls, as the
model runs them (its own `ops.linear`, quantized weights too), at a batch size gives the tokens/s no
forward pass of that batch can beat on this machine; a throughput figure divided by it reads as a
fraction of what the machine allows.
"""

from __future__ import annotations

import statistics
import time

import torch


def median_time(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def linears_only(model, tokens: int, logit_rows: int):
    """A function running the model's linear layers over `tokens` rows (lm_head over `logit_rows`)."""
    cfg = model.config
    x = torch.randn(tokens, cfg.hidden_size, dtype=next(model.parameters()).dtype)
    linear = model.ops.linear

    @torch.inference_mode()
    def run():
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias)
            linear(x, attn.o_proj.weight)
            h = linear(x, mlp.gate_up_proj.weight)
            linear(h[:, : cfg.intermediate_size].contiguous(), mlp.down_proj.weight)
        model.compute_logits(x[:logit_rows])

    return run


def decode_bound(model, batch: int, repeat: int = 3) -> float:
    """Tokens/s of the linear layers alone for one decode step of `batch` sequences."""
    batch = max(1, int(round(batch)))
    return batch / median_time(linears_only(model, batch, batch), repeat)
