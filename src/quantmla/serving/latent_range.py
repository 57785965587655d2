"""How large a layer's content groups can get, bounded from the weights of its latent norm, and the decode configs of
the page layouts whose scales that bound takes past the tokens-as-M kernel's default builds.

A cached latent is ``s · (γ · x / sqrt(mean(x²) + eps) (+ β))`` over its d_c channels: ``kv_a_layernorm``, an
RMSNorm in every MLA family (calibrated transforms fold into γ), times the model's ``latent_scale`` s (1, or
LongCat-Flash's sqrt(hidden / d_c)). Its unit-norm direction ``u = x / ||x||`` puts every channel at
``|c_i / s - β_i| <= sqrt(d_c)·|γ_i|·|u_i|``, so by Cauchy-Schwarz a group's range ``max c - min c`` is at most
``s·(sqrt(d_c)·sqrt(γ_a² + γ_b²) + |β_a| + |β_b|)`` over its two largest ``|γ|`` and ``|β|``, and its largest
``|c|`` at most ``s·(sqrt(d_c)·max|γ| + max|β|)``: bounds, in exact arithmetic, on the scale a group of each format
stores whatever the tokens. The model's dtype (the normed latent and its product with γ each rounded to bf16) and fp16
metadata (the zero point rounded down, by up to 2^-10 of the group's largest |value|, which the range bound exceeds,
then the scale rounded up) can lift a stored scale by up to about 1 %: ``ROUNDING_SLACK``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from quantmla.cache.layout import PageLayout
from quantmla.quant.format import PathFormat
from quantmla.quant.groupwise import FP8_MAX

ROUNDING_SLACK = 2.0**-6  # (1 + 2^-8)^2 (a bf16 norm) x (1 + 2^-10) (the zero) x (1 + 2^-10) (the scale) < 1 + 2^-6


def content_scale_bound(norm: torch.nn.Module, fmt: PathFormat, d_c: int, latent_scale: float = 1.0) -> float | None:
    """The largest scale, in exact arithmetic, that a content group of `fmt` (per-token groups: affine, symmetric or
    FP8) can store for latents [d_c] that `norm` (weight γ [d_c], optional bias β) writes, times `latent_scale`, by
    the bounds above; None where `fmt` stores no scale a token (unquantized, or grouped per page) or `norm` has no
    weight of d_c channels."""
    w = getattr(norm, "weight", None)
    if not fmt.quantized or fmt.per_page or w is None or w.dim() != 1 or w.numel() != d_c or d_c % fmt.group_size:
        return None
    gs = fmt.group_size
    g = w.detach().abs().double().reshape(-1, gs)
    b = getattr(norm, "bias", None)
    beta = torch.zeros_like(g) if b is None else b.detach().abs().double().reshape(-1, gs)
    root, s = math.sqrt(d_c), abs(latent_scale)
    if fmt.mode == "affine":
        k = min(2, gs)
        span = root * g.topk(k, dim=-1).values.pow(2).sum(-1).sqrt() + beta.topk(k, dim=-1).values.sum(-1)
        return float(s * (span / (2**fmt.bits - 1)).max())
    top = FP8_MAX if fmt.mode == "fp8" else 2 ** (fmt.bits - 1) - 1
    return float(s * ((root * g.amax(-1) + beta.amax(-1)) / top).max())


def wide_layers(modules: dict[int, torch.nn.Module], layouts: dict[int, PageLayout], rows: int,
                latent_scale: float = 1.0) -> dict[int, float]:
    """Layer slot -> the bound of its content scale (``content_scale_bound`` of its ``kv_a_layernorm``), for the
    layers whose page layout the tokens-as-M decode kernel reads at `rows` query rows (``cuda.tokens_m_reason``) and
    whose stored scales could reach ``cuda.TM_MAX_CONTENT_SCALE``, rounding included (``ROUNDING_SLACK``): the scale
    past which the fp16 P·scale operand of that kernel's default builds can overflow."""
    from quantmla.kernels.cuda.tokens_m import TM_MAX_CONTENT_SCALE, tokens_m_reason

    wide = {}
    for slot, m in modules.items():
        lay, norm = layouts.get(slot), getattr(m, "kv_a_layernorm", None)
        if lay is None or norm is None or tokens_m_reason(lay, rows) is not None:
            continue
        bound = content_scale_bound(norm, lay.token.fmt.content, lay.token.d_c, latent_scale)
        if bound is not None and bound * (1 + ROUNDING_SLACK) >= TM_MAX_CONTENT_SCALE:
            wide[slot] = bound
    return wide


@dataclass(frozen=True)
class WideLatentsConfig:
    """An engine's ``decode_config`` for the page layouts whose content scales pass the tokens-as-M kernel's default
    builds (``wide_layers``): called (rows, layout, device) as ``kernels.api.default_config`` is, it returns a layout's
    DecodeConfig, or None for the API's own default.

    ``wide``: the layouts it decodes; ``voting``: those of them whose bound, rounding included, stays under
    ``cuda.TM_VOTE_MAX_CONTENT_SCALE`` (the largest scale fp16 metadata stores), which decode on the API's default
    with the tokens-as-M kernel's SCALE_VOTE build (``default_config(..., scale_vote=True)``); the rest of ``wide``
    (FP8's fp32 scales, or a norm whose bound passes it) decode with that kernel left out (``allow_tokens_m=False``:
    the built tile on the GPU); every other layout on the API's own default (None)."""

    wide: frozenset = frozenset()
    voting: frozenset = frozenset()

    follows_units: ClassVar[bool] = True
    """The engine applies the API's unit-length rules (``schedule.config_for_units``: the 4-warp plan of 4-bit codes
    over short units, FP8's built tile) to the configs this gives, as to the default: ``decode_tiling`` in a graph
    bucket, ``get_mla_metadata(..., follow_units=True)`` in an eager call (``triton_backend.follows_units``). A
    decode_config of the caller's own, which does not declare it, keeps its configs as given."""

    def __post_init__(self):  # any iterable of layouts, held as frozensets (the config is hashable and cannot change)
        object.__setattr__(self, "wide", frozenset(self.wide))
        object.__setattr__(self, "voting", frozenset(self.voting))

    def __call__(self, rows: int, layout: PageLayout, device):
        """The DecodeConfig of `layout` at `rows` query rows on `device`, or None (the API's default)."""
        if layout not in self.wide:
            return None
        from quantmla.kernels.schedule import default_config

        if layout in self.voting:
            return default_config(rows, layout, device, scale_vote=True)
        return default_config(rows, layout, device, allow_tokens_m=False)


def wide_latents_config(wide: dict[PageLayout, float]) -> WideLatentsConfig:
    """The engine's ``decode_config`` (a ``WideLatentsConfig``) for `wide`: page layout -> the bound of its content
    scale (``wide_layers``, ``by_layout``); the layouts whose bound times ``1 + ROUNDING_SLACK`` stays under
    ``cuda.TM_VOTE_MAX_CONTENT_SCALE`` vote."""
    from quantmla.kernels.cuda.tokens_m import TM_VOTE_MAX_CONTENT_SCALE

    voting = frozenset(lay for lay, bound in wide.items() if bound * (1 + ROUNDING_SLACK) < TM_VOTE_MAX_CONTENT_SCALE)
    return WideLatentsConfig(frozenset(wide), voting)


def by_layout(wide: dict[int, float], layouts: dict[int, PageLayout]) -> dict[PageLayout, float]:
    """`wide` (layer slot -> bound, ``wide_layers``) by page layout: each layout's largest bound."""
    out: dict[PageLayout, float] = {}
    for slot, bound in wide.items():
        out[layouts[slot]] = max(bound, out.get(layouts[slot], 0.0))
    return out


def wide_warning(wide: dict[int, float], config: WideLatentsConfig | None) -> str:
    """What an engine says of its `wide` layers (``wide_layers``): where they decode under `config` (the engine's
    ``wide_latents_config``), or, with None (a decode_config of the caller's own), where they must."""
    from quantmla.kernels.cuda.tokens_m import TM_MAX_CONTENT_SCALE, TM_VOTE_MAX_CONTENT_SCALE

    head = (f"the latent norms of layers {sorted(wide)} allow content-group scales up to {max(wide.values()):.4g}, "
            f"past what the tokens-as-M decode kernel's default builds read right ({TM_MAX_CONTENT_SCALE:g}): ")
    if config is None:
        return head + ("EngineConfig.decode_config must decode them on its SCALE_VOTE build or off it "
                       "(latent_range.wide_latents_config)")
    off = len(config.wide) - len(config.voting)
    past = f"; {off} cache layout(s) past {TM_VOTE_MAX_CONTENT_SCALE:g} decode off it, on the other kernels"
    return head + "their cache layouts decode on its SCALE_VOTE build" + (past if off else "")
