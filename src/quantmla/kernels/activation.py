"""The gated MLP's activation in one kernel (Triton), the arithmetic of the transformers modules:

    y = (silu(gate) rounded to x's dtype) * up        (each in fp32, rounded to x's dtype)

from the output of the stacked gate and up projections, x = [gate | up] [..., 2I]. The modules' own
``act_fn(gate_proj(x)) * up_proj(x)`` is two kernels (SiLU, then the product), each reading and writing [..., I].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantmla.kernels.norm import _round


@triton.jit(do_not_specialize=["stride_x", "stride_y"])
def _silu_mul_kernel(X, Y, stride_x, stride_y, I, BLOCK: tl.constexpr, BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    s = _round(g / (1.0 + tl.exp(-g)), BF16, Y.dtype.element_ty).to(tl.float32)  # rounded first, as theirs
    tl.store(Y + row * stride_y + cols, _round(s * u, BF16, Y.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for x [..., 2I] (rows may be strided, the last dim contiguous), with the
    SiLU rounded to x's dtype before the product. Returns a new contiguous tensor [..., I] of x's dtype."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul: the last dim ({x.shape[-1]}) must hold gate and up halves of equal width")
    if not x.is_floating_point():
        raise ValueError(f"silu_mul: x must be a floating-point tensor, not {x.dtype}")
    I = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * I)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], I), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(max(I, 16)))
    if x2.shape[0] and I:
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(I, block))](x2, y, x2.stride(0), y.stride(0), I, BLOCK=block,
                                                               BF16=x.dtype == torch.bfloat16, num_warps=4)
    return y.view(*x.shape[:-1], I)
