"""A fake quantizer for calibration: forward equal to the cache's round trip, useful gradients.

:func:`quantmla.quant.fake_quant` passes gradients straight through the whole round trip, so a
transform learned with it never sees that widening a group's range coarsens every channel of the
group. Here only the rounding steps are straight-through; the group scale and zero point stay
functions of the group's min / max (or abs-max), as in LSQ-style quantization-aware training.
Affine and symmetric integer formats; FP8 and 16-bit fall back to the plain STE.
The forward equals :func:`quantmla.quant.quantize_dequantize` bit for bit (tested).
"""

from __future__ import annotations

import torch

from quantmla.quant import PathFormat, fake_quant
from quantmla.quant.groupwise import group_scales, grouped


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


def fake_quant_lsq(x: torch.Tensor, fmt: PathFormat) -> torch.Tensor:
    """x [..., D] -> quantize-dequantize(x) in fp32, differentiable through the group scale/zero
    (the stored format's own scale math, ``groupwise.group_scales``, with straight-through roundings)."""
    if not fmt.quantized or fmt.mode == "fp8":
        return fake_quant(x.float(), fmt)
    xg = grouped(x, fmt)
    scale, zero = group_scales(xg, fmt, ste=True)
    qmax = 2**fmt.bits - 1
    if fmt.mode == "affine":
        q = _round_ste((xg - zero) / scale).clamp(0, qmax)
        out = q * scale + zero
    else:
        mid = 2 ** (fmt.bits - 1)
        q = (_round_ste(xg / scale) + mid).clamp(0, qmax)
        out = (q - mid) * scale
    return out.reshape(x.shape)
