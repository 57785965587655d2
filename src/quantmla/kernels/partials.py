"""The split partials' workspace: what a decode kernel writes for a work unit of a sequence with several, and the
combine kernel merges. Its log-sum-exps are fp32; its outputs [units, rows, d_c] take ``partial_dtype``: 16 bits a
value by default (half the bytes a split writes and the combine reads), fp32 where asked."""

from __future__ import annotations

import os

import torch

from quantmla.cache.layout import PageLayout
from quantmla.errors import QuantMLAError

PARTIAL_FP16_SHIFT = 5  # fp16 split partials hold o·2^-5 (the combine multiplies by 2^5)


SETTINGS = {
    "auto": "the default: fp16 partials where the format bounds them, bf16 for every other format, at any row count",
    "bf16": "the same as auto",
    "fp16": "fp16 partials where the format bounds them, fp32 for every other format, at any row count",
    "fp32": "fp32 partials for every format",
}


def partials_setting() -> str:
    """QUANTMLA_PARTIALS, one of SETTINGS ("auto" by default); results record it beside their commit."""
    how = os.environ.get("QUANTMLA_PARTIALS", "auto").strip().lower()
    if how not in SETTINGS:
        raise QuantMLAError(f"QUANTMLA_PARTIALS={how!r}: use " + "; ".join(f"'{k}' ({v})" for k, v in SETTINGS.items()))
    return how


def partial_dtype(layout: PageLayout) -> torch.dtype:
    """The dtype of the split partials' output workspace [units, rows, d_c] the decode kernels write and the combine
    merges (their log-sum-exps stay fp32), at any row count, by QUANTMLA_PARTIALS (``partials_setting``):

    - fp16 where the content path is integer codes of at most 4 bits with fp16 metadata ("auto", "bf16", "fp16"). A
      partial is a weighted mean of dequantized values, each inside its group's [zero, zero + (2^b - 1)·scale]
      (affine) or [-2^(b-1)·scale, (2^(b-1) - 1)·scale] (symmetric), so |o| < 2^b·65504 and o·2^-PARTIAL_FP16_SHIFT
      is a finite fp16 (11-bit significand: below the bf16 output's own rounding).
    - bf16 for every other format ("auto", "bf16"): raw bf16 and FP8 values have fp32's range, which bf16 keeps; its 8-bit significand rounds a partial as the bf16 output rounds the merged one, and the merge
      of n splits averages n such roundings.
    - fp32 otherwise: "fp16" for the other formats, "fp32" for all.

    At 128 heads (heads-as-M kernels, staged epilogue) 16-bit partials took BF16's whole calls from 38.1 to 37.5 µs a
    layer at 1 x 32768 and 57.8 to 52.4 at 4 x 16384 on an H100, INT4/INT4's level within 1 µs but for 69.3 to 65.1
    at 4 x 16384 (docs/decode_tokens_m.md, "Partials at 128 rows")."""
    how = partials_setting()
    c = layout.token.fmt.content
    if how == "fp32":
        return torch.float32
    if c.quantized and c.mode in ("affine", "symmetric") and c.bits <= 4 and c.meta_dtype == "float16":
        return torch.float16
    return torch.float32 if how == "fp16" else torch.bfloat16
