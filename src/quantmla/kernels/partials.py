"""The split partials' workspace: what a decode kernel writes for a work unit of a sequence with several, and the
combine kernel merges. Its log-sum-exps are fp32; its outputs [units, rows, d_c] take ``partial_dtype``: 16 bits a
value by default (half the bytes a split writes and the combine reads), fp32 where asked."""

from __future__ import annotations

import os

import torch

from quantmla.cache.layout import PageLayout
from quantmla.errors import QuantMLAError

PARTIAL_FP16_SHIFT = 5  # fp16 split partials hold o·2^-5 (the combine multiplies by 2^5)


SIXTEEN_BIT_MAX_ROWS = 63
"""The most query rows a call may have for the default setting to give it 16-bit partials. At 64 rows or more (the
heads-as-M kernels: 64 rows a CTA, e.g. 128 heads) 16-bit partials measured slower than fp32 on an H100: at 128 heads,
1 x 32768 (64 splits) a layer's decode call took 43.3 against 39.5 µs in BF16 and 50.1 against 45.8 in INT4/INT4, in
the decode kernel and in the combine alike; below 64 rows (the 16-row kernels) they measured faster
(docs/decode_tokens_m.md, "Partials in bf16 for BF16 and FP8")."""

SETTINGS = {
    "auto": "the default: under 64 query rows fp16 partials where the format bounds them and bf16 for every other "
            "format; at 64 rows or more fp32",
    "bf16": "fp16 partials where the format bounds them, bf16 for every other format, at any row count",
    "fp16": "fp16 partials where the format bounds them, fp32 for every other format, at any row count",
    "fp32": "fp32 partials for every format",
}


def partials_setting() -> str:
    """QUANTMLA_PARTIALS, one of SETTINGS ("auto" by default); results record it beside their commit."""
    how = os.environ.get("QUANTMLA_PARTIALS", "auto").strip().lower()
    if how not in SETTINGS:
        raise QuantMLAError(f"QUANTMLA_PARTIALS={how!r}: use " + "; ".join(f"'{k}' ({v})" for k, v in SETTINGS.items()))
    return how


def partial_dtype(layout: PageLayout, rows: int) -> torch.dtype:
    """The dtype of the split partials' output workspace [units, rows, d_c] the decode kernels write and the combine
    merges (their log-sum-exps stay fp32) for `rows` query rows a sequence (heads x query tokens), by
    QUANTMLA_PARTIALS (``partials_setting``):

    - fp16 where the content path is integer codes of at most 4 bits with fp16 metadata ("auto" under
      SIXTEEN_BIT_MAX_ROWS + 1 rows; "bf16" and "fp16" at any). A partial is a weighted mean of dequantized values,
      each inside its group's [zero, zero + (2^b - 1)·scale] (affine) or [-2^(b-1)·scale, (2^(b-1) - 1)·scale]
      (symmetric), so |o| < 2^b·65504 and o·2^-PARTIAL_FP16_SHIFT is a finite fp16 (11-bit significand: below the
      bf16 output's own rounding).
    - bf16 for every other format ("auto" under 64 rows; "bf16" at any): raw bf16 and FP8 values have fp32's range,
      which bf16 keeps; its 8-bit significand rounds a partial as the bf16 output rounds the merged one, and the merge
      of n splits averages n such roundings.
    - fp32 otherwise: "auto" at 64 rows or more, "fp16" for the other formats, "fp32" for all."""
    how = partials_setting()
    c = layout.token.fmt.content
    if how == "fp32" or (how == "auto" and rows > SIXTEEN_BIT_MAX_ROWS):
        return torch.float32
    if c.quantized and c.mode in ("affine", "symmetric") and c.bits <= 4 and c.meta_dtype == "float16":
        return torch.float16
    return torch.float32 if how == "fp16" else torch.bfloat16
