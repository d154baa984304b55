"""Mamba-2's mixer (Bamba's state-space layers) over the paged cache, the plain torch way.

A state-space layer keeps, per sequence, a fixed-size state instead of keys: the last `conv_kernel - 1`
inputs of its causal convolution and the SSM state [heads, head_dim, state_size]. Its KV-cache group's
spec is core/kv_spec.py's RecurrentState: block i of the sequence's table holds the state after the last
token written into block i. A step reads the state from the block of the token before its first
(zeros for a sequence's first token), runs its tokens through the recurrence one at a time

    h <- exp(dt A) h + dt B x^T,        y = C h + D x          (per head; dt = softplus(dt + dt_bias))

and writes the state after each token that ends a block into that block (the snapshot a prefix hit
resumes from) and after its last token into the last one. The state sits in the block's page as
float32 bytes, the SSM state in K's and the convolution's in V's (`state_views`): a block move (a
copy-on-write fork, a swap) moves it as it moves KV, and a page must be large enough to hold it
(`KVCache` refuses a block size too small, naming the smallest that fits).

transformers scans a prefill in chunks (state space duality); one token at a time gives the same
recurrence, to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.attention import AttentionMetadata, LayerKV
from kvpage.models.config import Mamba, ModelConfig


def state_views(kv: LayerKV, block: int, m: Mamba) -> tuple[torch.Tensor, torch.Tensor]:
    """(SSM state [heads, head_dim, state_size], conv state [conv_kernel - 1, conv_dim]) of `block`,
    float32 views into its page's K and V bytes."""
    ssm = kv.k[block].reshape(-1).view(torch.float32)[: m.ssm_numel]
    conv = kv.v[block].reshape(-1).view(torch.float32)[: m.conv_numel]
    return ssm.view(m.num_heads, m.head_dim, m.state_size), conv.view(m.conv_kernel - 1, m.conv_dim)


def fits(m: Mamba, page_numel: int, element_size: int) -> bool:
    """Whether a page of `page_numel` elements of `element_size` bytes in K (and in V) holds the state."""
    floats = page_numel * element_size // 4
    return m.ssm_numel <= floats and m.conv_numel <= floats


class GatedRMSNorm(nn.Module):
    """Mamba-2's norm: y * silu(gate), RMS-normalized over groups of `group_size`, times the weight."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(y.dtype)


class MambaMixer(nn.Module):
    """The token mixer of a state-space layer: in_proj -> (gate, x B C, dt); a causal depthwise
    convolution (SiLU) over x B C; the selective scan; the gated norm; out_proj. Called as attention is,
    (hidden, cos, sin, kv, meta); it reads no positions."""

    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        m = cfg.mamba
        assert m is not None
        self.m, self.ops = m, ops
        self.in_proj = nn.Linear(cfg.hidden_size, m.intermediate_size + m.conv_dim + m.num_heads, bias=m.proj_bias)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(m.conv_dim, 1, m.conv_kernel))
        self.conv1d.bias = nn.Parameter(torch.empty(m.conv_dim)) if m.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads))
        self.A_log = nn.Parameter(torch.empty(m.num_heads))
        self.D = nn.Parameter(torch.empty(m.num_heads))
        self.norm = GatedRMSNorm(m.intermediate_size, m.intermediate_size // m.num_groups, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(m.intermediate_size, cfg.hidden_size, bias=m.proj_bias)

    def forward(self, x, cos, sin, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        m = self.m
        proj = self.ops.linear(x, self.in_proj.weight, self.in_proj.bias)
        gate, xbc, dt = proj.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        y = torch.empty(x.shape[0], m.intermediate_size, dtype=torch.float32, device=x.device)
        for i in range(meta.num_seqs):
            s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            y[s:e] = self._sequence(xbc[s:e], dt[s:e], kv, meta, i)
        return self.ops.linear(self.norm(y.to(x.dtype), gate), self.out_proj.weight, self.out_proj.bias)

    @torch.no_grad()
    def _sequence(self, xbc, dt, kv: LayerKV, meta: AttentionMetadata, i: int) -> torch.Tensor:
        """Sequence i's new tokens (its chunk, or one decode): their outputs [tokens, intermediate]
        float32, the states written into its blocks."""
        m, bs = self.m, meta.block_size
        q, n = xbc.shape[0], meta.seq_lens_list[i]
        start = n - q  # tokens already computed
        table = meta.block_tables[i]
        if start:
            ssm, conv = (t.clone() for t in state_views(kv, int(table[(start - 1) // bs]), m))
        else:
            ssm = torch.zeros(m.num_heads, m.head_dim, m.state_size, device=xbc.device)
            conv = torch.zeros(m.conv_kernel - 1, m.conv_dim, device=xbc.device)
        inputs = torch.cat([conv, xbc.float()])  # [K - 1 + q, conv_dim]
        w = self.conv1d.weight.float()  # [conv_dim, 1, K]
        b = None if self.conv1d.bias is None else self.conv1d.bias.float()
        mixed = F.silu(F.conv1d(inputs.T[None], w, b, groups=m.conv_dim)[0].T)  # [q, conv_dim]
        xs, bmat, cmat = mixed.split([m.intermediate_size, m.num_groups * m.state_size,
                                      m.num_groups * m.state_size], dim=-1)  # fmt: skip
        per_group = m.num_heads // m.num_groups
        bmat = bmat.view(q, m.num_groups, 1, m.state_size).expand(-1, -1, per_group, -1).reshape(q, m.num_heads, -1)
        cmat = cmat.view(q, m.num_groups, 1, m.state_size).expand(-1, -1, per_group, -1).reshape(q, m.num_heads, -1)
        xs = xs.view(q, m.num_heads, m.head_dim)
        steps = F.softplus(dt.float() + self.dt_bias.float())
        lo, hi = m.time_step_limit
        if (lo, hi) != (0.0, float("inf")):
            steps = steps.clamp(lo, hi)
        a = -torch.exp(self.A_log.float())
        decay = torch.exp(steps * a)  # [q, heads]
        d = self.D.float()
        out = torch.empty(q, m.num_heads, m.head_dim, device=xbc.device)
        slots = meta.slot_mapping[meta.query_start_loc[i] : meta.query_start_loc[i] + q]
        for t in range(q):
            ssm = ssm * decay[t, :, None, None] + (steps[t, :, None, None] * xs[t, :, :, None]) * bmat[t, :, None, :]
            out[t] = (ssm @ cmat[t, :, :, None]).squeeze(-1) + d[:, None] * xs[t]
            pos = start + t
            if (pos + 1) % bs == 0 or t == q - 1:  # a block's end, or the step's last token
                ssm_view, conv_view = state_views(kv, int(slots[t]) // bs, m)
                ssm_view.copy_(ssm)
                conv_view.copy_(inputs[t + 1 : t + m.conv_kernel])
        return out.view(q, -1)
