"""Per-page per-channel RoPE codes: QuantMLA's RoPE path with KIVI's grouping.

QuantMLA's cache stores the RoPE key (after the pair transform, minus the slot's centring offset)
in per-token channel groups. Here the RoPE path is grouped the other way, as KIVI groups keys: each
of the d_r channels of one *page* of P tokens (P = 64, the paged cache's page size) shares one scale
(and one zero point for affine codes). The content path is unchanged (per-token channel groups,
QuantMLA's content transform). The pair transform and the centring offset still apply before the
RoPE key is quantized; both fold into the weights or vanish in softmax, so they cost nothing at
read time.

Shapes and units (one layer, one sequence):

    k_R        [T, d_r]           the stored RoPE key (pair-transformed, centred), fp32
    codes      [T, d_r]           b-bit integers in [0, 2^b − 1]; stored packed, d_r·b/8 bytes a token
    scale      [n_pages, d_r]     fp16 (meta_dtype), one per channel per page
    zero       [n_pages, d_r]     fp16, affine codes only
    k̂_R(t)  = codes(t) ⊙ scale[p(t)] + zero[p(t)]          p(t) = t // P

Read side (what a decode kernel computes; :func:`rope_scores_from_codes` is the reference). The
per-channel scale folds into the query once per page, never into the keys:

    q_R · k̂_R(t) = (q_R ⊙ scale[p]) · codes(t) + q_R · zero[p]

so the kernel multiplies the d_r-wide RoPE query of each head by the page's d_r scales (d_r
multiplies per head per page), runs the code dot products on exact small integers, and adds one
per-page constant per head. Symmetric codes drop the zero term and store codes offset by 2^(b−1).

Bytes per token (per layer), counted honestly (:class:`RopeChannelLayout`):

    content   PathFormat.bytes_per_token(d_c)                     (per-token groups)
    RoPE      d_r · b / 8                                         (codes)
            + d_r · fields · meta_bytes / P                       (per-page metadata over P tokens)

At d_r 32, INT4, fp16 scale and zero, P = 64: 16 + 2 = 18 bytes of RoPE per token, against 20 for
per-token groups of 32 channels and 20 for KIVI-style blocks of 32 tokens. The unfinished last page
(fewer than P tokens) is quantized per channel over the tokens it holds, exactly as the KIVI-style
baseline's unfinished block (no full-precision residual); it costs its codes plus one page's
metadata (:meth:`RopeChannelLayout.bytes_per_token_at`). A full-precision window of the newest
tokens, when asked, is the cache's ``fp_window`` and the same for every method.

The paged cache stores the same codes: its RoPE path format ``PathFormat(grouping="page", block=P)``
(:attr:`RopeChannelFormat.path_format`) keeps the metadata of a page's blocks of P tokens in the page's
``rope_page_meta`` section (``cache.layout``), so a 64-token page with blocks of P holds exactly what this
cache holds with pages of P. This module is the transformers-cache (evaluation) form of the format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.hf_cache import QuantMLACache, QuantMLALayer
from quantmla.cache.kivi import KIVIFormat, _ChannelBlockStore
from quantmla.cache.layout import DEFAULT_PAGE_SIZE, CacheFormat
from quantmla.errors import UnsupportedFormatError
from quantmla.quant.format import BF16, PathFormat
from quantmla.quant.groupwise import dequantize_page, quantize_page

__all__ = ["RopeChannelCache", "RopeChannelFormat", "RopeChannelLayer", "RopeChannelLayout", "quantize_pages",
           "rope_scores_from_codes"]


@dataclass(frozen=True)
class RopeChannelFormat:
    """The RoPE path stored per channel per page: `bits`-bit codes, one scale (and zero, affine)
    per channel per page of `page_size` tokens, metadata in `meta_dtype`."""

    bits: int = 4
    page_size: int = DEFAULT_PAGE_SIZE
    mode: str = "affine"
    meta_dtype: str = "float16"

    def __post_init__(self):
        if self.mode == "fp8":
            raise UnsupportedFormatError("per-channel RoPE pages store integer codes; use mode 'affine' or 'symmetric'")
        if self.bits >= 16:
            raise UnsupportedFormatError(f"per-channel RoPE pages quantize the keys: bits {self.bits} stores them as "
                                         "they are (use a 16-bit cache format instead)")
        _ = self.page_format  # validates bits, mode, page size (a power of two) and the meta dtype

    @property
    def page_format(self) -> PathFormat:
        """One channel of one page as a group: `page_size` values along the token axis (the form the
        calibration's straight-through fake quantizer takes)."""
        return PathFormat(self.bits, self.page_size, self.mode, self.meta_dtype)

    @property
    def path_format(self) -> PathFormat:
        """The same codes as the paged cache's RoPE path format at its page of DEFAULT_PAGE_SIZE tokens: one group
        per channel per block of `page_size` tokens (block 0, the whole page, from DEFAULT_PAGE_SIZE up)."""
        block = self.page_size if self.page_size < DEFAULT_PAGE_SIZE else 0
        return PathFormat(self.bits, 1, self.mode, self.meta_dtype, grouping="page", block=block)

    def block_format(self, content: PathFormat) -> KIVIFormat:
        """The same grouping as the KIVI-style store's (block = page, unfinished page quantized)."""
        return KIVIFormat(content, self.bits, self.page_size, self.mode, self.meta_dtype, fp_residual=False)

    def code_bytes(self, d_r: int) -> int:
        """Packed codes of one token [bytes] (the paged layout's count)."""
        return self.path_format.code_bytes(d_r)

    def page_meta_bytes(self, d_r: int) -> int:
        """Metadata of one page: d_r channels × (scale[, zero]) [bytes] (the paged layout's count)."""
        return self.path_format.page_meta_bytes(d_r, self.page_size)

    def bytes_per_token(self, d_r: int) -> float:
        """Steady state: codes plus the page metadata amortized over the page [bytes]."""
        return self.path_format.bytes_per_token(d_r, self.page_size)

    def describe(self) -> str:
        s = "" if self.mode == "affine" else "s"
        return f"INT{self.bits}{s}/ch·page{self.page_size}"

    def to_dict(self) -> dict:
        return {"bits": self.bits, "page_size": self.page_size, "mode": self.mode, "meta_dtype": self.meta_dtype,
                "kind": "rope_channel"}


@dataclass(frozen=True)
class RopeChannelLayout:
    """Bytes per token of one layer's record: per-token content groups + per-page RoPE channels."""

    d_c: int
    d_r: int
    content: PathFormat
    rope: RopeChannelFormat

    def __post_init__(self):
        self.content.check_dim(self.d_c, "content path")
        if (self.d_r * self.rope.bits) % 8 or (self.rope.bits == 3 and self.d_r % 8):
            raise UnsupportedFormatError(f"RoPE path: {self.d_r} channels at {self.rope.bits} bits do not pack into whole bytes")

    @property
    def field_bytes(self) -> dict[str, float]:
        """Per token [bytes]: the RoPE metadata is the page's, divided by the page size."""
        return {
            "content_codes": self.content.code_bytes(self.d_c),
            "rope_codes": self.rope.code_bytes(self.d_r),
            "content_meta": self.content.meta_bytes(self.d_c),
            "rope_meta": self.rope.page_meta_bytes(self.d_r) / self.rope.page_size,
        }

    @property
    def bytes_per_token(self) -> float:
        """Steady state (whole pages)."""
        return sum(self.field_bytes.values())

    def bytes_per_token_at(self, n_tokens: int) -> float:
        """Per-token bytes of a sequence of `n_tokens`: every page, the unfinished last one included,
        stores its tokens' codes and one page's metadata."""
        if n_tokens <= 0:
            raise ValueError("n_tokens must be positive")
        f = self.field_bytes
        pages = -(-n_tokens // self.rope.page_size)
        rope = n_tokens * f["rope_codes"] + pages * self.rope.page_meta_bytes(self.d_r)
        return f["content_codes"] + f["content_meta"] + rope / n_tokens


def quantize_pages(k: torch.Tensor, fmt: RopeChannelFormat) -> torch.Tensor:
    """Round trip of RoPE keys k [..., T, d_r] through per-channel per-page codes -> [..., T, d_r]
    (k's dtype, computed in fp32). Pages start at token 0; an unfinished last page is padded with
    its last token (which leaves each channel's range unchanged), as the cache does."""
    T, d_r = k.shape[-2], k.shape[-1]
    P = fmt.page_size
    n = -(-T // P)
    x = k.float()
    if n * P != T:
        x = torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], n * P - T, d_r)], dim=-2)
    pages = x.reshape(*x.shape[:-2], n, P, d_r)
    f = fmt.path_format
    deq = dequantize_page(quantize_page(pages, f), f, d_r)  # the paged cache's quantizer
    return deq.reshape(*x.shape[:-2], n * P, d_r)[..., :T, :].to(k.dtype)


def rope_scores_from_codes(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                           fmt: RopeChannelFormat) -> torch.Tensor:
    """The RoPE logits a kernel computes from per-page codes, the scale folded into the query.

    q [H, d_r] RoPE queries; codes [T, d_r] unpacked integer codes; scale, zero [n_pages, d_r]
    (zero None for symmetric codes). Returns [H, T] = q·k̂(t) computed as
    ``(q ⊙ scale[p]) · codes(t) + q · zero[p]`` (symmetric: codes − 2^(b−1), no zero term),
    in q's dtype."""
    P = fmt.page_size
    T = codes.shape[0]
    page = torch.arange(T, device=codes.device) // P
    c = codes.to(q.dtype)
    if fmt.mode == "symmetric":
        c = c - 2 ** (fmt.bits - 1)
    q_s = q[:, None, :] * scale.to(q.dtype)[None]  # [H, n_pages, d_r]: the scale folded into the query per page
    out = (q_s[:, page, :] * c[None]).sum(-1)  # [H, T]
    if fmt.mode == "affine":
        out = out + (q @ zero.to(q.dtype).T)[:, page]  # one constant per head per page
    return out


class RopeChannelLayer(QuantMLALayer):
    """A QuantMLALayer whose RoPE path is stored per channel per page (content path as usual).
    The slot's centring offset is subtracted before the RoPE key is quantized (QuantMLALayer.update)."""

    def __init__(self, content: PathFormat, rope: RopeChannelFormat, d_c: int, d_r: int, fp_window: int = 0,
                 layer_idx: int | None = None, rope_offset: torch.Tensor | None = None):
        super().__init__(CacheFormat(content, BF16), d_c, d_r, fp_window, layer_idx, rope_offset=rope_offset)
        self.rope_channel = rope
        self.layout = RopeChannelLayout(d_c, d_r, content, rope)
        self.rope = _ChannelBlockStore(rope.block_format(content), d_r)

    def reset(self) -> None:
        self.__init__(self.fmt.content, self.rope_channel, self.d_c, self.d_r, self.fp_window, self.layer_idx,
                      rope_offset=self.rope_offset)


class RopeChannelCache(QuantMLACache):
    """QuantMLACache with per-channel per-page RoPE codes in every MLA layer.

    `quant`: the (calibrated) config: its content format, RoPE offsets and full-precision window are
    used; its per-token RoPE format is replaced by `rope`, or, without `rope`, by per-page codes of each
    layer's own RoPE bits, mode and metadata dtype (layer overrides included) at the default page size.

    >>> cache = RopeChannelCache(model, quant, RopeChannelFormat(bits=4, page_size=64))
    """

    def __init__(self, model_or_config, quant: QuantCacheConfig | None = None, rope: RopeChannelFormat | None = None):
        super().__init__(model_or_config, quant)
        q = self.quant
        self.rope_channel = rope or RopeChannelFormat(q.rope.bits, mode=q.rope.mode, meta_dtype=q.rope.meta_dtype)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, QuantMLALayer):
                r = q.format_for(layer.layer_idx).rope
                fmt = rope or RopeChannelFormat(r.bits, mode=r.mode, meta_dtype=r.meta_dtype)
                self.layers[i] = RopeChannelLayer(q.format_for(layer.layer_idx).content, fmt,
                                                  self.spec.d_c, self.spec.d_r, q.fp_window, layer.layer_idx,
                                                  rope_offset=layer.rope_offset)

    def bytes_per_token_at(self, n_tokens: int) -> float:
        return sum(l.layout.bytes_per_token_at(n_tokens) for l in self.mla_layers())
