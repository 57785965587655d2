"""Triton kernels: quantize, pack and write tokens into their pages (prefill chunks or decode steps).

A RoPE path grouped per page is quantized over the page's tokens: ``_page_rope_kernel`` requantizes each
page a call writes from the call's keys and the earlier ones of a stage the caller owns, then
``_stage_rope_kernel`` keeps the keys of the pages left unfinished there (``kernels.api.append_to_pages(...,
rope_stage=, stage_rows=)``).

Bit-exact with the Python reference (``quant.groupwise.quantize`` + ``cache.paged.write_tokens``):
the stored scale and zero are rounded to the metadata dtype first and the codes are computed against
the rounded values, with IEEE division (``div_rn``) and round-half-to-even, like ``torch.round``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantmla.kernels.decode import _bf16_rne, _f32_to_e4m3

_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5·2^23: (v + M) − M rounds |v| < 2^22 to the nearest integer, ties to even


@triton.jit
def _affine_meta(lo, hi, QMAX: tl.constexpr, META_BF16: tl.constexpr, CLIP: tl.constexpr = 0):
    """(scale, zero) of groups spanning [lo, hi], rounded to the metadata dtype first (a constant group gets
    scale 1), as ``quant.groupwise.group_scales``. CLIP = k > 0: the range shrinks by 2^-(k+1) of its width at
    each end (the format's clip 1 - 2^-k; the product is exact, so a fused multiply-add rounds alike)."""
    if CLIP > 0:
        t = (hi - lo) * (0.5 ** (CLIP + 1))
        lo = lo + t
        hi = hi - t
    if META_BF16:
        zero = _bf16_rne(lo).to(tl.float32)
        scale = _bf16_rne(tl.math.div_rn(hi - zero, QMAX * 1.0)).to(tl.float32)
    else:
        zero = lo.to(tl.float16).to(tl.float32)
        scale = tl.math.div_rn(hi - zero, QMAX * 1.0).to(tl.float16).to(tl.float32)
    return tl.where(scale > 0.0, scale, 1.0), zero


@triton.jit
def _symmetric_scale(amax, MID: tl.constexpr, META_BF16: tl.constexpr, CLIP: tl.constexpr = 0):
    """The scale of symmetric groups of largest magnitude amax, rounded to the metadata dtype (0 -> 1); CLIP = k > 0
    scales amax by the format's clip 1 - 2^-k first."""
    if CLIP > 0:
        amax = amax - amax * (0.5 ** CLIP)
    if META_BF16:
        scale = _bf16_rne(tl.math.div_rn(amax, (MID - 1) * 1.0)).to(tl.float32)
    else:
        scale = tl.math.div_rn(amax, (MID - 1) * 1.0).to(tl.float16).to(tl.float32)
    return tl.where(scale > 0.0, scale, 1.0)


@triton.jit
def _round_codes(v, QMAX: tl.constexpr):
    """Codes of v = x / scale (affine: (x - zero) / scale; symmetric: x / scale + 2^(b-1), the offset added
    after rounding by the caller): round half to even, clamped to [0, QMAX]."""
    v = tl.minimum(tl.maximum(v, -(QMAX + 1.0)), QMAX + 1.0)
    return (v + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def _write_path(
    X, stride_x, t, ok, P8, PV, page, tok, PAGE_BYTES: tl.constexpr,
    OFF_CODES: tl.constexpr, OFF_META: tl.constexpr,
    D: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, AFFINE: tl.constexpr, FP8: tl.constexpr,
    MB: tl.constexpr, META_BF16: tl.constexpr, BLOCK_T: tl.constexpr, CLIP: tl.constexpr = 0,
):
    """Quantize and store one path of BLOCK_T tokens; PV is the pages in the path's MB-byte element type."""
    x = tl.load(X + t.to(tl.int64)[:, None] * stride_x + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
    x = x.to(tl.float32)
    page8 = page * PAGE_BYTES
    pagev = page * (PAGE_BYTES // MB)
    if BITS == 16:
        ptr = PV + (pagev + OFF_CODES // 2 + tok * D)[:, None] + tl.arange(0, D)[None, :]
        tl.store(ptr, _bf16_rne(x), mask=ok[:, None])
    elif FP8:  # e4m3 values, one scale (amax / 448, rounded to the metadata dtype) per group
        G8: tl.constexpr = D // GS
        xg = tl.reshape(x, [BLOCK_T, G8, GS])
        scale = tl.math.div_rn(tl.max(tl.abs(xg), 2), 448.0)
        if MB == 2:
            if META_BF16:
                scale = _bf16_rne(scale).to(tl.float32)
            else:
                scale = scale.to(tl.float16).to(tl.float32)
        scale = tl.where(scale > 0.0, scale, 1.0)
        y = tl.math.div_rn(xg, scale[:, :, None])
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        codes = _f32_to_e4m3(tl.reshape(y, [BLOCK_T, D]))
        tl.store(P8 + (page8 + OFF_CODES + tok * D)[:, None] + tl.arange(0, D)[None, :], codes, mask=ok[:, None])
        mptr = PV + (pagev + OFF_META // MB + tok * G8)[:, None] + tl.arange(0, G8)[None, :]
        tl.store(mptr, scale.to(PV.dtype.element_ty), mask=ok[:, None])
    else:
        NB: tl.constexpr = D * BITS // 8
        K: tl.constexpr = 8 // BITS
        F: tl.constexpr = 2 if AFFINE else 1
        G: tl.constexpr = D // GS
        QMAX: tl.constexpr = (1 << BITS) - 1
        MID: tl.constexpr = 1 << (BITS - 1)
        xg = tl.reshape(x, [BLOCK_T, G, GS])
        if AFFINE:
            scale, zero = _affine_meta(tl.min(xg, 2), tl.max(xg, 2), QMAX, META_BF16, CLIP)
            q = _round_codes(tl.math.div_rn(xg - zero[:, :, None], scale[:, :, None]), QMAX)
        else:
            scale = _symmetric_scale(tl.max(tl.abs(xg), 2), MID, META_BF16, CLIP)
            q = _round_codes(tl.math.div_rn(xg, scale[:, :, None]), QMAX) + MID
        q = tl.minimum(tl.maximum(q, 0.0), QMAX * 1.0).to(tl.int32)
        # planar packing: byte j holds codes j + k·NB in bits [k·b, (k+1)·b)
        q3 = tl.reshape(q, [BLOCK_T, K, NB])
        sh = tl.arange(0, K) * BITS
        packed = tl.sum(q3 << sh[None, :, None], 1)
        cptr = P8 + (page8 + OFF_CODES + tok * NB)[:, None] + tl.arange(0, NB)[None, :]
        tl.store(cptr, packed.to(tl.uint8), mask=ok[:, None])
        mptr = PV + (pagev + OFF_META // MB + tok * (G * F))[:, None] + (tl.arange(0, G) * F)[None, :]
        if META_BF16:
            tl.store(mptr, _bf16_rne(scale), mask=ok[:, None])
            if AFFINE:
                tl.store(mptr + 1, _bf16_rne(zero), mask=ok[:, None])
        else:
            tl.store(mptr, scale.to(tl.float16), mask=ok[:, None])
            if AFFINE:
                tl.store(mptr + 1, zero.to(tl.float16), mask=ok[:, None])


@triton.jit(do_not_specialize=["T", "stride_xc", "stride_xr"])
def _append_kernel(
    XC, XR, SLOTS, P8, PC16, PR16, T, stride_xc, stride_xr,
    D_C: tl.constexpr, D_R: tl.constexpr, PS: tl.constexpr, PAGE_BYTES: tl.constexpr,
    OFF_CC: tl.constexpr, OFF_RC: tl.constexpr, OFF_CM: tl.constexpr, OFF_RM: tl.constexpr,
    C_BITS: tl.constexpr, C_GS: tl.constexpr, C_AFFINE: tl.constexpr, C_FP8: tl.constexpr, C_MB: tl.constexpr,
    C_BF16: tl.constexpr,
    R_BITS: tl.constexpr, R_GS: tl.constexpr, R_AFFINE: tl.constexpr, R_FP8: tl.constexpr, R_MB: tl.constexpr,
    R_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr, R_WRITE: tl.constexpr = True, C_CLIP: tl.constexpr = 0, R_CLIP: tl.constexpr = 0,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tv = t < T
    slot = tl.load(SLOTS + t, mask=tv, other=-1).to(tl.int64)
    ok = tv & (slot >= 0)
    slot = tl.where(ok, slot, 0)
    page = slot // PS
    tok = slot % PS
    _write_path(XC, stride_xc, t, ok, P8, PC16, page, tok, PAGE_BYTES, OFF_CC, OFF_CM, D_C, C_BITS, C_GS, C_AFFINE, C_FP8,
                C_MB, C_BF16, BLOCK_T, C_CLIP)
    if R_WRITE:  # False: the RoPE path is grouped per page (_page_rope_kernel writes it)
        _write_path(XR, stride_xr, t, ok, P8, PR16, page, tok, PAGE_BYTES, OFF_RC, OFF_RM, D_R, R_BITS, R_GS, R_AFFINE,
                    R_FP8, R_MB, R_BF16, BLOCK_T, R_CLIP)


@triton.jit(do_not_specialize=["T", "stride_xr", "stride_stage"])
def _stage_rope_kernel(XR, SLOTS, ROWS, STAGE, T, stride_xr, stride_stage, D_R: tl.constexpr, PS: tl.constexpr):
    """stage[row_i, slot_i % PS] = k_rope_i for every token whose page this call leaves unfinished (the token
    at the page's last offset is not among the call's): the keys the next call's requantization of that page
    reads. Runs after _page_rope_kernel, which may still read the rows' older keys."""
    i = tl.program_id(0)
    slot = tl.load(SLOTS + i).to(tl.int64)
    if slot >= 0:
        off = slot % PS
        j = i + (PS - 1 - off)  # where the page's last token would stand in this call
        tail = tl.load(SLOTS + j, mask=j < T, other=-1).to(tl.int64)
        if tail != slot + (PS - 1 - off):
            row = tl.load(ROWS + i).to(tl.int64)
            d = tl.arange(0, D_R)
            x = tl.load(XR + i.to(tl.int64) * stride_xr + d)
            tl.store(STAGE + row * stride_stage + off * D_R + d, x.to(STAGE.dtype.element_ty))


@triton.jit(do_not_specialize=["T", "stride_xr", "stride_stage"])
def _page_rope_kernel(
    XR, SLOTS, ROWS, STAGE, P8, PR, T, stride_xr, stride_stage,
    D_R: tl.constexpr, PS: tl.constexpr, PAGE_BYTES: tl.constexpr, OFF_RC: tl.constexpr, OFF_PM: tl.constexpr,
    BLK: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, AFFINE: tl.constexpr, MB: tl.constexpr,
    META_BF16: tl.constexpr, CLIP: tl.constexpr = 0,
):
    """Requantize a page's RoPE path over its tokens so far: one program per token, active for the last token
    of its page among this call's tokens (a page's tokens come contiguous and in position order). The page's
    first n = offset + 1 keys are this call's tokens where they are among them, the stage's (earlier calls')
    otherwise; it computes each group's (scale, zero) per block of BLK tokens over the block's tokens among them
    (groups of GS channels, every token of the block) and writes the n tokens' codes and the metadata sets of
    the blocks holding tokens ([PS / BLK, G, F] at OFF_PM), by the rules of ``quant.groupwise.quantize_page``
    (rounded metadata, IEEE division, round half to even)."""
    i = tl.program_id(0)
    slot = tl.load(SLOTS + i).to(tl.int64)
    nxt = tl.load(SLOTS + i + 1, mask=i + 1 < T, other=-1).to(tl.int64)
    last = (slot >= 0) & ((nxt < 0) | (nxt // PS != slot // PS))
    if last:
        NB: tl.constexpr = D_R * BITS // 8
        K: tl.constexpr = 8 // BITS
        G: tl.constexpr = D_R // GS
        S: tl.constexpr = PS // BLK  # metadata sets of the page
        QMAX: tl.constexpr = (1 << BITS) - 1
        MID: tl.constexpr = 1 << (BITS - 1)
        page = slot // PS
        n = slot % PS + 1
        row = tl.load(ROWS + i).to(tl.int64)
        t = tl.arange(0, PS)
        ok = t < n
        d = tl.arange(0, D_R)
        src = i - (n - 1) + t  # the call's token that would hold offset t of this page
        here = ok & (src >= 0) & (tl.load(SLOTS + src, mask=ok & (src >= 0), other=-1).to(tl.int64) == page * PS + t)
        x_new = tl.load(XR + src.to(tl.int64)[:, None] * stride_xr + d[None, :], mask=here[:, None], other=0.0)
        x_old = tl.load(STAGE + row * stride_stage + t[:, None] * D_R + d[None, :], mask=(ok & ~here)[:, None], other=0.0)
        x = tl.where(here[:, None], x_new.to(tl.float32), x_old.to(tl.float32))
        x4 = tl.reshape(x, [S, BLK, G, GS])
        ok4 = tl.reshape(tl.broadcast_to(ok[:, None], [PS, D_R]), [S, BLK, G, GS])
        if AFFINE:
            lo = tl.min(tl.min(tl.where(ok4, x4, float("inf")), 3), 1)  # [S, G]
            hi = tl.max(tl.max(tl.where(ok4, x4, float("-inf")), 3), 1)
            scale, zero = _affine_meta(lo, hi, QMAX, META_BF16, CLIP)
            q = _round_codes(tl.math.div_rn(x4 - zero[:, None, :, None], scale[:, None, :, None]), QMAX)
        else:
            scale = _symmetric_scale(tl.max(tl.max(tl.where(ok4, tl.abs(x4), 0.0), 3), 1), MID, META_BF16, CLIP)
            q = _round_codes(tl.math.div_rn(x4, scale[:, None, :, None]), QMAX) + MID
        q = tl.minimum(tl.maximum(q, 0.0), QMAX * 1.0).to(tl.int32)
        q3 = tl.reshape(q, [PS, K, NB])  # planar packing, as _write_path
        packed = tl.sum(q3 << (tl.arange(0, K) * BITS)[None, :, None], 1)
        cptr = P8 + page * PAGE_BYTES + OFF_RC + t[:, None] * NB + tl.arange(0, NB)[None, :]
        tl.store(cptr, packed.to(tl.uint8), mask=ok[:, None])
        F: tl.constexpr = 2 if AFFINE else 1
        sets = tl.arange(0, S)
        held = (sets * BLK < n)[:, None]  # the blocks holding tokens
        mset = page * (PAGE_BYTES // MB) + OFF_PM // MB + sets * (G * F)  # [S] each set's first element in PR
        mptr = PR + mset[:, None] + (tl.arange(0, G) * F)[None, :]
        if META_BF16:
            tl.store(mptr, _bf16_rne(scale), mask=held)
            if AFFINE:
                tl.store(mptr + 1, _bf16_rne(zero), mask=held)
        else:
            tl.store(mptr, scale.to(tl.float16), mask=held)
            if AFFINE:
                tl.store(mptr + 1, zero.to(tl.float16), mask=held)
