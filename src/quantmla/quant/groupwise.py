"""Per-token channel-group quantizers (affine, symmetric, FP8 e4m3) and their fake-quant.

Shapes: inputs are ``[..., D]`` with channels last; groups are ``D / group_size`` contiguous
channel blocks of one token. Codes are packed with :mod:`quantmla.quant.packing`; metadata is
``[..., G, fields]`` in the format's meta dtype (fields = (scale, zero) for affine, (scale,) else).
Codes are computed against the *stored* (rounded) scale and zero, so dequantization here, in the
cache and in the kernels agree bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quantmla.errors import MetadataRangeError, NonFiniteError
from quantmla.quant.format import PathFormat
from quantmla.quant.packing import pack, unpack

FP8_MAX = 448.0  # largest finite float8_e4m3fn


class Quantized(NamedTuple):
    """A quantized path: packed codes uint8 [..., code_bytes], metadata [..., G, fields]."""

    codes: torch.Tensor
    meta: torch.Tensor


def check_finite(x: torch.Tensor, what: str = "activations") -> None:
    if not torch.isfinite(x).all():
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise NonFiniteError(
            f"{what} contain {n_nan} NaN and {n_inf} Inf values and cannot be quantized; "
            "check the model's dtype (fp16 overflow?) and its inputs"
        )


def check_meta_range(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: PathFormat) -> None:
    """Raise MetadataRangeError where a group's stored scale or zero point (already rounded to the metadata dtype)
    is not finite: fp16 metadata holds magnitudes up to 65504, so groups of values beyond it would dequantize to NaN."""
    bad = ~torch.isfinite(scale)
    if zero is not None:
        bad |= ~torch.isfinite(zero)
    if bad.any():
        n = int(bad.sum())
        fix = ("store this path's metadata as bfloat16 or float32 (the format's meta_dtype), or check the model's "
               "activations" if fmt.meta_dtype == "float16" else "check the model's activations (fp16 overflow?)")
        raise MetadataRangeError(
            f"{n} group{'s' if n > 1 else ''} with a scale or zero point past {fmt.meta_dtype} metadata's range "
            f"(largest |value| {float(x.abs().amax()):.4g}; float16 holds up to 65504): {fix}")


def grouped(x: torch.Tensor, fmt: PathFormat) -> torch.Tensor:
    """x [..., D] -> fp32 [..., D / group_size, group_size]."""
    D = x.shape[-1]
    fmt.check_dim(D)
    return x.float().reshape(*x.shape[:-1], D // fmt.group_size, fmt.group_size)


def _divisor(like: torch.Tensor, value: float) -> torch.Tensor:
    """`value` as a 0-dim tensor on `like`'s device: CUDA divides by a Python number through its
    reciprocal (1 ulp off), by a tensor exactly, as the kernels (div_rn) and the CPU do."""
    return torch.tensor(float(value), dtype=torch.float32, device=like.device)


def to_meta(t: torch.Tensor, mdt: torch.dtype, rounding: str = "nearest") -> torch.Tensor:
    """fp32 `t` as a value the metadata dtype `mdt` holds, returned as fp32: the nearest (ties to even), the
    nearest at or below t (``"down"``) or at or above it (``"up"``); inf where t rounds past the dtype's range.
    fp32 metadata keeps t as it is."""
    if mdt == torch.float32:
        return t
    r = t.to(mdt)
    finite = torch.isfinite(r)  # past the dtype's range it stays inf, for check_meta_range to refuse
    if rounding == "down":
        r = torch.where(finite & (r.float() > t), torch.nextafter(r, torch.full_like(r, -torch.inf)), r)
    elif rounding == "up":
        r = torch.where(finite & (r.float() < t), torch.nextafter(r, torch.full_like(r, torch.inf)), r)
    elif rounding != "nearest":
        raise ValueError(f"rounding must be 'nearest', 'down' or 'up', got {rounding!r}")
    return r.float()


def group_scales(xg: torch.Tensor, fmt: PathFormat, ste: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stored scale (and zero, affine formats) per group of xg [..., G, group_size], as fp32 [..., G, 1] holding
    values of the meta dtype. An affine group's zero is rounded down and its scale up, so the stored grid
    [zero, zero + (2^b - 1)·scale] still spans the group's [min, max] (rounding the zero to nearest would clamp the
    low values of a group far from 0, by up to half an ulp of the zero); a symmetric integer scale is rounded up, so
    ±amax stays within the codes, an e4m3 one to nearest.
    ``ste``: the roundings pass gradients straight through (calibration's fake quantizer)."""
    mdt = fmt.torch_meta_dtype

    def stored(t: torch.Tensor, rounding: str = "nearest") -> torch.Tensor:
        r = to_meta(t, mdt, rounding)
        return t + (r - t).detach() if ste else r

    k = fmt.clip_exp  # clip = 1 - 2^-k: shrinking by a power of two of the width rounds once, on any device
    if fmt.mode == "affine":
        lo = xg.amin(-1, keepdim=True)
        hi = xg.amax(-1, keepdim=True)
        if k:
            t = (hi - lo) * 2.0 ** -(k + 1)  # (1 - clip) / 2 of the width, exact
            lo, hi = lo + t, hi - t
        zero = stored(lo, "down")
        scale = stored((hi - zero) / _divisor(xg, 2**fmt.bits - 1), "up")
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: codes 0, exact
        return scale, zero
    amax = xg.abs().amax(-1, keepdim=True)
    if k:
        amax = amax - amax * 2.0**-k
    top = FP8_MAX if fmt.mode == "fp8" else 2 ** (fmt.bits - 1) - 1
    # integer codes: rounded up, so the largest magnitude stays within the codes (rounded down, it saturated by up to a
    # metadata ulp of the scale, 9 % of amax for subnormal fp16 scales); e4m3 codes saturate nowhere near FP8_MAX
    scale = stored(amax / _divisor(xg, top), "nearest" if fmt.mode == "fp8" else "up")
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, None


def quantize(x: torch.Tensor, fmt: PathFormat) -> Quantized:
    """x: [..., D] float -> packed codes and metadata. Raises NonFiniteError on NaN/Inf, MetadataRangeError where
    a group's scale or zero point overflows the metadata dtype."""
    if not fmt.quantized:
        raise ValueError("a 16-bit format stores values unquantized; nothing to quantize")
    if fmt.per_page:
        raise ValueError(f"{fmt.describe()} groups channels over a page's tokens, not per token: use quantize_page")
    check_finite(x)
    xg = grouped(x, fmt)
    scale, zero = group_scales(xg, fmt)
    check_meta_range(x, scale, zero, fmt)
    mdt = fmt.torch_meta_dtype
    if fmt.mode == "fp8":
        y = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        codes = y.view(torch.uint8).reshape(*x.shape)
        return Quantized(codes, scale.to(mdt))
    qmax = 2**fmt.bits - 1
    if fmt.mode == "affine":
        q = torch.round((xg - zero) / scale).clamp(0, qmax)
        meta = torch.cat([scale, zero], dim=-1).to(mdt)
    else:
        mid = 2 ** (fmt.bits - 1)
        q = (torch.round(xg / scale) + mid).clamp(0, qmax)
        meta = scale.to(mdt)
    codes = pack(q.to(torch.uint8).reshape(*x.shape), fmt.bits)
    return Quantized(codes, meta)


def quantize_page(x: torch.Tensor, fmt: PathFormat) -> Quantized:
    """Pages of tokens x [..., n, D] -> packed codes uint8 [..., n, code_bytes] and metadata for a per-page
    format (``fmt.grouping == "page"``): a group is `group_size` channels over the tokens of one metadata set.
    Block 0: one set over the page's n tokens, metadata [..., G, fields]. Block b: a set per b tokens, the
    last (unfinished) one over the tokens it holds, metadata [..., ceil(n / b), G, fields].
    Scales and codes follow :func:`quantize`'s rules (grouping the transposed page [G, group_size·n] per token
    gives the same values). The one quantizer of per-page groups: the paged cache's writer and the evaluation
    cache (``cache.rope_channel.quantize_pages``) both use it."""
    if not fmt.per_page or fmt.mode not in ("affine", "symmetric"):
        raise ValueError(f"quantize_page takes a per-page integer format, got {fmt.describe()}")
    check_finite(x)
    *lead, n, D = x.shape
    fmt.check_dim(D)
    b = fmt.block or n
    sets = -(-n // b)
    xf = x.float()
    if sets * b != n:  # the unfinished block padded with its last token: its range stays as it is
        xf = torch.cat([xf, xf[..., -1:, :].expand(*lead, sets * b - n, D)], dim=-2)
    xf = xf.reshape(*lead, sets, b, D)
    G, gs = D // fmt.group_size, fmt.group_size
    xg = xf.reshape(*lead, sets, b, G, gs).movedim(-3, -2).reshape(*lead, sets, G, b * gs)  # a group's values
    scale, zero = group_scales(xg, fmt)  # [..., sets, G, 1]
    check_meta_range(x, scale, zero, fmt)
    scale_c, zero_c = (None if t is None else _per_channel(t, gs) for t in (scale, zero))
    qmax = 2**fmt.bits - 1
    if fmt.mode == "affine":
        q = torch.round((xf - zero_c) / scale_c).clamp(0, qmax)
        meta = torch.cat([scale, zero], dim=-1)
    else:
        mid = 2 ** (fmt.bits - 1)
        q = (torch.round(xf / scale_c) + mid).clamp(0, qmax)
        meta = scale
    codes = pack(q.to(torch.uint8), fmt.bits).reshape(*lead, sets * b, -1)[..., :n, :]
    meta = meta.to(fmt.torch_meta_dtype)
    return Quantized(codes, meta if fmt.block else meta.squeeze(-3))


def dequantize_page(q: Quantized, fmt: PathFormat, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_page`: codes [..., n, code_bytes] and metadata [..., G, fields] (block 0) or
    [..., ceil(n / block), G, fields] -> [..., n, dim]."""
    codes = unpack(q.codes, fmt.bits, dim).float()
    n = codes.shape[-2]
    meta = q.meta.float() if fmt.block else q.meta.float().unsqueeze(-3)  # [..., sets, G, fields]

    def rows(t: torch.Tensor) -> torch.Tensor:  # [..., sets, G, 1] -> [..., 1, dim] (block 0) or [..., n, dim]
        r = t.expand(*t.shape[:-1], fmt.group_size).flatten(-2)
        return r.repeat_interleave(fmt.block, dim=-2)[..., :n, :] if fmt.block else r

    scale = rows(meta[..., 0:1])
    if fmt.mode == "affine":
        out = codes * scale + rows(meta[..., 1:2])
    else:
        out = (codes - 2 ** (fmt.bits - 1)) * scale
    return out.to(dtype)


def _per_channel(t: torch.Tensor, gs: int) -> torch.Tensor:
    """A per-group value [..., G, 1] as a per-channel row [..., 1, G·gs]."""
    return t.expand(*t.shape[:-1], gs).reshape(*t.shape[:-2], 1, -1)


def dequantize(q: Quantized, fmt: PathFormat, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize`: -> [..., dim] in `dtype` (computed in fp32)."""
    meta = q.meta.float()
    lead = q.codes.shape[:-1]
    scale = meta[..., 0:1]
    if fmt.mode == "fp8":
        vals = q.codes.view(torch.float8_e4m3fn).float().reshape(*lead, -1, fmt.group_size)
        return (vals * scale).reshape(*lead, dim).to(dtype)
    codes = unpack(q.codes, fmt.bits, dim).float().reshape(*lead, -1, fmt.group_size)
    if fmt.mode == "affine":
        out = codes * scale + meta[..., 1:2]
    else:
        out = (codes - 2 ** (fmt.bits - 1)) * scale
    return out.reshape(*lead, dim).to(dtype)


def quantize_dequantize(x: torch.Tensor, fmt: PathFormat) -> torch.Tensor:
    """Round trip through the stored format, same dtype and shape as x (identity for 16 bits)."""
    if not fmt.quantized:
        return x
    return dequantize(quantize(x, fmt), fmt, x.shape[-1], x.dtype)


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt):
        return quantize_dequantize(x, fmt)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quant(x: torch.Tensor, fmt: PathFormat) -> torch.Tensor:
    """Quantize-dequantize with a straight-through gradient (identity backward)."""
    if not fmt.quantized:
        return x
    return _FakeQuantSTE.apply(x, fmt)
