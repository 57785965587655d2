"""The dual-path error model of MLA cache quantization, measured exactly (docs/design.md §2).

For one layer, head i, query position s and cached token t (causal, t <= s):

    s_i(t)  = scale · ( q̃_i · c(t) + q_i^R · k_R(t) )          p_i = softmax_t s_i
    v_i(t)  = c(t) · W_UV^(i)ᵀ                                  o_i = Σ_t p_i(t) v_i(t)

Quantizing the cache replaces c by ĉ = c + e_c and k_R by k̂_R = k_R + e_R; the read gives
ô_i = Σ_t p̂_i(t) v̂_i(t). The output error splits *exactly* into

    Δo_i = Σ_t Δp_i(t) v̄_i(t)   +   Σ_t p̄_i(t) e_c(t) W_UV^(i)ᵀ
           └ matching ────────┘     └ aggregation ─────────────┘

with Δp = p̂ − p, v̄ = (v + v̂)/2, p̄ = (p + p̂)/2 (the symmetric — Shapley — split of a product's
change: it gives each term half of the second-order cross term Σ Δp e_c W_UV, which is reported
separately). The first-order model of docs/design.md §2 is

    Δp¹_i(t) = p_i(t) (Δs_i(t) − Σ_u p_i(u) Δs_i(u)),   Δs exact (logits are linear in the cache)
    Δo¹_i    = Σ_t Δp¹_i(t) v_i(t) + Σ_t p_i(t) e_c(t) W_UV^(i)ᵀ

and the two agree as the bit width grows (checked by :func:`LayerStats` ``first_order_rel_err``).

Everything is accumulated as sums of squares over queries, heads and sequences, in float64, so a
layer is reported by ratios of Frobenius norms. All output-space figures (Δo, its terms, the first-order
model) are measured *after o_proj* — the attention block's output, what the residual stream sees,
where heads that o_proj weighs little count little (the terms are linear, so the split carries over);
without an o_proj weight they are measured in the concatenated per-head value space:

    distortion         ‖Δo W_Oᵀ‖ / ‖o W_Oᵀ‖
    distortion_heads   ‖Δo‖ / ‖o‖ in per-head value space (before o_proj)
    cache_rel_err      ‖e‖ / ‖x‖ of the quantized path(s)
    sensitivity        distortion / cache_rel_err  (output distortion per unit relative cache error)

The *RoPE amplification factor* of a layer at b bits is sensitivity(RoPE-only) / sensitivity(content-only):
how much more attention-output distortion one unit of relative RoPE-key error causes than one
unit of relative latent error. A value above 1 means the RoPE path amplifies its errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantmla.quant.format import BF16, PathFormat
from quantmla.quant.groupwise import quantize_dequantize

DT = torch.float64


@dataclass
class LayerTensors:
    """Full-precision inputs of one MLA layer's attention for one batch of sequences.

    q_lat [B, H, S, d_c] (absorbed content query), q_rope [B, H, S, d_r] (rotated),
    latent [B, S, d_c], k_rope [B, S, d_r] (rotated, as cached), w_uv [H, d_v, d_c],
    w_o [hidden, H·d_v] or None, scale: the softmax scale.
    """

    q_lat: torch.Tensor
    q_rope: torch.Tensor
    latent: torch.Tensor
    k_rope: torch.Tensor
    w_uv: torch.Tensor
    scale: float
    w_o: torch.Tensor | None = None

    def __post_init__(self):
        B, H, S, d_c = self.q_lat.shape
        d_r = self.q_rope.shape[-1]
        want = {"q_rope": (B, H, S, d_r), "latent": (B, S, d_c), "k_rope": (B, S, d_r)}
        for name, shape in want.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {shape}")
        if self.w_uv.shape[0] != H or self.w_uv.shape[2] != d_c:
            raise ValueError(f"w_uv has shape {tuple(self.w_uv.shape)}, expected [{H}, d_v, {d_c}]")


def _causal_mask(S: int, device) -> torch.Tensor:
    return torch.ones(S, S, dtype=torch.bool, device=device).tril()


def _logits(t: LayerTensors, c: torch.Tensor, kr: torch.Tensor) -> torch.Tensor:
    """[B, H, S, T] unmasked logits."""
    return t.scale * (torch.einsum("bhsc,btc->bhst", t.q_lat.to(DT), c.to(DT))
                      + torch.einsum("bhsr,btr->bhst", t.q_rope.to(DT), kr.to(DT)))


def _values(t: LayerTensors, c: torch.Tensor) -> torch.Tensor:
    """[B, H, T, d_v]."""
    return torch.einsum("btc,hvc->bhtv", c.to(DT), t.w_uv.to(DT))


def _to_out(t: LayerTensors, o: torch.Tensor) -> torch.Tensor:
    """Per-head outputs [B, H, S, d_v] -> o_proj outputs [B, S, hidden] (no bias: it cancels in differences)."""
    B, H, S, dv = o.shape
    return o.transpose(1, 2).reshape(B, S, H * dv) @ t.w_o.to(DT).T


def _sq(x: torch.Tensor) -> float:
    return float((x * x).sum())


@dataclass
class LayerStats:
    """Running sums of squares for one (layer, path, format) measurement."""

    sums: dict[str, float] = field(default_factory=dict)

    def add(self, **kw: float) -> None:
        for k, v in kw.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)

    def _r(self, num: str, den: str) -> float:
        d = self.sums.get(den, 0.0)
        return (self.sums.get(num, 0.0) / d) ** 0.5 if d > 0 else float("nan")

    def metrics(self) -> dict[str, float]:
        s = self.sums
        m = {
            "distortion": self._r("d_o", "o"),
            "distortion_heads": self._r("d_o_heads", "o_heads"),
            "matching": self._r("match", "o"),
            "aggregation": self._r("agg", "o"),
            "cross": self._r("cross", "o"),
            "matching_first_order": self._r("match1", "o"),
            "aggregation_first_order": self._r("agg1", "o"),
            "distortion_first_order": self._r("d_o1", "o"),
            # ‖Δo¹ − Δo‖ / ‖Δo‖: how far the first-order model is from the exact error
            "first_order_rel_err": self._r("fo_err", "d_o"),
            # ‖match + agg − Δo‖ / ‖Δo‖: the split's closure (rounding only)
            "split_residual": self._r("split_res", "d_o"),
            "content_rel_err": self._r("e_c", "c"),
            "rope_rel_err": self._r("e_r", "r"),
            "logit_err_rms": (s["d_s"] / s["n_logits"]) ** 0.5 if s.get("n_logits") else float("nan"),
            "logit_rms": (s["s"] / s["n_logits"]) ** 0.5 if s.get("n_logits") else float("nan"),
        }
        # squared-norm shares: how Δo's energy divides between the two terms (they can partly cancel)
        tot = s.get("match", 0.0) + s.get("agg", 0.0)
        m["matching_share"] = s.get("match", 0.0) / tot if tot > 0 else float("nan")
        # cosine between the matching and aggregation vectors (‖Δo‖² = ‖m‖² + ‖a‖² + 2 m·a)
        den = (s.get("match", 0.0) * s.get("agg", 0.0)) ** 0.5
        m["match_agg_cos"] = s.get("match_dot_agg", 0.0) / den if den > 0 else float("nan")
        return m


def measure(t: LayerTensors, c_hat: torch.Tensor, kr_hat: torch.Tensor, stats: LayerStats | None = None) -> LayerStats:
    """Exact output error of reading (c_hat, kr_hat) instead of (latent, k_rope), its exact
    matching/aggregation split and its first-order model; accumulated into `stats`."""
    stats = stats or LayerStats()
    B, H, S, _ = t.q_lat.shape
    c, kr = t.latent.to(DT), t.k_rope.to(DT)
    e_c, e_r = c_hat.to(DT) - c, kr_hat.to(DT) - kr
    mask = _causal_mask(S, c.device)
    neg = torch.finfo(DT).min
    s = _logits(t, c, kr)
    d_s = _logits(t, e_c, e_r)  # exact: logits are linear in the cache
    p = torch.softmax(s.masked_fill(~mask, neg), dim=-1)
    p_hat = torch.softmax((s + d_s).masked_fill(~mask, neg), dim=-1)
    d_s = d_s.masked_fill(~mask, 0.0)
    v, dv = _values(t, c), _values(t, e_c)
    o = p @ v
    o_hat = p_hat @ (v + dv)
    d_o = o_hat - o
    d_p = p_hat - p
    match = d_p @ (v + 0.5 * dv)  # Σ Δp · (v + v̂)/2
    agg = (p + 0.5 * d_p) @ dv  # Σ (p + p̂)/2 · e_c W_UV
    cross = d_p @ dv
    d_p1 = p * (d_s - (p * d_s).sum(-1, keepdim=True))
    match1 = d_p1 @ v
    agg1 = p @ dv
    d_o1 = match1 + agg1
    n_logits = int(mask.sum()) * B * H
    P = (lambda x: _to_out(t, x)) if t.w_o is not None else (lambda x: x)
    o_, d_o_, match_, agg_ = P(o), P(d_o), P(match), P(agg)
    stats.add(
        o=_sq(o_), d_o=_sq(d_o_), match=_sq(match_), agg=_sq(agg_), cross=_sq(P(cross)),
        match_dot_agg=float((match_ * agg_).sum()), match1=_sq(P(match1)), agg1=_sq(P(agg1)), d_o1=_sq(P(d_o1)),
        fo_err=_sq(P(d_o1 - d_o)), split_res=_sq(P(match + agg - d_o)),
        o_heads=_sq(o), d_o_heads=_sq(d_o),
        e_c=_sq(e_c), c=_sq(c), e_r=_sq(e_r), r=_sq(kr),
        d_s=_sq(d_s), s=_sq(s.masked_fill(~mask, 0.0)), n_logits=n_logits,
    )
    return stats


def split_terms(t: LayerTensors, c_hat: torch.Tensor, kr_hat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The error vectors themselves ([B, H, S, d_v], float64): delta (exact Δo), matching,
    aggregation, cross, and the first-order matching/aggregation. For tests and inspection."""
    B, H, S, _ = t.q_lat.shape
    c, kr = t.latent.to(DT), t.k_rope.to(DT)
    e_c, e_r = c_hat.to(DT) - c, kr_hat.to(DT) - kr
    mask = _causal_mask(S, c.device)
    neg = torch.finfo(DT).min
    s, d_s = _logits(t, c, kr), _logits(t, e_c, e_r)
    p = torch.softmax(s.masked_fill(~mask, neg), -1)
    p_hat = torch.softmax((s + d_s).masked_fill(~mask, neg), -1)
    d_s = d_s.masked_fill(~mask, 0.0)
    v, dv = _values(t, c), _values(t, e_c)
    d_p = p_hat - p
    d_p1 = p * (d_s - (p * d_s).sum(-1, keepdim=True))
    return {
        "o": p @ v,
        "delta": p_hat @ (v + dv) - p @ v,
        "matching": d_p @ (v + 0.5 * dv),
        "aggregation": (p + 0.5 * d_p) @ dv,
        "cross": d_p @ dv,
        "matching_first_order": d_p1 @ v,
        "aggregation_first_order": p @ dv,
    }


# -- per-frequency-pair energies -------------------------------------------------------------------


def pair_energies(t: LayerTensors, pair_index: tuple[torch.Tensor, torch.Tensor]) -> dict[str, list[float]]:
    """Per RoPE frequency pair j (channels a_j, b_j of the cache layout): RMS of k_R and q^R
    per channel of the pair, sqrt(E[(x_a² + x_b²)/2]) — rotation-invariant, so position does not
    matter — with q^R's expectation over heads, queries and sequences."""
    a, b = pair_index
    kr, qr = t.k_rope.to(DT), t.q_rope.to(DT)
    k_e = ((kr[..., a] ** 2 + kr[..., b] ** 2) / 2).reshape(-1, len(a)).mean(0).sqrt()
    q_e = ((qr[..., a] ** 2 + qr[..., b] ** 2) / 2).reshape(-1, len(a)).mean(0).sqrt()
    return {"k_rope_rms": k_e.tolist(), "q_rope_rms": q_e.tolist()}


def pair_logit_error(t: LayerTensors, kr_hat: torch.Tensor, pair_index) -> list[float]:
    """Per pair j: the mean square of its logit error term scale·q_j^R(s)·e_j(t) over all
    (head, query, key) pairs of each sequence (causal and non-causal alike — the positional
    QK-reconstruction objective's per-pair decomposition). Computed via 2×2 second moments."""
    a, b = pair_index
    e = kr_hat.to(DT) - t.k_rope.to(DT)
    out = []
    for aj, bj in zip(a.tolist(), b.tolist()):
        q2 = t.q_rope.to(DT)[..., [aj, bj]]  # [B, H, S, 2]
        e2 = e[..., [aj, bj]]  # [B, S, 2]
        Mq = torch.einsum("bhsx,bhsy->bxy", q2, q2)
        Me = torch.einsum("btx,bty->bxy", e2, e2)
        B, H, S = q2.shape[:3]
        out.append(float(t.scale**2 * (Mq * Me).sum() / (B * H * S * e.shape[1])))
    return out


# -- the per-layer experiment ----------------------------------------------------------------------


def quantize_paths(t: LayerTensors, content: PathFormat, rope: PathFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-trip the layer's cache through the two path formats (per-token groups, as QuantMLACache stores them)."""
    return quantize_dequantize(t.latent, content), quantize_dequantize(t.k_rope, rope)


PATHS = ("content", "rope", "both")


def path_formats(path: str, bits: int, content_group: int, rope_group: int, mode: str = "affine") -> tuple[PathFormat, PathFormat]:
    """Formats of the experiment that quantizes `path` ("content", "rope" or "both") at `bits`."""
    def fmt(g):
        return PathFormat(8, g, "fp8") if mode == "fp8" else PathFormat(bits, g, mode)

    if path == "content":
        return fmt(content_group), BF16
    if path == "rope":
        return BF16, fmt(rope_group)
    if path == "both":
        return fmt(content_group), fmt(rope_group)
    raise ValueError(f"unknown path {path!r}; use one of {PATHS}")
