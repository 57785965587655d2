"""Triton kernel: causal MLA prefill attention in the non-absorbed form.

A prefill chunk of n queries attends over T context tokens (its own included, the chunk being the last
n positions). Absorbed, every (query, key) pair costs (2·d_c + d_r) multiply-adds per head; with the
context up-projected once by the model's own ``kv_b_proj`` (latent [T, d_c] -> k_nope, v per head) it
costs d_n + d_r + d_v, 3.4x less at DeepSeek's geometry, and the scores are never materialized:

    s   = scale · (q_nope · k_nopeᵀ + q_rope · k_ropeᵀ)      k_rope [T, d_r] shared by every head
    out = softmax(s, causal) · v                              query i sees keys t <= T − n + i

One program owns ``BLOCK_M`` queries of one head and streams the key blocks that any of them sees
(online softmax, exp2, fp32 accumulators): first the whole key blocks that every query of the block sees,
without masks, then the blocks on the causal diagonal and past the context's end, masked. The query blocks
with the most keys are launched first. Head dims need not be powers of two: loads are masked to
the real width of a power-of-two block. Where the head dims are powers of two (DeepSeek's 128/64/128), the key
blocks may come through tensor descriptors instead (``PrefillConfig.tma``: bulk tensor copies on Hopper).
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantmla.kernels.decode import _online_softmax


@triton.jit
def _prefill_keys(acc, m_i, l_i, q_n, q_r, KV, KR, KN_D, V_D, KR_D, n0, h, skv_t, skv_h, skr_t, T, limit, qk_scale,
                  dn, dr, dv, D_N: tl.constexpr, D_R: tl.constexpr, D_V: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """One key block [n0, n0 + BLOCK_N) into the online softmax of a query block. MASKED: the block may hold
    keys past T or past some query's causal limit; otherwise every query of the block sees all its keys.
    TMA: the block's k_nope, v and k_rope come through tensor descriptors (bulk tensor copies on Hopper; rows past
    T read as zeros), KN_D and V_D over the kv rows [T, H·skv_h], KR_D over k_rope [T, d_r]."""
    t = n0 + tl.arange(0, BLOCK_N)
    t64 = t.to(tl.int64)
    kv_row = KV + t64[:, None] * skv_t + h * skv_h
    if TMA:
        col = (h * skv_h).to(tl.int32)
        k_n = KN_D.load([n0, col])
        v = V_D.load([n0, col + D_N])
        k_r = KR_D.load([n0, 0])
    elif MASKED:
        tmask = t < T
        k_n = tl.load(kv_row + dn[None, :], mask=tmask[:, None] & (dn < D_N)[None, :], other=0.0)
        k_r = tl.load(KR + t64[:, None] * skr_t + dr[None, :], mask=tmask[:, None] & (dr < D_R)[None, :], other=0.0)
        v = tl.load(kv_row + D_N + dv[None, :], mask=tmask[:, None] & (dv < D_V)[None, :], other=0.0)
    else:
        k_n = tl.load(kv_row + dn[None, :], mask=(dn < D_N)[None, :], other=0.0)
        k_r = tl.load(KR + t64[:, None] * skr_t + dr[None, :], mask=(dr < D_R)[None, :], other=0.0)
        v = tl.load(kv_row + D_N + dv[None, :], mask=(dv < D_V)[None, :], other=0.0)
    if DOT_F32:
        k_n = k_n.to(tl.float32)
        k_r = k_r.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q_n, tl.trans(k_n))
    s = tl.dot(q_r, tl.trans(k_r), s)
    s = s * qk_scale
    if MASKED:
        s = tl.where((t[None, :] <= limit[:, None]) & (t < T)[None, :], s, float("-inf"))
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["n", "T"])
def _mla_prefill_kernel(
    QN, QR, KV, KR, OUT,
    sqn_t, sqn_h, sqr_t, sqr_h, skv_t, skv_h, skr_t, so_t, so_h,
    n, T, qk_scale,
    D_N: tl.constexpr, D_R: tl.constexpr, D_V: tl.constexpr,
    BD_N: tl.constexpr, BD_R: tl.constexpr, BD_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, SPLIT_DIAGONAL: tl.constexpr,
    KN_D=None, V_D=None, KR_D=None, TMA: tl.constexpr = False,
):
    # the query blocks with most keys first, so that the last wave holds the short ones
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    past = T - n
    i = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query index in the chunk
    qmask = i < n
    dn = tl.arange(0, BD_N)
    dr = tl.arange(0, BD_R)
    dv = tl.arange(0, BD_V)
    i64 = i.to(tl.int64)
    q_n = tl.load(QN + i64[:, None] * sqn_t + h * sqn_h + dn[None, :], mask=qmask[:, None] & (dn < D_N)[None, :], other=0.0)
    q_r = tl.load(QR + i64[:, None] * sqr_t + h * sqr_h + dr[None, :], mask=qmask[:, None] & (dr < D_R)[None, :], other=0.0)
    if DOT_F32:  # the CPU interpreter multiplies bf16 operands wrongly: give it fp32 (same values)
        q_n = q_n.to(tl.float32)
        q_r = q_r.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BD_V], tl.float32)
    limit = past + i  # the last key each query sees
    hi = tl.minimum(T, past + (mb + 1) * BLOCK_M)  # keys any query of the block sees
    # keys below `full` (whole key blocks) are seen by every query of the block: no masks there
    full = (past + mb * BLOCK_M + 1) // BLOCK_N * BLOCK_N if SPLIT_DIAGONAL else 0
    for n0 in range(0, full, BLOCK_N):
        acc, m_i, l_i = _prefill_keys(acc, m_i, l_i, q_n, q_r, KV, KR, KN_D, V_D, KR_D, n0, h, skv_t, skv_h, skr_t, T,
                                      limit, qk_scale, dn, dr, dv, D_N, D_R, D_V, BLOCK_N, DOT_F32, False, TMA)
    for n0 in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _prefill_keys(acc, m_i, l_i, q_n, q_r, KV, KR, KN_D, V_D, KR_D, n0, h, skv_t, skv_h, skr_t, T,
                                      limit, qk_scale, dn, dr, dv, D_N, D_R, D_V, BLOCK_N, DOT_F32, True, TMA)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(OUT + i64[:, None] * so_t + h * so_h + dv[None, :], o.to(OUT.dtype.element_ty),
             mask=qmask[:, None] & (dv < D_V)[None, :])
