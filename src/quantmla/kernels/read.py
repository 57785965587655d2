"""Triton kernel: read tokens back from their pages, dequantized (prefill chunks attend over them).

The inverse of ``append.py``: per token, unpack the planar codes and apply the group's scale (and zero
point) in fp32, like ``quant.groupwise.dequantize``; BF16 sections are copied. One launch reads both
paths of any number of tokens at arbitrary slots, in place of the torch reader's gather-and-unpack ops.
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantmla.kernels.decode import _e4m3_to_f32


@triton.jit
def _read_path(
    OUT, stride_o, t, ok, P8, PV, page, tok, PAGE_BYTES: tl.constexpr,
    OFF_CODES: tl.constexpr, OFF_META: tl.constexpr,
    D: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, AFFINE: tl.constexpr, FP8: tl.constexpr,
    MB: tl.constexpr, BLOCK_T: tl.constexpr, PAGE_META: tl.constexpr = 0,
):
    """Dequantize one path of BLOCK_T tokens into OUT. PAGE_META > 0: the integer path's group metadata is the
    page's (at OFF_META), one set of G·F elements per PAGE_META tokens; 0: the token's own."""
    optr = OUT + t.to(tl.int64)[:, None] * stride_o + tl.arange(0, D)[None, :]
    page8 = page * PAGE_BYTES
    pagev = page * (PAGE_BYTES // MB)  # PV: the pages in the path's MB-byte element type
    if BITS == 16:
        x = tl.load(PV + (pagev + OFF_CODES // 2 + tok * D)[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
        tl.store(optr, x.to(OUT.dtype.element_ty), mask=ok[:, None])
    elif FP8:
        G8: tl.constexpr = D // GS
        by = tl.load(P8 + (page8 + OFF_CODES + tok * D)[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0)
        v = tl.reshape(_e4m3_to_f32(by), [BLOCK_T, G8, GS])
        scale = tl.load(PV + (pagev + OFF_META // MB + tok * G8)[:, None] + tl.arange(0, G8)[None, :], mask=ok[:, None], other=0.0)
        x = v * scale.to(tl.float32)[:, :, None]
        tl.store(optr, tl.reshape(x, [BLOCK_T, D]).to(OUT.dtype.element_ty), mask=ok[:, None])
    else:
        NB: tl.constexpr = D * BITS // 8
        K: tl.constexpr = 8 // BITS
        F: tl.constexpr = 2 if AFFINE else 1
        G: tl.constexpr = D // GS
        QMAX: tl.constexpr = (1 << BITS) - 1
        MID: tl.constexpr = 1 << (BITS - 1)
        packed = tl.load(P8 + (page8 + OFF_CODES + tok * NB)[:, None] + tl.arange(0, NB)[None, :], mask=ok[:, None], other=0)
        sh = tl.arange(0, K) * BITS
        # planar packing: byte j holds codes j + k·NB in bits [k·b, (k+1)·b)
        q = (packed.to(tl.int32)[:, None, :] >> sh[None, :, None]) & QMAX  # [T, K, NB]
        q = tl.reshape(q, [BLOCK_T, G, GS]).to(tl.float32)
        row = tok // PAGE_META if PAGE_META else tok  # the token's metadata set
        mptr = PV + (pagev + OFF_META // MB + row * (G * F))[:, None] + (tl.arange(0, G) * F)[None, :]
        scale = tl.load(mptr, mask=ok[:, None], other=0.0).to(tl.float32)
        if AFFINE:
            zero = tl.load(mptr + 1, mask=ok[:, None], other=0.0).to(tl.float32)
            x = q * scale[:, :, None] + zero[:, :, None]
        else:
            x = (q - MID) * scale[:, :, None]
        tl.store(optr, tl.reshape(x, [BLOCK_T, D]).to(OUT.dtype.element_ty), mask=ok[:, None])


@triton.jit(do_not_specialize=["T", "stride_oc", "stride_or"])
def _read_kernel(
    OC, OR, SLOTS, P8, PC16, PR16, T, stride_oc, stride_or,
    D_C: tl.constexpr, D_R: tl.constexpr, PS: tl.constexpr, PAGE_BYTES: tl.constexpr,
    OFF_CC: tl.constexpr, OFF_RC: tl.constexpr, OFF_CM: tl.constexpr, OFF_RM: tl.constexpr,
    C_BITS: tl.constexpr, C_GS: tl.constexpr, C_AFFINE: tl.constexpr, C_FP8: tl.constexpr, C_MB: tl.constexpr,
    R_BITS: tl.constexpr, R_GS: tl.constexpr, R_AFFINE: tl.constexpr, R_FP8: tl.constexpr, R_MB: tl.constexpr,
    R_PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    slot = tl.load(SLOTS + t, mask=ok, other=0).to(tl.int64)
    page = slot // PS
    tok = slot % PS
    _read_path(OC, stride_oc, t, ok, P8, PC16, page, tok, PAGE_BYTES, OFF_CC, OFF_CM, D_C, C_BITS, C_GS, C_AFFINE, C_FP8, C_MB,
               BLOCK_T)
    _read_path(OR, stride_or, t, ok, P8, PR16, page, tok, PAGE_BYTES, OFF_RC, OFF_RM, D_R, R_BITS, R_GS, R_AFFINE, R_FP8, R_MB,
               BLOCK_T, R_PAGE)
