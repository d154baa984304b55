"""Triton kernels of the `triton` attention backend (kvpage/attention/triton_paged.py).

Three kernels over the reference cache layout, [num_blocks, num_kv_heads, block_size, head_dim]
(int8 caches with a float32 scale per token and kv head, [num_blocks, num_kv_heads, block_size]):

    write_kv        each new token's K/V to its slot (quantized to int8 as kv_quant.py does, byte for byte)
    decode          one query token per sequence; a program per (sequence, kv head, context split) loads
                    each key once for all query heads of its group, online softmax in float32; with
                    several splits (flash-decoding: long contexts, few sequences) a second kernel,
                    combine, merges the splits' partial sums
    prefill         the chunks of several tokens: a program per (chunk, query head, tile of queries)
                    over every key the tile may see (earlier context and the chunk's own, read from
                    the cache after the write; a chunk without context over an int8 cache attends its
                    own K/V as computed, as the reference does), causal mask by position

Keys are read BLOCK_N tokens at a time, each token's address found through the block table, so any
block size works (1, 16, 32, or one that is not a power of two). Nothing is gathered into a copy.
On a machine without a GPU the same kernels run under Triton's interpreter (TRITON_INTERPRET=1,
set before this module is imported), which is how CI tests them.
"""

from __future__ import annotations

import triton
import triton.language as tl

ROUND = 12582912.0  # 1.5 * 2**23: (x + ROUND) - ROUND rounds a float32 |x| < 2**22 to nearest, ties to even


@triton.jit
def write_kv(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    KVH: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, INT8: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    row = ((slot // BS) * KVH + h) * BS + slot % BS  # the token's row in the cache, as [blocks * KVH * BS, D]
    d = tl.arange(0, DP)
    dm = d < D
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dm, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dm, other=0.0)
    if INT8:
        kf = k.to(tl.float32)
        vf = v.to(tl.float32)
        k_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(kf), axis=0), 1e-12), 127.0)  # IEEE, as torch divides
        v_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(vf), axis=0), 1e-12), 127.0)
        kq = tl.minimum(tl.maximum((tl.math.div_rn(kf, k_scale) + ROUND) - ROUND, -127.0), 127.0)
        vq = tl.minimum(tl.maximum((tl.math.div_rn(vf, v_scale) + ROUND) - ROUND, -127.0), 127.0)
        tl.store(kc_ptr + row * D + d, kq.to(tl.int8), mask=dm)
        tl.store(vc_ptr + row * D + d, vq.to(tl.int8), mask=dm)
        tl.store(ks_ptr + row, k_scale)
        tl.store(vs_ptr + row, v_scale)
    else:
        tl.store(kc_ptr + row * D + d, k.to(kc_ptr.dtype.element_ty), mask=dm)
        tl.store(vc_ptr + row * D + d, v.to(vc_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _load_rows(c_ptr, s_ptr, bt_ptr, t, tm, d, dm, KVH: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, h,
               INT8: tl.constexpr):  # fmt: skip
    """Tokens t [BLOCK_N] of one sequence (its block-table row at bt_ptr), kv head h: [BLOCK_N, DP] float32."""
    blk = tl.load(bt_ptr + t // BS, mask=tm, other=0)
    row = (blk * KVH + h) * BS + t % BS
    x = tl.load(c_ptr + row[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    if INT8:
        x = x * tl.load(s_ptr + row, mask=tm, other=0.0)[:, None]
    return x


@triton.jit
def decode(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, scale, split_len,
    G: tl.constexpr, GP: tl.constexpr, KVH: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, INT8: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(lens_ptr + s)
    lo = split * split_len
    hi = tl.minimum(n, lo + split_len)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    gm = g < G
    dm = d < D
    heads = h * G + g
    q = tl.load(q_ptr + s * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None] & dm[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    m = tl.full([GP], float("-inf"), tl.float32)
    l_sum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    bt = bt_ptr + s * stride_bt
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tm = t < hi
        k = _load_rows(kc_ptr, ks_ptr, bt, t, tm, d, dm, KVH, BS, D, h, INT8)
        v = _load_rows(vc_ptr, vs_ptr, bt, t, tm, d, dm, KVH, BS, D, h, INT8)
        sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BLOCK_N]
        sc = tl.where(tm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    if SPLITS == 1:
        o = acc / l_sum[:, None]
        tl.store(out_ptr + s * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])  # fmt: skip
    else:  # partial sums of this split: acc [S, H, SPLITS, DP], (m, l) [S, H, SPLITS, 2]
        H = KVH * G
        part = (s * H + heads) * SPLITS + split
        tl.store(acc_ptr + part[:, None] * DP + d[None, :], acc, mask=gm[:, None])
        tl.store(ml_ptr + part * 2, m, mask=gm)
        tl.store(ml_ptr + part * 2 + 1, l_sum, mask=gm)


@triton.jit
def combine(acc_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
            SPLITS: tl.constexpr, SP: tl.constexpr):  # fmt: skip
    """out[s, head] from the SPLITS partial sums of (s, head): splits that saw no keys hold m = -inf."""
    s = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, SP)
    d = tl.arange(0, DP)
    im = i < SPLITS
    part = (s * H + head) * SPLITS + i
    m = tl.load(ml_ptr + part * 2, mask=im, other=float("-inf"))
    l_sum = tl.load(ml_ptr + part * 2 + 1, mask=im, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * DP + d[None, :], mask=im[:, None], other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
    tl.store(out_ptr + s * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def prefill(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, starts_ptr, out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt, scale, first,
    G: tl.constexpr, KVH: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT8: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    i = first + tl.program_id(0)  # the sequence
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q0 = tl.load(starts_ptr + i)
    m_len = tl.load(starts_ptr + i + 1) - q0
    if tile * BLOCK_M < m_len:
        n = tl.load(lens_ptr + i)
        h = head // G
        r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rm = r < m_len
        pos = n - m_len + r  # each query's position: it sees keys 0 .. pos
        d = tl.arange(0, DP)
        dm = d < D
        q = tl.load(q_ptr + (q0 + r)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=rm[:, None] & dm[None, :], other=0.0).to(tl.float32)  # fmt: skip
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DP], tl.float32)
        bt = bt_ptr + i * stride_bt
        hi = tl.minimum(n, n - m_len + (tile + 1) * BLOCK_M)  # the tile's last query sees up to here
        for t0 in range(0, hi, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tm = t < hi
            k = _load_rows(kc_ptr, ks_ptr, bt, t, tm, d, dm, KVH, BS, D, h, INT8)
            v = _load_rows(vc_ptr, vs_ptr, bt, t, tm, d, dm, KVH, BS, D, h, INT8)
            if INT8:  # noqa: SIM102 - a constexpr test, then a runtime one (Triton compiles them apart)
                if m_len == n:  # a chunk without context attends its own K/V as computed, not as stored
                    fm = tm[:, None] & dm[None, :]
                    k = tl.load(k_ptr + (q0 + t)[:, None] * stride_kt + h * stride_kh + d[None, :], mask=fm,
                                other=0.0).to(tl.float32)  # fmt: skip
                    v = tl.load(v_ptr + (q0 + t)[:, None] * stride_vt + h * stride_vh + d[None, :], mask=fm,
                                other=0.0).to(tl.float32)  # fmt: skip
            if IEEE:
                sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                sc = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16))) * scale
            sc = tl.where(tm[None, :] & (t[None, :] <= pos[:, None]), sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))
            m = m_new
        o = acc / l_sum[:, None]
        tl.store(out_ptr + (q0 + r)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])  # fmt: skip
