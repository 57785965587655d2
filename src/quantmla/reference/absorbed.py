"""Absorbed-MLA attention in plain torch: the oracle for every kernel.

For one layer, query i of head h attends over cached tokens t:

    s[h, i, t] = scale · ( q_latent[h, i] · latent[t] + q_rope[h, i] · k_rope[t] )
    o[h, i]    = Σ_t softmax_t(s[h, i, :]) · latent[t]          (latent-space output, before W_UV)
    lse[h, i]  = log Σ_t exp(s[h, i, t])                           (natural log)

Shapes (per sequence b): q_latent [B, S_q, H, d_c], q_rope [B, S_q, H, d_r],
latent [B, T, d_c], k_rope [B, T, d_r]. `seq_lens` [B] gives each sequence's valid tokens
(T is the padded length). With `causal=True` the S_q queries are the last S_q positions of each
sequence: query i sees tokens t < seq_len − S_q + i + 1 (speculative / MTP decode).
A query that sees no token returns o = 0 and lse = −inf.
"""

from __future__ import annotations

import torch


def absorbed_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None = None,
    causal: bool = True,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [B, S_q, H, d_c] in compute_dtype, lse [B, S_q, H])."""
    B, S_q, H, d_c = q_latent.shape
    T = latent.shape[1]
    qc, qr = q_latent.to(compute_dtype), q_rope.to(compute_dtype)
    c, kr = latent.to(compute_dtype), k_rope.to(compute_dtype)
    s = torch.einsum("bihd,btd->bhit", qc, c) + torch.einsum("bihd,btd->bhit", qr, kr)
    s = s * scale
    if seq_lens is None:
        seq_lens = torch.full((B,), T, dtype=torch.long, device=latent.device)
    t = torch.arange(T, device=latent.device)
    limit = seq_lens.to(latent.device).view(B, 1, 1)  # tokens visible: t < limit
    if causal:
        i = torch.arange(S_q, device=latent.device).view(1, S_q, 1)
        limit = limit - S_q + i + 1
    visible = t.view(1, 1, T) < limit  # [B, S_q, T]
    s = s.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, H, S_q]
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(compute_dtype).min))
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.einsum("bhit,btd->bihd", p, c)
    return o, lse.transpose(1, 2)
