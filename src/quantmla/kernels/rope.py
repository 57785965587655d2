"""RoPE of a step's query and key pieces in one kernel (Triton), the arithmetic of the families' own functions.

A query's RoPE part q [N, H, d_r] and the shared key k [N, d_r] (both may be strided views of the projections'
outputs) are rotated by the angles of their tokens and written contiguous. Channel j of the output is

    y[j] = x[j]·C[j] + sign[j]·x[partner(j)]·S[j]

in one of three conventions (``mode``), as the transformers functions compute them:

- ``"pairs"`` (deepseek_v2's ``apply_rotary_emb``): channels (2i, 2i + 1) are one complex number times
  e^{iθ_i}; C = cos θ_i, S = sin θ_i of pair i, partner j ^ 1, sign −1 on even j; fp32, rounded once;
- ``"half"`` (``apply_rotary_pos_emb``): ``x·cos + rotate_half(x)·sin`` with partner (j + d_r/2) mod d_r, sign −1
  on the first half; each product and the sum rounded to x's dtype, as torch's three kernels round;
- ``"interleave"`` (``apply_rotary_pos_emb_interleave``): "half" on the channels first reordered so that
  (2i, 2i + 1) go to (i, i + d_r/2).

In a decode step this is one launch where the families' functions take six (two casts to fp32, the products and
two casts back, per piece).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantmla.kernels.norm import _round, rms_normed

MODES = ("pairs", "half", "interleave")


@triton.jit
def _source(j, D: tl.constexpr, MODE: tl.constexpr):
    """The input channel that output channel j reads (the interleaved layout's reorder; identity otherwise)."""
    if MODE == 2:
        return tl.where(j < D // 2, 2 * j, 2 * (j - D // 2) + 1)
    else:
        return j


@triton.jit
def _latent_norm(LAT, NW, YL, t0, N, stride_lt, eps, DC, BLOCK_C: tl.constexpr, TB: tl.constexpr, BF16: tl.constexpr):
    """RMSNorm of the DC-wide latents of tokens [t0, t0 + TB), ``kernels.norm.rms_normed`` (BLOCK_C: DC rounded up to
    a power of two)."""
    t = t0 + tl.arange(0, TB)[:, None]
    c = tl.arange(0, BLOCK_C)[None, :]
    live = (t < N) & (c < DC)
    x = tl.load(LAT + t * stride_lt + c, mask=live, other=0.0).to(tl.float32)
    w = tl.load(NW + c, mask=c < DC, other=0.0).to(tl.float32)
    tl.store(YL + t * DC + c, rms_normed(x, w, DC, eps, BF16, YL.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["N", "stride_qt", "stride_qh", "stride_kt", "stride_ct", "stride_st", "stride_lt"])
def _rope_kernel(Q, K, COS, SIN, YQ, YK, LAT, NW, YL, N, H, stride_qt, stride_qh, stride_kt, stride_ct, stride_cj,
                 stride_st, stride_sj, stride_lt, eps, DC, D: tl.constexpr, MODE: tl.constexpr, TB: tl.constexpr,
                 HB: tl.constexpr, BF16: tl.constexpr, BLOCK_C: tl.constexpr, NORM: tl.constexpr):
    """Program (token block, head block): TB tokens x HB heads of q, where "head" H is the key k; with NORM, the last
    column of programs normalizes the TB tokens' latents instead."""
    if NORM and tl.program_id(1) == tl.num_programs(1) - 1:
        _latent_norm(LAT, NW, YL, tl.program_id(0).to(tl.int64) * TB, N, stride_lt, eps, DC, BLOCK_C, TB, BF16)
    else:
        _rotate(Q, K, COS, SIN, YQ, YK, N, H, stride_qt, stride_qh, stride_kt, stride_ct, stride_cj, stride_st,
                stride_sj, D, MODE, TB, HB, BF16)


@triton.jit
def _rotate(Q, K, COS, SIN, YQ, YK, N, H, stride_qt, stride_qh, stride_kt, stride_ct, stride_cj, stride_st, stride_sj,
            D: tl.constexpr, MODE: tl.constexpr, TB: tl.constexpr, HB: tl.constexpr, BF16: tl.constexpr):
    """TB tokens x HB heads of q rotated (program (token block, head block)), where "head" H is the key k."""
    r = tl.arange(0, TB * HB)[:, None]  # [TB·HB, 1] rows: (token, head)
    t = tl.program_id(0).to(tl.int64) * TB + r // HB
    h = tl.program_id(1) * HB + r % HB
    j = tl.arange(0, D)[None, :]  # [1, D] output channels
    live = (h <= H) & (t < N)
    is_k = h == H
    if MODE == 0:
        partner = j ^ 1
        sign = tl.where((j & 1) == 0, -1.0, 1.0)
        cj = j // 2
    else:
        partner = (j + D // 2) % D
        sign = tl.where(j < D // 2, -1.0, 1.0)
        cj = j
    c = tl.load(COS + t * stride_ct + cj * stride_cj, mask=live).to(tl.float32)
    s = tl.load(SIN + t * stride_st + cj * stride_sj, mask=live).to(tl.float32)
    src, src_p = _source(j, D, MODE), _source(partner, D, MODE)
    hq = tl.where(is_k, 0, h)
    row = tl.where(is_k, K + t * stride_kt, Q + t * stride_qt + hq * stride_qh)  # [TB·HB, 1] pointers
    x = tl.load(row + src, mask=live).to(tl.float32)
    xp = tl.load(row + src_p, mask=live).to(tl.float32)
    if MODE == 0:  # fp32 complex product, one rounding
        y = _round(x * c + sign * xp * s, BF16, YQ.dtype.element_ty)
    else:  # x·cos, rotate_half(x)·sin and their sum each rounded to the dtype
        a = _round(x * c, BF16, YQ.dtype.element_ty).to(tl.float32)
        b = _round(sign * xp * s, BF16, YQ.dtype.element_ty).to(tl.float32)
        y = _round(a + b, BF16, YQ.dtype.element_ty)
    tl.store(YQ + (t * H + hq) * D + j, y, mask=live & ~is_k)
    tl.store(YK + t * D + j, y, mask=live & is_k)


def rope_rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [N, H, d_r] and k [N, d_r] (last dim contiguous, rows and heads strided) by per-token tables cos,
    sin [N, d_r] ("half", "interleave", any float dtype) or [N, d_r / 2] ("pairs", fp32 cos θ and sin θ of each
    pair; strided views, e.g. of ``view_as_real(freqs_cis)``). Returns (q, k) rotated, new contiguous tensors in
    q's dtype."""
    return _launch(q, k, cos, sin, mode, None)[:2]


def norm_and_rotate(latent: torch.Tensor, weight: torch.Tensor, eps: float, q: torch.Tensor, k: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.norm.rms_norm(latent, weight, eps)`` and ``rope_rotate(q, k, cos, sin, mode)`` in one launch (a
    decode step's latent norm and RoPE, which read the same projection). latent [N, d_c] (rows strided, channels
    contiguous), weight [d_c] in its dtype. Returns (latent normed, q, k), new contiguous tensors."""
    N, D = latent.shape
    if weight.shape != (D,) or weight.dtype != latent.dtype or latent.dtype != q.dtype:
        raise ValueError(f"norm_and_rotate: weight {tuple(weight.shape)} {weight.dtype} and latent "
                         f"{tuple(latent.shape)} {latent.dtype} do not match each other and q's {q.dtype}")
    if latent.stride(-1) != 1 or N != q.shape[0]:
        raise ValueError(f"norm_and_rotate: latent [{N}, {D}] needs contiguous channels and the {q.shape[0]} tokens "
                         "of q")
    return _launch(q, k, cos, sin, mode, (latent, weight, float(eps)), "norm_and_rotate")


def _launch(q, k, cos, sin, mode, norm, name="rope_rotate"):
    if mode not in MODES:
        raise ValueError(f"{name}: mode {mode!r} is not one of {MODES}")
    N, H, D = q.shape
    width = D // 2 if mode == "pairs" else D
    if k.shape != (N, D) or k.dtype != q.dtype:
        raise ValueError(f"{name}: k {tuple(k.shape)} {k.dtype} does not match q {tuple(q.shape)} {q.dtype}")
    if cos.shape != (N, width) or sin.shape != (N, width):
        raise ValueError(f"{name}: cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} for {mode!r} should be [{N}, {width}]")
    if D & (D - 1) or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"{name}: d_r must be a power of two with the channels contiguous (d_r {D}, strides "
                         f"{q.stride()} and {k.stride()})")
    yq = torch.empty(N, H, D, dtype=q.dtype, device=q.device)
    yk = torch.empty(N, D, dtype=k.dtype, device=k.device)
    lat, nw, eps = norm if norm is not None else (yk, yk, 0.0)  # (unread without NORM)
    yl = torch.empty(lat.shape, dtype=lat.dtype, device=lat.device) if norm is not None else yk
    if N:
        HB = min(32, triton.next_power_of_2(H + 1))  # heads (and the key) of a program
        # tokens of a program: one on a GPU (a [32, d_r] block keeps 16 values a thread in registers); the
        # interpreter runs programs one after another, so there it takes 256 rows at once
        TB = 1 if q.is_cuda else max(1, 256 // HB)
        _rope_kernel[(triton.cdiv(N, TB), triton.cdiv(H + 1, HB) + (norm is not None))](
            q, k, cos, sin, yq, yk, lat, nw, yl, N, H, q.stride(0), q.stride(1), k.stride(0), cos.stride(0),
            cos.stride(1), sin.stride(0), sin.stride(1), lat.stride(0), eps, lat.shape[-1], D=D, MODE=MODES.index(mode),
            TB=TB, HB=HB, BF16=q.dtype == torch.bfloat16, BLOCK_C=triton.next_power_of_2(lat.shape[-1]),
            NORM=norm is not None, num_warps=4)
    return (yq, yk) if norm is None else (yl, yq, yk)
