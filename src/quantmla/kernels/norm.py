"""RMSNorm in one kernel a call (Triton), the arithmetic of the MLA families' own modules:

    y = weight * (x * rsqrt(mean(x², -1) + eps)).to(x.dtype)        (x.float() inside, as theirs)

In a decode step the model's RMSNorm modules (two a layer, three with the latent's, one more with q_lora) run as
eight small kernels each (two casts, pow, mean, add, rsqrt, two products); here one reads x and writes y.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, BF16: tl.constexpr, OUT: tl.constexpr):
    """fp32 -> the output dtype, to nearest even (bf16 by its bits: the interpreter's cast truncates)."""
    if BF16:
        u = x.to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(OUT)


@triton.jit
def rms_normed(x, w, N, eps, BF16: tl.constexpr, OUT: tl.constexpr):
    """The families' RMSNorm of fp32 rows x [..., BLOCK] (N real channels, the rest zeros) by weight w (fp32, the
    same last axis): x·rsqrt(mean(x²) + eps) rounded to the output dtype first, as theirs, then times w, rounded
    again. The one copy of this arithmetic (the norm kernel, ``kernels.rope``'s latent norm)."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) / N + eps)
    h = _round(x * rstd, BF16, OUT).to(tl.float32)
    return _round(w * h, BF16, OUT)


@triton.jit
def rms_norm_row(X, W, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr, BF16: tl.constexpr):
    """Row ``program_id(0)`` of X [rows, N] (row stride stride_x) normed by W [N] into Y (row stride stride_y)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, rms_normed(x, w, N, eps, BF16, Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_x", "stride_y"])
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr, BF16: tl.constexpr):
    rms_norm_row(X, W, Y, stride_x, stride_y, N, eps, BLOCK, BF16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()², -1) + eps)).to(x.dtype)`` over the last dim.

    x: [..., N] with its last dim contiguous (rows may be strided, e.g. a slice of a wider projection);
    weight: [N], the same dtype as x. Returns a new contiguous tensor shaped as x."""
    N = x.shape[-1]
    if weight.shape != (N,) or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} {weight.dtype} does not match x [..., {N}] {x.dtype}")
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.stride(0), y.stride(0), N, float(eps),
                                         BLOCK=triton.next_power_of_2(N), BF16=x.dtype == torch.bfloat16,
                                         num_warps=4 if N <= 2048 else 8)
    return y.view(x.shape)
