"""Inputs that probe a quantizer's rounding of its metadata."""

import torch


def far_groups(bits: int) -> torch.Tensor:
    """Groups of 32 far from 0 against their width (where a zero point rounded to nearest would sit above the group's
    minimum), and groups within an fp16 subnormal of 0 on either side: [8, 32] fp32."""
    g = torch.Generator().manual_seed(bits)
    at = torch.tensor([1002.5, -1003.7, 30004.0, -0.3, 1e-9, -1e-9, 0.0, 7.1])
    width = torch.tensor([1.0, 1.0, 1.0, 0.01, 1e-7, 1e-7, 3.0, 0.002])
    return at[:, None] + torch.rand(8, 32, generator=g) * width[:, None]
