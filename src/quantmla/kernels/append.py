"""Triton kernel: quantize, pack and write tokens into their pages (prefill chunks or decode steps).

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
def _write_path(
    X, stride_x, t, ok, P8, PV, page, tok, PAGE_BYTES: tl.constexpr,
    OFF_CODES: tl.constexpr, OFF_META: tl.constexpr,
    D: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, AFFINE: tl.constexpr, FP8: tl.constexpr,
    MB: tl.constexpr, META_BF16: tl.constexpr, BLOCK_T: tl.constexpr,
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
            lo = tl.min(xg, 2)
            hi = tl.max(xg, 2)
            if META_BF16:
                zero = _bf16_rne(lo).to(tl.float32)
                scale = _bf16_rne(tl.math.div_rn(hi - zero, QMAX * 1.0)).to(tl.float32)
            else:
                zero = lo.to(tl.float16).to(tl.float32)
                scale = tl.math.div_rn(hi - zero, QMAX * 1.0).to(tl.float16).to(tl.float32)
            scale = tl.where(scale > 0.0, scale, 1.0)
            v = tl.math.div_rn(xg - zero[:, :, None], scale[:, :, None])
            v = tl.minimum(tl.maximum(v, -1.0), QMAX + 1.0)
            q = (v + _RNE_MAGIC) - _RNE_MAGIC
        else:
            amax = tl.max(tl.abs(xg), 2)
            if META_BF16:
                scale = _bf16_rne(tl.math.div_rn(amax, (MID - 1) * 1.0)).to(tl.float32)
            else:
                scale = tl.math.div_rn(amax, (MID - 1) * 1.0).to(tl.float16).to(tl.float32)
            scale = tl.where(scale > 0.0, scale, 1.0)
            v = tl.math.div_rn(xg, scale[:, :, None])
            v = tl.minimum(tl.maximum(v, -(MID + 1.0)), MID + 1.0)
            q = ((v + _RNE_MAGIC) - _RNE_MAGIC) + MID
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
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tv = t < T
    slot = tl.load(SLOTS + t, mask=tv, other=-1).to(tl.int64)
    ok = tv & (slot >= 0)
    slot = tl.where(ok, slot, 0)
    page = slot // PS
    tok = slot % PS
    _write_path(XC, stride_xc, t, ok, P8, PC16, page, tok, PAGE_BYTES, OFF_CC, OFF_CM, D_C, C_BITS, C_GS, C_AFFINE, C_FP8,
                C_MB, C_BF16, BLOCK_T)
    _write_path(XR, stride_xr, t, ok, P8, PR16, page, tok, PAGE_BYTES, OFF_RC, OFF_RM, D_R, R_BITS, R_GS, R_AFFINE, R_FP8,
                R_MB, R_BF16, BLOCK_T)
