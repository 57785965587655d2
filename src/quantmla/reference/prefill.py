"""Causal MLA prefill attention in the non-absorbed form, in plain torch: the oracle for the prefill kernel.

A chunk of n queries (the last n of T positions) attends over the up-projected context:

    s[h, i, t] = scale · ( q_nope[i, h] · k_nope[t, h] + q_rope[i, h] · k_rope[t] )     t <= T − n + i
    o[i, h]    = Σ_t softmax_t(s[h, i, :]) · v[t, h]

Shapes: q_nope [n, H, d_n], q_rope [n, H, d_r], kv [T, H, d_n + d_v] (``kv_b_proj`` of the latent,
per head k_nope then v), k_rope [T, d_r] (one RoPE key shared by every head).
"""

from __future__ import annotations

import torch


def prefill_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    k_rope: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Returns o [n, H, d_v] in compute_dtype."""
    n, T, d_n = q_nope.shape[0], kv.shape[0], q_nope.shape[-1]
    if n > T:
        raise ValueError(f"a chunk of {n} queries cannot attend over {T} < {n} context tokens")
    k_nope, v = kv[..., :d_n].to(compute_dtype), kv[..., d_n:].to(compute_dtype)
    s = torch.einsum("ihd,thd->hit", q_nope.to(compute_dtype), k_nope)
    s = s + torch.einsum("ihd,td->hit", q_rope.to(compute_dtype), k_rope.to(compute_dtype))
    t = torch.arange(T, device=kv.device)
    i = torch.arange(n, device=kv.device)
    hidden = t[None, :] > (T - n + i)[:, None]  # [n, T]
    p = torch.softmax((s * scale).masked_fill(hidden, float("-inf")), dim=-1)
    return torch.einsum("hit,thd->ihd", p, v)
