"""RoPE-path transforms: one complex scalar per frequency pair.

The cache holds the RoPE key after rotation; RoPE multiplies pair j (as a complex number
``k_j = k[a_j] + i·k[b_j]``) by ``exp(i·t·θ_j)``. A fixed linear map on the key fuses into the
weights only if it commutes with all those rotations, which (distinct θ_j) leaves exactly one
complex scalar per pair: ``k_j ← z_j · k_j``, scale ``|z_j|``, phase ``arg z_j``.

For the logits to stay exact the query pair is divided by ``conj(z_j)``:

    q'_j · k'_j = Re(conj(q_j / conj z_j) · z_j k_j) = Re(conj(q_j) k_j) = q_j · k_j

As real matrices acting on row vectors (``x ← x · M``): ``M`` is block-diagonal with
``[[a, b], [−b, a]]`` on the pair's (real, imag) channels (``z = a + i b``), the query gets
``M⁻ᵀ``. Fusion into ``nn.Linear`` weights (``y = x · Wᵀ``):

    kv_a_proj_with_mqa, RoPE rows:      W_KR ← Mᵀ · W_KR      (k' = k · M),  b ← b · M
    q_proj / q_b_proj, each head's RoPE rows:  W_QR ← M⁻¹ · W_QR   (q' = q · M⁻ᵀ)

in the checkpoint's *weight* pair layout (rotate-half pairs (j, j + d_r/2), interleaved pairs
(2j, 2j+1); deepseek_v2's complex RoPE is interleaved with the real part first). Families that
store interleaved weights but cache rotate-half keys map weight pair j to cache pair j, so the same
``z`` describes the transform in both layouts. ``layout="none"`` (NoPE MLA, kimi_linear) uses the
rotate-half pairing; with no rotation any pairing commutes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.errors import QuantMLAError
from quantmla.model.spec import pair_channels  # (real, imag) channels of each pair: the model's RoPE layout

__all__ = ["RopeTransform", "apply_pairs", "fuse_rope", "pair_channels"]


@dataclass
class RopeTransform:
    """z: complex [d_r/2], the per-pair scalar (k_j ← z_j k_j, q_j ← q_j / conj z_j)."""

    z: torch.Tensor

    def __post_init__(self):
        if not torch.is_complex(self.z):
            raise QuantMLAError("RopeTransform.z must be a complex tensor (one complex scalar per frequency pair)")
        if not torch.isfinite(torch.view_as_real(self.z)).all() or (self.z.abs() == 0).any():
            raise QuantMLAError("RoPE pair scalars must be finite and nonzero")

    @property
    def num_pairs(self) -> int:
        return self.z.shape[-1]

    @classmethod
    def identity(cls, num_pairs: int) -> "RopeTransform":
        return cls(torch.ones(num_pairs, dtype=torch.complex128))

    @classmethod
    def from_polar(cls, scale: torch.Tensor, phase: torch.Tensor | None = None) -> "RopeTransform":
        scale = scale.double()
        phase = torch.zeros_like(scale) if phase is None else phase.double()
        return cls(torch.polar(scale, phase))

    @property
    def scale(self) -> torch.Tensor:
        return self.z.abs()

    @property
    def phase(self) -> torch.Tensor:
        return self.z.angle()

    def key_matrix(self, d_r: int, layout: str) -> torch.Tensor:
        """M [d_r, d_r] (float64) with k' = k · M in `layout`."""
        self._check(d_r)
        ra, im = pair_channels(d_r, layout)
        a, b = self.z.real.double(), self.z.imag.double()
        m = torch.zeros(d_r, d_r, dtype=torch.float64, device=self.z.device)
        m[ra, ra], m[ra, im] = a, b
        m[im, ra], m[im, im] = -b, a
        return m

    def query_matrix(self, d_r: int, layout: str) -> torch.Tensor:
        """M⁻ᵀ [d_r, d_r] (float64) with q' = q · M⁻ᵀ: the pair scalar 1 / conj(z)."""
        return RopeTransform(1.0 / self.z.conj()).key_matrix(d_r, layout)

    def _check(self, d_r: int) -> None:
        if 2 * self.num_pairs != d_r:
            raise QuantMLAError(f"RoPE transform has {self.num_pairs} pairs but the RoPE dim is {d_r}")


def apply_pairs(x: torch.Tensor, z, layout: str) -> torch.Tensor:
    """Multiply each pair of x [..., d_r] (in `layout`) by z [..., d_r/2] (complex, or a (re, im)
    tuple of real tensors for autograd; leading dims broadcast): differentiable in x and z."""
    d_r = x.shape[-1]
    pair_channels(d_r, layout)  # validates
    zr, zi = (z.real, z.imag) if torch.is_tensor(z) and torch.is_complex(z) else z
    zr, zi = zr.to(x.dtype), zi.to(x.dtype)
    if layout == "interleaved":
        xa, xb = x[..., 0::2], x[..., 1::2]
    else:
        xa, xb = x[..., : d_r // 2], x[..., d_r // 2 :]
    oa, ob = xa * zr - xb * zi, xa * zi + xb * zr  # broadcasts x against z's leading dims
    if layout == "interleaved":
        return torch.stack([oa, ob], dim=-1).flatten(-2)
    return torch.cat([oa, ob], dim=-1)


@torch.no_grad()
def fuse_rope(module: torch.nn.Module, spec, transform: RopeTransform, q_linear: torch.nn.Linear) -> None:
    """Fuse `transform` into one MLA attention module in place (math in float64)."""
    d_c, d_r, d_n, heads = spec.d_c, spec.d_r, spec.d_n, spec.num_heads
    layout = spec.rope_weight_layout
    a = module.kv_a_proj_with_mqa
    m = transform.key_matrix(d_r, layout).to(a.weight.device)
    m_q = transform.query_matrix(d_r, layout).to(q_linear.weight.device)

    w = a.weight.detach().double()
    if w.shape[0] != d_c + d_r:
        raise QuantMLAError(f"kv_a_proj_with_mqa has {w.shape[0]} outputs, expected d_c + d_r = {d_c + d_r}")
    w[d_c:] = m.T @ w[d_c:]
    a.weight.data.copy_(w.to(a.weight.dtype))
    if a.bias is not None:
        b = a.bias.detach().double()
        b[d_c:] = b[d_c:] @ m
        a.bias.data.copy_(b.to(a.bias.dtype))

    wq = q_linear.weight.detach().double()
    per = d_n + d_r
    if wq.shape[0] != heads * per:
        raise QuantMLAError(f"query projection has {wq.shape[0]} outputs, expected heads·(d_n + d_r) = {heads * per}")
    wq = wq.view(heads, per, -1)
    wq[:, d_n:] = torch.einsum("rs,hsi->hri", m_q.T, wq[:, d_n:])
    q_linear.weight.data.copy_(wq.view(heads * per, -1).to(q_linear.weight.dtype))
    if q_linear.bias is not None:
        bq = q_linear.bias.detach().double().view(heads, per)
        bq[:, d_n:] = bq[:, d_n:] @ m_q
        q_linear.bias.data.copy_(bq.view(-1).to(q_linear.bias.dtype))
