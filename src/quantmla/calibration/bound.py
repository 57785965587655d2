r"""The bound from RoPE logit error to attention-output distortion.

Setting: one query (head i, position t) attends over keys u with full-precision logits ``s_u``,
probabilities ``p = softmax(s)`` and values ``v_u`` (any vector space; after o_proj a head's value
is ``c(u)·W_UV^(i)·W_O^(i)``), output ``o(s) = Σ_u p_u v_u``. Quantizing the RoPE key changes the
logits only: ``s → s + Δ`` with ``Δ_u = scale · q_i^R(t) · e(u)`` (RoPE never enters the values).

**Claim.** For every Δ (not only small ones)

    ‖o(s + Δ) − o(s)‖  ≤  ½ · diam(V) · sd_p(Δ) · κ(osc Δ)  ≤  ½ · diam(V) · sqrt(Σ_u p_u Δ_u²) · κ(osc Δ)

with ``diam(V) = max_{u,u'} ‖v_u − v_u'‖`` (over the keys the query sees), ``sd_p(Δ)`` the
standard deviation of Δ under p, ``osc Δ = max Δ − min Δ`` and ``κ(x) = (e^{x/2} − 1)/(x/2)``
(κ → 1 as x → 0; κ(1) = 1.30).

**Proof.** Let ``p_τ = softmax(s + τΔ)``. Then ``d/dτ o = Σ_u p_τ,u (Δ_u − E_{p_τ}Δ) v_u =
Cov_{p_τ}(Δ, v)``. For a unit vector w, Cauchy–Schwarz and Popoviciu's inequality (a variable
confined to an interval of length ℓ has variance ≤ ℓ²/4) give
``|Cov_{p_τ}(Δ, w·v)| ≤ sd_{p_τ}(Δ) · sd_{p_τ}(w·v) ≤ sd_{p_τ}(Δ) · ½ diam(V)``, so
``‖o(s+Δ) − o(s)‖ ≤ ½ diam(V) ∫₀¹ sd_{p_τ}(Δ) dτ``. Softmax is invariant to adding a constant to
Δ; with ``Δ̃ = Δ − min Δ ∈ [0, osc Δ]``, ``p_τ,u = p_u e^{τΔ̃_u} / Σ_w p_w e^{τΔ̃_w} ≤ p_u e^{τ osc Δ}``,
hence ``sd_{p_τ}(Δ)² ≤ E_{p_τ}[(Δ − m)²] ≤ e^{τ osc Δ} E_p[(Δ − m)²]`` for any constant m; take
m = E_p Δ: ``sd_{p_τ}(Δ) ≤ e^{τ osc Δ / 2} sd_p(Δ)``, and ``∫₀¹ e^{τx/2} dτ = κ(x)``. Finally
``sd_p(Δ)² = E_p Δ² − (E_p Δ)² ≤ E_p Δ²``. ∎

**What calibration minimizes.** Summed over heads and sampled queries,
``Σ_{i,t} Σ_u p_{i,t}(u) Δ_{i,t,u}² = Σ_u e(u)ᵀ A(u) e(u)`` with
``A(u) = scale² Σ_{i,t} p_{i,t}(u) q_i^R(t) q_i^R(t)ᵀ`` — the "attention"-weighted positional QK
objective (capture.py). By the claim and Cauchy–Schwarz over queries,

    Σ_{i,t} ‖Δo_{i,t}‖²  ≤  max_{i,t}(½ diam(V_{i,t}) κ_{i,t})² · Σ_u e(u)ᵀ A(u) e(u),

so driving this objective down drives down a bound on the output distortion; the uniform
weighting of docs/design.md §4 (every causal (t, u) pair counted once) relates to it only through
``Σ_u p_u Δ_u² ≤ (max_u p_u) · Σ_u Δ_u²``, which is loose where attention is peaked (sinks, recent
tokens) — exactly where RoPE errors hurt. The tests check the claim on random logits (small and
large perturbations) and on a model's captured attention with real INT-k RoPE errors.
"""

from __future__ import annotations

import torch


def kappa(x: torch.Tensor) -> torch.Tensor:
    """κ(x) = (e^{x/2} − 1)/(x/2), with κ(0) = 1."""
    h = x / 2
    small = h.abs() < 1e-6
    return torch.where(small, 1 + h / 2, torch.expm1(h) / torch.where(small, torch.ones_like(h), h))


def output_distortion_bound(scores: torch.Tensor, delta: torch.Tensor, values: torch.Tensor,
                            visible: torch.Tensor | None = None, centered: bool = True) -> torch.Tensor:
    """Right-hand side of the claim per query. scores, delta [..., T]; values [..., T, d] (or
    [T, d], shared); visible [..., T] bool (None: all). centered: sd_p(Δ) (else sqrt(E_p Δ²))."""
    scores, delta = scores.double(), delta.double()
    if visible is None:
        visible = torch.ones_like(scores, dtype=torch.bool)
    s = scores.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, -1)
    d0 = delta.masked_fill(~visible, 0.0)
    m2 = (p * d0 * d0).sum(-1)
    if centered:
        m2 = (m2 - (p * d0).sum(-1) ** 2).clamp_min(0)
    osc = delta.masked_fill(~visible, float("-inf")).amax(-1) - delta.masked_fill(~visible, float("inf")).amin(-1)
    v = values.double()
    if v.dim() == 2:
        v = v.expand(*scores.shape, v.shape[-1])
    dist = torch.cdist(v, v)  # [..., T, T]
    pair_vis = visible[..., :, None] & visible[..., None, :]
    diam = dist.masked_fill(~pair_vis, 0.0).amax(dim=(-1, -2))
    return 0.5 * diam * m2.sqrt() * kappa(osc)


def output_distortion(scores: torch.Tensor, delta: torch.Tensor, values: torch.Tensor,
                      visible: torch.Tensor | None = None) -> torch.Tensor:
    """Left-hand side: ‖o(s + Δ) − o(s)‖ per query (float64)."""
    scores, delta, v = scores.double(), delta.double(), values.double()
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    p0 = torch.softmax(scores, -1)
    p1 = torch.softmax(scores + delta, -1)
    if v.dim() == 2:
        return ((p1 - p0) @ v).norm(dim=-1)
    return torch.einsum("...t,...td->...d", p1 - p0, v).norm(dim=-1)
