"""Bit packing of integer codes into bytes.

2/4/8-bit codes use a *planar* layout: a row of ``D`` codes at ``b`` bits becomes ``D·b/8`` bytes,
byte ``j`` holding codes ``j + k·P`` in bits ``[k·b, (k+1)·b)`` for planes ``k = 0 .. 8/b − 1``,
``P = D·b/8``. Unpacking a plane is one shift and mask over contiguous channels, which is what the
decode kernels want. 3-bit codes pack 8 consecutive codes into 3 bytes (little-endian bit stream);
they are a CPU/accuracy format, not a kernel format.
"""

from __future__ import annotations

import torch

from quantmla.errors import UnsupportedFormatError


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: uint8 [..., D] with values < 2**bits -> uint8 [..., D·bits/8]."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    D = codes.shape[-1]
    if bits == 8:
        return codes.clone()
    if bits in (2, 4):
        per = 8 // bits
        if D % per:
            raise UnsupportedFormatError(f"{D} channels cannot be packed {per} per byte")
        planes = codes.reshape(*codes.shape[:-1], per, D // per).to(torch.int32)
        shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
        return (planes << shifts[:, None]).sum(dim=-2).to(torch.uint8)
    if bits == 3:
        if D % 8:
            raise UnsupportedFormatError(f"3-bit packing needs a multiple of 8 channels, got {D}")
        g = codes.reshape(*codes.shape[:-1], D // 8, 8).to(torch.int32)
        word = (g << (torch.arange(8, device=codes.device, dtype=torch.int32) * 3)).sum(-1)  # 24 bits
        out = torch.stack([(word >> s) & 0xFF for s in (0, 8, 16)], dim=-1)
        return out.reshape(*codes.shape[:-1], D * 3 // 8).to(torch.uint8)
    raise UnsupportedFormatError(f"cannot pack {bits}-bit codes; supported: 2, 3, 4, 8")


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 [..., dim·bits/8] -> uint8 [..., dim]."""
    if packed.shape[-1] != dim * bits // 8:
        raise ValueError(f"packed width {packed.shape[-1]} does not match {dim} channels at {bits} bits")
    if bits == 8:
        return packed.clone()
    if bits in (2, 4):
        per = 8 // bits
        shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
        planes = (packed.to(torch.int32).unsqueeze(-2) >> shifts[:, None]) & ((1 << bits) - 1)
        return planes.reshape(*packed.shape[:-1], dim).to(torch.uint8)
    if bits == 3:
        b = packed.reshape(*packed.shape[:-1], dim // 8, 3).to(torch.int32)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        codes = (word.unsqueeze(-1) >> (torch.arange(8, device=packed.device, dtype=torch.int32) * 3)) & 7
        return codes.reshape(*packed.shape[:-1], dim).to(torch.uint8)
    raise UnsupportedFormatError(f"cannot unpack {bits}-bit codes; supported: 2, 3, 4, 8")
