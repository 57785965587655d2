"""How large a layer's content groups can get, bounded from the weights of its latent norm, and the decode kernels
that bound rules out.

A cached latent is ``c = γ · x / sqrt(mean(x²) + eps) (+ β)`` over its d_c channels (``kv_a_layernorm``, an RMSNorm
in every MLA family; calibrated transforms fold into γ). Its unit-norm direction ``u = x / ||x||`` puts every channel
at ``|c_i - β_i| <= sqrt(d_c)·|γ_i|·|u_i|``, so by Cauchy-Schwarz a group's range ``max c - min c`` is at most
``sqrt(d_c)·sqrt(γ_a² + γ_b²) + |β_a| + |β_b|`` over its two largest ``|γ|`` and ``|β|``, and its largest ``|c|`` at
most ``sqrt(d_c)·max|γ| + max|β|``: bounds on the scale a group of each format stores, whatever the tokens.
"""

from __future__ import annotations

import math

import torch

from quantmla.cache.layout import CacheFormat, PageLayout
from quantmla.kernels.cuda.tokens_m import TM_MAX_CONTENT_SCALE
from quantmla.kernels.schedule import DecodeConfig, default_config
from quantmla.quant.format import PathFormat

FP8_MAX = 448.0  # e4m3's largest finite value: an FP8 group's scale is amax / 448


def content_scale_bound(norm: torch.nn.Module, fmt: PathFormat) -> float | None:
    """The largest scale a content group of `fmt` (per-token groups: affine, symmetric or FP8) can store for latents
    that `norm` (weight γ [d_c], optional bias β) writes, by the bounds above; None where `fmt` stores no scale a
    token (unquantized, or grouped per page) or `norm` has no weight of the latent's width."""
    w = getattr(norm, "weight", None)
    if not fmt.quantized or fmt.per_page or w is None or w.dim() != 1 or w.numel() % fmt.group_size:
        return None
    d_c, gs = w.numel(), fmt.group_size
    g = w.detach().abs().double().reshape(-1, gs)
    b = getattr(norm, "bias", None)
    beta = torch.zeros_like(g) if b is None else b.detach().abs().double().reshape(-1, gs)
    root = math.sqrt(d_c)
    if fmt.mode == "affine":
        k = min(2, gs)
        span = root * g.topk(k, dim=-1).values.pow(2).sum(-1).sqrt() + beta.topk(k, dim=-1).values.sum(-1)
        return float((span / (2**fmt.bits - 1)).max())
    top = FP8_MAX if fmt.mode == "fp8" else 2 ** (fmt.bits - 1) - 1
    return float(((root * g.amax(-1) + beta.amax(-1)) / top).max())


def wide_layers(modules: dict[int, torch.nn.Module], formats: dict[int, CacheFormat]) -> dict[int, float]:
    """Layer slot -> the bound of its content scale (``content_scale_bound`` of its ``kv_a_layernorm``), for the
    layers whose content groups could reach ``TM_MAX_CONTENT_SCALE``: the scale past which the tokens-as-M decode
    kernel's fp16 P·scale operand can overflow."""
    wide = {}
    for slot, m in modules.items():
        fmt = formats.get(slot)
        norm = getattr(m, "kv_a_layernorm", None)
        bound = None if fmt is None or norm is None else content_scale_bound(norm, fmt.content)
        if bound is not None and bound >= TM_MAX_CONTENT_SCALE:
            wide[slot] = bound
    return wide


def without_tokens_m(rows: int, layout: PageLayout, device) -> DecodeConfig:
    """The API's default decode config for `layout` with the tokens-as-M kernel left out (an engine's
    ``decode_config`` where ``wide_layers`` names any layer)."""
    return default_config(rows, layout, device, tokens_m=False)
