"""Triton kernels: absorbed-MLA decode over the packed paged cache, split-KV, and the combine step.

One program handles one *work unit* (a sequence and a range of its tokens, from the scheduler in
``api.get_mla_metadata``) for one block of query rows. Rows are ``r = i·H + h`` over the ``S_q``
query tokens ``i`` and heads ``h`` of the sequence, so a block holds all heads of a query token (or
several query tokens of a few heads): every cache tile is read once per row block and shared by all
its heads, since MLA's absorbed keys and values are one latent shared by every head.

Per tile of ``BLOCK_N`` tokens the program gathers the tokens' pages through the block table, reads
the packed codes and group metadata of both paths (layout.PageLayout sections) and rebuilds the tile
in bf16 registers (``code·scale + zero`` per channel group; the BF16 format loads raw values), then

    s = scale · (q_latent · cᵀ + q_rope · k_Rᵀ)        (tensor cores, fp32 accumulate)
    online softmax over the tiles (exp2), acc += p · c   (latent-space output, no W_UV)

A unit that covers a whole sequence writes the normalised output and the log-sum-exp directly;
otherwise it writes a partial (output, lse) that ``_mla_combine_kernel`` merges: the lse in fp32, the output in the
workspace's dtype (``partials.partial_dtype``: fp16 holding o·2^-5 for integer content codes of up to 4 bits with fp16
metadata and bf16 for the other formats; fp32 where QUANTMLA_PARTIALS asks).

Two ways to rebuild a quantized tile (constexpr ``DEQ``):
  0: one wide byte load per token, planes split by shifts into a [N, planes, groups, width] tensor,
     metadata broadcast per group, one reshape to [N, D];
  1: a reshape-free fallback that indexes bytes and metadata per channel (more load instructions).
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantmla.kernels.partials import PARTIAL_FP16_SHIFT

PART_FP16_SCALE = tl.constexpr(2.0**-PARTIAL_FP16_SHIFT)
PART_FP16_UNSCALE = tl.constexpr(2.0**PARTIAL_FP16_SHIFT)


@triton.jit
def _partial(o, PO):
    """An fp32 partial output as the workspace PO stores it: in fp16 times 2^-PARTIAL_FP16_SHIFT (exact: a power of
    two), in bf16 or fp32 as it is."""
    if PO.dtype.element_ty == tl.float16:
        return (o * PART_FP16_SCALE).to(tl.float16)
    elif PO.dtype.element_ty == tl.bfloat16:
        return o.to(tl.bfloat16)
    else:
        return o


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16, round to nearest even, spelled out (the CPU interpreter's cast truncates)."""
    u = x.to(tl.uint32, bitcast=True)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e4m3_to_f32(b):
    """uint8 e4m3 (float8_e4m3fn) codes -> fp32, spelled out (exact; the CPU interpreter's cast is not)."""
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))  # 2^-9 · m, or 1.m · 2^(e-7)
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def _f32_to_e4m3(y):
    """fp32 in [-448, 448] -> uint8 e4m3 code, round to nearest even (as torch's float8_e4m3fn cast)."""
    a = tl.abs(y)
    u = a.to(tl.uint32, bitcast=True)
    u = u + 0x7FFFF + ((u >> 20) & 1)  # round the 23-bit mantissa to 3 bits
    normal = (((u >> 23).to(tl.int32) - 120) << 3) | ((u >> 20) & 7).to(tl.int32)  # rebias 127 -> 7
    sub = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)  # below 2^-6: m · 2^-9, m = rne(a · 512) (8 -> 2^-6)
    code = tl.where(a < 0.015625, sub, normal)
    code = tl.where((y.to(tl.uint32, bitcast=True) >> 31) != 0, code | 128, code)  # the sign bit (-0.0 too)
    return code.to(tl.uint8)


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One tile of the online softmax over base-2 scores s [M, N] (masked entries -inf): returns the
    tile's probabilities p, the factor alpha that rescales what was accumulated, and the new running
    max and sum. A row that has seen no key yet keeps max -inf, sum 0 and p = 0 (no NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _path_tile(
    P8, PV, page, tok, tmask, PAGE_BYTES: tl.constexpr,
    OFF_CODES: tl.constexpr, OFF_META: tl.constexpr,
    D: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, AFFINE: tl.constexpr, FP8: tl.constexpr,
    MB: tl.constexpr, BLOCK_N: tl.constexpr, DEQ: tl.constexpr, RNE: tl.constexpr, PAGE_META: tl.constexpr = 0,
):
    """The [BLOCK_N, D] bf16 tile of one path for tokens at (page, tok); masked tokens read as 0.

    PV is the pages viewed in the path's MB-byte element type (bf16 values, or fp16/bf16/fp32 metadata).
    PAGE_META > 0: the integer path's group metadata is the page's (at OFF_META), one set of G·F elements per
    PAGE_META tokens; 0: the token's own."""
    page8 = page * PAGE_BYTES
    pagev = page * (PAGE_BYTES // MB)  # the page's first element in PV
    if BITS == 16:
        base = pagev + OFF_CODES // 2 + tok * D
        x = tl.load(PV + base[:, None] + tl.arange(0, D)[None, :], mask=tmask[:, None], other=0.0)
        out = x.to(tl.bfloat16)
    elif FP8:  # e4m3 values times one scale per group
        G8: tl.constexpr = D // GS
        by = tl.load(P8 + (page8 + OFF_CODES + tok * D)[:, None] + tl.arange(0, D)[None, :], mask=tmask[:, None], other=0)
        if RNE:  # the CPU interpreter
            v = _e4m3_to_f32(by)
        else:
            v = by.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        mbase = pagev + OFF_META // MB + tok * G8
        if DEQ == 0:
            s = tl.load(PV + mbase[:, None] + tl.arange(0, G8)[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
            v = tl.reshape(tl.reshape(v, [BLOCK_N, G8, GS]) * s[:, :, None], [BLOCK_N, D])
        else:
            s = tl.load(PV + mbase[:, None] + (tl.arange(0, D) // GS)[None, :], mask=tmask[:, None], other=0.0)
            v = v * s.to(tl.float32)
        if RNE:
            out = _bf16_rne(v)
        else:
            out = v.to(tl.bfloat16)
    else:
        NB: tl.constexpr = D * BITS // 8  # bytes of codes per token (planar: plane k = bits [k·b, (k+1)·b))
        K: tl.constexpr = 8 // BITS  # planes
        F: tl.constexpr = 2 if AFFINE else 1  # meta fields per group
        G: tl.constexpr = D // GS
        MASK: tl.constexpr = (1 << BITS) - 1
        MID: tl.constexpr = 1 << (BITS - 1)
        cbase = page8 + OFF_CODES + tok * NB  # [N] byte offset of the token's codes
        mrow = tok // PAGE_META if PAGE_META else tok  # [N] the token's metadata set
        mbase = pagev + OFF_META // MB + mrow * (G * F)  # [N] element offset of its metadata in PV
        if DEQ == 0:
            W: tl.constexpr = GS if GS < NB else NB  # channels of a plane in one group
            R: tl.constexpr = NB // W  # groups per plane
            ridx = tl.arange(0, R)
            widx = tl.arange(0, W)
            boff = ridx[:, None] * W + widx[None, :]  # [R, W] byte index
            by = tl.load(P8 + cbase[:, None, None] + boff[None, :, :], mask=tmask[:, None, None], other=0)
            kidx = tl.arange(0, K)
            if K == 1:
                codes = by[:, None, :, :]
            else:
                sh = (kidx * BITS).to(tl.uint8)
                codes = (by[:, None, :, :] >> sh[None, :, None, None]) & MASK  # [N, K, R, W]
            grp = (kidx[:, None] * NB + ridx[None, :] * W) // GS  # [K, R] group of each (plane, chunk)
            mptr = PV + mbase[:, None, None] + (grp * F)[None, :, :]
            s = tl.load(mptr, mask=tmask[:, None, None], other=0.0).to(tl.float32)
            cf = codes.to(tl.float32)
            if AFFINE:
                z = tl.load(mptr + 1, mask=tmask[:, None, None], other=0.0).to(tl.float32)
                v = cf * s[:, :, :, None] + z[:, :, :, None]
            else:
                v = (cf - MID) * s[:, :, :, None]
            v = tl.reshape(v, [BLOCK_N, D])
            if RNE:
                out = _bf16_rne(v)
            else:
                out = v.to(tl.bfloat16)
        else:
            ch = tl.arange(0, D)
            byte = ch % NB
            shift = ((ch // NB) * BITS).to(tl.uint8)
            by = tl.load(P8 + cbase[:, None] + byte[None, :], mask=tmask[:, None], other=0)
            cf = ((by >> shift[None, :]) & MASK).to(tl.float32)
            mptr = PV + mbase[:, None] + ((ch // GS) * F)[None, :]
            s = tl.load(mptr, mask=tmask[:, None], other=0.0).to(tl.float32)
            if AFFINE:
                z = tl.load(mptr + 1, mask=tmask[:, None], other=0.0).to(tl.float32)
                v = cf * s + z
            else:
                v = (cf - MID) * s
            if RNE:
                out = _bf16_rne(v)
            else:
                out = v.to(tl.bfloat16)
    return out


@triton.jit
def work_unit(UNITS, SEQLENS, u):
    """Work unit u of a schedule (``schedule.py``'s int32 [U, 4] rows: sequence, token start, token end, splits of
    that sequence) and its sequence's length: (b, start, end, nsplit, L)."""
    b = tl.load(UNITS + u * 4)
    start = tl.load(UNITS + u * 4 + 1)
    end = tl.load(UNITS + u * 4 + 2)
    nsplit = tl.load(UNITS + u * 4 + 3)
    return b, start, end, nsplit, tl.load(SEQLENS + b)


@triton.jit
def unit_rows(hb, b, L, H, SQ, R, CAUSAL, BLOCK_M: tl.constexpr):
    """Row block hb of sequence b (length L; R = S_q·H rows, query i = row // H): (rows [BLOCK_M], rows < R, each
    row's token limit, its row of the query and output). Query i sees tokens t < L − (S_q − 1 − i) (causal) or t < L."""
    rows = hb * BLOCK_M + tl.arange(0, BLOCK_M)
    limit = L - CAUSAL * (SQ - 1 - rows // H)
    return rows, rows < R, limit, b.to(tl.int64) * R + rows


@triton.jit(do_not_specialize=["stride_bt", "H", "SQ", "R", "CAUSAL"])
def _mla_decode_kernel(
    QC, QR, P8, PC16, PR16, BT, SEQLENS, UNITS, OUT, LSE, PO, PLSE,
    stride_bt, H, SQ, R, CAUSAL, qk_scale,
    D_C: tl.constexpr, D_R: tl.constexpr, PS: tl.constexpr, PAGE_BYTES: tl.constexpr,
    OFF_CC: tl.constexpr, OFF_RC: tl.constexpr, OFF_CM: tl.constexpr, OFF_RM: tl.constexpr,
    C_BITS: tl.constexpr, C_GS: tl.constexpr, C_AFFINE: tl.constexpr, C_FP8: tl.constexpr, C_MB: tl.constexpr,
    R_BITS: tl.constexpr, R_GS: tl.constexpr, R_AFFINE: tl.constexpr, R_FP8: tl.constexpr, R_MB: tl.constexpr,
    R_PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DEQ: tl.constexpr, DOT_F32: tl.constexpr,
):
    hb = tl.program_id(0)
    u = tl.program_id(1)
    b, start, end, nsplit, L = work_unit(UNITS, SEQLENS, u)
    rows, rmask, limit, qrow = unit_rows(hb, b, L, H, SQ, R, CAUSAL, BLOCK_M)
    dc = tl.arange(0, D_C)
    dr = tl.arange(0, D_R)
    q_c = tl.load(QC + qrow[:, None] * D_C + dc[None, :], mask=rmask[:, None], other=0.0)
    q_r = tl.load(QR + qrow[:, None] * D_R + dr[None, :], mask=rmask[:, None], other=0.0)
    if DOT_F32:  # the CPU interpreter multiplies bf16 operands wrongly: give it fp32 (same values)
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_C], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        page = tl.load(bt_row + t // PS, mask=tmask, other=0).to(tl.int64)
        tok = t % PS
        c = _path_tile(P8, PC16, page, tok, tmask, PAGE_BYTES, OFF_CC, OFF_CM, D_C, C_BITS, C_GS, C_AFFINE, C_FP8, C_MB,
                       BLOCK_N, DEQ, DOT_F32)
        kr = _path_tile(P8, PR16, page, tok, tmask, PAGE_BYTES, OFF_RC, OFF_RM, D_R, R_BITS, R_GS, R_AFFINE, R_FP8, R_MB,
                        BLOCK_N, DEQ, DOT_F32, R_PAGE)
        if DOT_F32:
            c = c.to(tl.float32)
            kr = kr.to(tl.float32)
        s = tl.dot(q_c, tl.trans(c))
        s = tl.dot(q_r, tl.trans(kr), s)
        s = s * qk_scale
        vis = (t[None, :] < limit[:, None]) & tmask[None, :]
        s = tl.where(vis, s, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
        if DOT_F32:
            pv = _bf16_rne(p).to(tl.float32)
        else:
            pv = p.to(tl.bfloat16)
        acc = acc * alpha[:, None] + tl.dot(pv, c)

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    if nsplit == 1:
        tl.store(OUT + qrow[:, None] * D_C + dc[None, :], o.to(OUT.dtype.element_ty), mask=rmask[:, None])
        tl.store(LSE + qrow, lse, mask=rmask)
    else:
        prow = u.to(tl.int64) * R + rows
        tl.store(PO + prow[:, None] * D_C + dc[None, :], _partial(o, PO), mask=rmask[:, None])
        tl.store(PLSE + prow, lse, mask=rmask)


@triton.jit
def _combine_one_step(PO, PLSE, first, n, rows, rmask, dc, R, D_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """A sequence's n <= BLOCK_S partials merged in one round trip: (m_safe [R], den [R], acc [R, D])."""
    sidx = tl.arange(0, BLOCK_S)
    ok = (sidx < n)[:, None] & rmask[None, :]
    pr = (first + sidx).to(tl.int64)[:, None] * R + rows[None, :]  # [S, R] partial rows
    lse_s = tl.load(PLSE + pr, mask=ok, other=float("-inf"))
    o_s = tl.load(PO + pr[:, :, None] * D_C + dc[None, None, :], mask=ok[:, :, None], other=0.0)  # [S, R, D]
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe[None, :])
    return m_safe, tl.sum(w, 0), tl.sum(w[:, :, None] * o_s, 0)


@triton.jit
def _combine_passes(PO, PLSE, first, n, rows, rmask, dc, R, D_C: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """A sequence's n partials merged BLOCK_S at a time: a pass for the maximum, one for the sums."""
    sidx = tl.arange(0, BLOCK_S)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for i0 in range(0, n, BLOCK_S):
        s = i0 + sidx
        pr = (first + s).to(tl.int64)[:, None] * R + rows[None, :]
        lse_s = tl.load(PLSE + pr, mask=(s < n)[:, None] & rmask[None, :], other=float("-inf"))
        m = tl.maximum(m, tl.max(lse_s, 0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for i0 in range(0, n, BLOCK_S):
        s = i0 + sidx
        ok = (s < n)[:, None] & rmask[None, :]
        pr = (first + s).to(tl.int64)[:, None] * R + rows[None, :]
        w = tl.exp(tl.load(PLSE + pr, mask=ok, other=float("-inf")) - m_safe[None, :])  # [S, R]
        den += tl.sum(w, 0)
        o_s = tl.load(PO + pr[:, :, None] * D_C + dc[None, None, :], mask=ok[:, :, None], other=0.0)
        acc += tl.sum(w[:, :, None] * o_s, 0)
    return m_safe, den, acc


@triton.jit(do_not_specialize=["R"])
def _mla_combine_kernel(
    PO, PLSE, SEQINFO, OUT, LSE, R, D_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, ONE_STEP: tl.constexpr,
):
    """Merge the split partials of sequences with more than one unit (others were written directly).
    Grid (sequences, row blocks, channel blocks): many programs share a long sequence's splits, and each
    reads BLOCK_S splits per step, so a lone sequence's hundreds of splits merge in a few wide steps. With
    ONE_STEP a program whose sequence has at most BLOCK_S splits loads its log-sum-exps and partials at once:
    one round trip to memory instead of a pass for the maximum and one for the sums (a sequence with more,
    which a CUDA graph's schedule may deal out, takes the passes)."""
    b = tl.program_id(0)
    rb = tl.program_id(1)
    db = tl.program_id(2)
    first = tl.load(SEQINFO + b * 2)
    n = tl.load(SEQINFO + b * 2 + 1)
    if n > 1:
        rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        dc = db * BLOCK_D + tl.arange(0, BLOCK_D)
        if ONE_STEP:
            if n <= BLOCK_S:
                m_safe, den, acc = _combine_one_step(PO, PLSE, first, n, rows, rmask, dc, R, D_C, BLOCK_S)
            else:
                m_safe, den, acc = _combine_passes(PO, PLSE, first, n, rows, rmask, dc, R, D_C, BLOCK_R, BLOCK_D, BLOCK_S)
        else:
            m_safe, den, acc = _combine_passes(PO, PLSE, first, n, rows, rmask, dc, R, D_C, BLOCK_R, BLOCK_D, BLOCK_S)
        has = den > 0.0
        d_safe = tl.where(has, den, 1.0)
        o = acc / d_safe[:, None]
        if PO.dtype.element_ty == tl.float16:  # the partials' power of two undone (decode._partial)
            o = o * PART_FP16_UNSCALE
        qrow = b.to(tl.int64) * R + rows
        tl.store(OUT + qrow[:, None] * D_C + dc[None, :], o.to(OUT.dtype.element_ty), mask=rmask[:, None])
        if db == 0:
            lse = tl.where(has, m_safe + tl.log(d_safe), float("-inf"))
            tl.store(LSE + qrow, lse, mask=rmask)
