"""Content-path transforms: rotate the normalized latent, then rescale its channels.

MLA's cached latent is ``c = RMSNorm(c_raw) ⊙ γ`` (times a constant ``latent_scale`` in
longcat_flash). For any orthogonal ``Q`` (d_c × d_c) and any nonzero ``γ'``:

    c' = RMSNorm(c_raw · Q) ⊙ γ' = c · T,        T = diag(1/γ) · Q · diag(γ')

because ``rms(x·Q) = rms(x)``. The model keeps its function when the up-projections absorb
``T⁻¹ = diag(1/γ') · Qᵀ · diag(γ)``:

    kv_a_proj_with_mqa (latent rows):  c_raw' = c_raw · Q      ->  W[:d_c] ← Qᵀ · W[:d_c],  b[:d_c] ← b[:d_c] · Q
    kv_a_layernorm:                    γ ← γ'
    kv_b_proj (W_UK and W_UV, all heads):  k = c · Wᵀ = c' · (T⁻¹ Wᵀ)  ->  W ← W · T⁻ᵀ

(``nn.Linear`` stores weights as ``[out, in]`` and computes ``x · Wᵀ + b``.)

Rotations: :func:`identity_rotation`, :func:`hadamard` (the QuaRot point; block-diagonal when d_c
is not a power of two), :func:`random_orthogonal`, and :class:`LearnedRotation` (the SpinQuant
point: ``Q = Q₀ · exp(A − Aᵀ)``, exactly orthogonal for any parameter value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantmla.errors import QuantMLAError


def identity_rotation(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.eye(d, dtype=dtype)


def _sylvester(n: int, dtype: torch.dtype) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def hadamard(d: int, block: int | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalized (orthogonal) Hadamard matrix of size d.

    d a power of two: the full Sylvester matrix (unless `block` is given). Otherwise a
    block-diagonal matrix of Sylvester blocks, the block being the largest power of two dividing
    d (or `block`, which must be a power of two dividing d)."""
    if d < 1:
        raise QuantMLAError(f"Hadamard size must be >= 1, got {d}")
    if block is None:
        block = d & (-d)  # largest power of two dividing d
    if block < 1 or block & (block - 1) or d % block:
        raise QuantMLAError(f"Hadamard block {block} must be a power of two dividing d = {d}")
    if block == 1 and d > 1:
        raise QuantMLAError(f"d = {d} is odd: no Hadamard rotation (block-diagonal or not) exists; use a learned rotation")
    h = _sylvester(block, dtype)
    return torch.block_diag(*([h] * (d // block))) if d > block else h


def random_orthogonal(d: int, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A Haar-random orthogonal matrix (QR of a Gaussian with the sign convention fixed)."""
    a = torch.randn(d, d, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))
    return q.to(dtype)


class LearnedRotation(torch.nn.Module):
    """``Q = Q₀ · matrix_exp(A − Aᵀ)``: orthogonal for every ``A``; ``A = 0`` gives ``Q₀``."""

    def __init__(self, base: torch.Tensor):
        super().__init__()
        d = base.shape[0]
        self.register_buffer("base", base.detach().clone().float())
        self.generator = torch.nn.Parameter(torch.zeros(d, d))

    def forward(self) -> torch.Tensor:
        skew = self.generator - self.generator.T
        return self.base @ torch.linalg.matrix_exp(skew)


@dataclass
class ContentTransform:
    """Q: orthogonal [d_c, d_c]; gamma: the new kv_a_layernorm weight γ' [d_c] (nonzero)."""

    rotation: torch.Tensor
    gamma: torch.Tensor

    def __post_init__(self):
        d = self.gamma.shape[-1]
        if self.rotation.shape != (d, d):
            raise QuantMLAError(f"content rotation must be [{d}, {d}] to match γ' [{d}], got {tuple(self.rotation.shape)}")
        if not torch.isfinite(self.gamma).all() or (self.gamma == 0).any():
            raise QuantMLAError("content rescale γ' must be finite and nonzero in every channel")
        if not torch.isfinite(self.rotation).all():
            raise QuantMLAError("content rotation holds NaN or Inf (a diverged fit?): it cannot be fused into weights")
        q = self.rotation.double()
        err = (q.T @ q - torch.eye(d, dtype=torch.float64, device=q.device)).abs().max().item()
        if not err <= 1e-4:
            raise QuantMLAError(f"content rotation is not orthogonal (max |QᵀQ − I| = {err:.2e})")

    @property
    def d_c(self) -> int:
        return self.gamma.shape[-1]

    @classmethod
    def identity(cls, gamma_old: torch.Tensor) -> "ContentTransform":
        return cls(identity_rotation(gamma_old.shape[-1]), gamma_old.detach().double().clone())

    @classmethod
    def hadamard_point(cls, gamma_old: torch.Tensor, block: int | None = None) -> "ContentTransform":
        """Q = Hadamard, γ' = rms(γ)·1: the rotated normalized latent has near-uniform channels, so the
        rescale is uniform and keeps the latent's overall magnitude."""
        g = gamma_old.detach().double()
        rms = g.pow(2).mean().sqrt().clamp_min(1e-12)
        return cls(hadamard(g.shape[-1], block), torch.full_like(g, float(rms)))

    def matrix(self, gamma_old: torch.Tensor) -> torch.Tensor:
        """T [d_c, d_c] with c' = c · T (float64)."""
        g = gamma_old.detach().double().to(self.rotation.device)
        return (1.0 / g)[:, None] * self.rotation.double() * self.gamma.double()[None, :]

    def inverse(self, gamma_old: torch.Tensor) -> torch.Tensor:
        """T⁻¹ = diag(1/γ') Qᵀ diag(γ) (float64)."""
        g = gamma_old.detach().double().to(self.rotation.device)
        return (1.0 / self.gamma.double())[:, None] * self.rotation.double().T * g[None, :]

    def to(self, dtype: torch.dtype) -> "ContentTransform":
        return ContentTransform(self.rotation.to(dtype), self.gamma.to(dtype))


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data.copy_(value.to(param.dtype))


@torch.no_grad()
def fuse_content(module: torch.nn.Module, d_c: int, transform: ContentTransform) -> None:
    """Fuse `transform` into one MLA attention module in place (math in float64).

    Changes kv_a_proj_with_mqa's latent rows (and bias), kv_a_layernorm.weight and kv_b_proj."""
    norm = module.kv_a_layernorm
    gamma_old = norm.weight.detach().double()
    if gamma_old.shape[-1] != d_c or transform.d_c != d_c:
        raise QuantMLAError(f"content transform of width {transform.d_c} for a latent of width {d_c}")
    if (gamma_old == 0).any():
        raise QuantMLAError("kv_a_layernorm has zero weights: the content transform T = diag(1/γ)·Q·diag(γ') is undefined")
    a = module.kv_a_proj_with_mqa
    dev = a.weight.device
    q = transform.rotation.double().to(dev)
    t_inv = transform.inverse(gamma_old).to(dev)
    w = a.weight.detach().double()
    w[:d_c] = q.T @ w[:d_c]
    _set(a.weight, w)
    if a.bias is not None:
        b = a.bias.detach().double()
        b[:d_c] = b[:d_c] @ q
        _set(a.bias, b)

    _set(norm.weight, transform.gamma.double().to(norm.weight.device))

    kvb = module.kv_b_proj
    if kvb.weight.shape[-1] != d_c:
        raise QuantMLAError(f"kv_b_proj takes {kvb.weight.shape[-1]} inputs, expected the latent width {d_c}")
    _set(kvb.weight, kvb.weight.detach().double() @ t_inv.T)
