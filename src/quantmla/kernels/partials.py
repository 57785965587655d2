"""The split partials' workspace: what a decode kernel writes for a work unit of a sequence with several, and the
combine kernel merges. Its log-sum-exps are fp32; its outputs [units, rows, d_c] take ``partial_dtype``."""

from __future__ import annotations

import os

import torch

from quantmla.cache.layout import PageLayout
from quantmla.errors import QuantMLAError

PARTIAL_FP16_SHIFT = 5  # fp16 split partials hold o·2^-5 (the combine multiplies by 2^5)


def partials_setting() -> str:
    """QUANTMLA_PARTIALS: "fp16" (the default: fp16 partials where the format bounds them) or "fp32" (every format);
    results record it beside their commit."""
    how = os.environ.get("QUANTMLA_PARTIALS", "fp16").strip().lower()
    if how not in ("fp32", "fp16"):
        raise QuantMLAError(f"QUANTMLA_PARTIALS={how!r}: use 'fp16' (the default: fp16 partials where the "
                            "format bounds them) or 'fp32' (every format)")
    return how


def partial_dtype(layout: PageLayout) -> torch.dtype:
    """The dtype of the split partials' output workspace [units, rows, d_c] the decode kernels write and the combine
    merges (their log-sum-exps stay fp32): fp16 where the content path is integer codes of at most 4 bits with fp16
    metadata, fp32 otherwise, or for every format with QUANTMLA_PARTIALS=fp32 (the default is "fp16"). A partial is a
    weighted mean of dequantized values, each inside its group's [zero, zero + (2^b - 1)·scale] (affine) or
    [-2^(b-1)·scale, (2^(b-1) - 1)·scale] (symmetric), so |o| < 2^b·65504 and o·2^-PARTIAL_FP16_SHIFT is a finite fp16
    (11-bit significand: below the bf16 output's own rounding): half the bytes a split writes and the combine reads.
    Raw bf16 and FP8 values have fp32's range, and keep fp32 partials."""
    how = partials_setting()
    c = layout.token.fmt.content
    if how == "fp16" and c.quantized and c.mode in ("affine", "symmetric") and c.bits <= 4 and c.meta_dtype == "float16":
        return torch.float16
    return torch.float32
