"""KIVI-style baseline: the RoPE key quantized *per channel across tokens*.

KIVI (Liu et al., 2024) quantizes keys per channel — each channel of a block of ``block`` consecutive
tokens shares one scale and zero point — because key outliers sit in fixed channels. The tokens of
an unfinished block (fewer than ``block``) form its *residual*: with ``fp_residual`` (KIVI's own
choice) they are read in full precision until the block is complete; without it (the default, so
that KIVI gets no more full-precision tokens than any other method) they are read quantized per
channel over the tokens the block holds so far. A full-precision window of the newest tokens, the
same for every method, is ``fp_window`` of the cache (QuantMLALayer's). Here only MLA's RoPE key takes that treatment; the
content latent (MLA's key *and* value) keeps the per-token channel groups of ``QuantMLALayer``.

Reads. A completed block is stored as codes and read dequantized by every later read, including
the reads of a prefill that completed it (so a prefill's queries inside a block see its quantized
keys — stricter than a token-by-token decode, where they would still sit in the residual). The
residual's at most ``block − 1`` most recent RoPE keys are read at full precision with
``fp_residual``, else quantized over the partial block. Within ``QuantMLALayer.expanded_reads`` an
update also returns each block's prefixes as earlier decode steps read them
(``_ChannelBlockStore.prefix_reads``), so a forward over them gives each query its decode reading.

Bytes per token (per layer), stated honestly:

    content  PathFormat.bytes_per_token(d_c)                         (per-token groups, as QuantMLALayer)
    RoPE     d_r · bits / 8                                          (codes)
           + d_r · fields · 2 / block                                (per-channel scale[, zero], amortized over the block)

plus the residual: at most ``block − 1`` tokens at 2 · d_r bytes (BF16) per layer per sequence with
``fp_residual`` (else their codes and one block's metadata), amortized over a context of n tokens by
:meth:`KIVILayout.bytes_per_token_at`. With block = the
per-token RoPE group size g, the steady-state metadata equals per-token grouping's (d_r·fields·2/g).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.hf_cache import QuantMLACache, QuantMLALayer
from quantmla.cache.layout import CacheFormat
from quantmla.errors import UnsupportedFormatError
from quantmla.quant.format import BF16, PathFormat
from quantmla.quant.groupwise import Quantized, dequantize, quantize


@dataclass(frozen=True)
class KIVIFormat:
    """content: per-token PathFormat of the latent; rope_bits / block / rope_mode / meta_dtype:
    the RoPE key's per-channel quantization over blocks of `block` tokens; fp_residual: read the
    unfinished block's RoPE keys in full precision (KIVI's residual) instead of quantized."""

    content: PathFormat = PathFormat(4, 64)
    rope_bits: int = 4
    block: int = 32
    rope_mode: str = "affine"
    meta_dtype: str = "float16"
    fp_residual: bool = False

    def __post_init__(self):
        if self.rope_mode == "fp8":
            raise UnsupportedFormatError("KIVI quantizes to integer codes; use rope_mode 'affine' or 'symmetric'")
        if self.rope_bits >= 16:
            raise UnsupportedFormatError(f"KIVI quantizes the RoPE keys: rope_bits {self.rope_bits} stores them as "
                                         "they are (use a 16-bit cache format instead)")
        self.rope_channel_format  # validates bits, mode and block (power of two)

    @property
    def rope_channel_format(self) -> PathFormat:
        """The format of one channel's block: `block` values along the token axis share a group."""
        return PathFormat(self.rope_bits, self.block, self.rope_mode, self.meta_dtype)

    def describe(self) -> str:
        res = ", residual full precision" if self.fp_residual else ""
        return f"content {self.content.describe()} + RoPE KIVI INT{self.rope_bits}/ch·{self.block}tok{res}"

    def to_dict(self) -> dict:
        return {"content": self.content.to_dict(), "rope_bits": self.rope_bits, "block": self.block,
                "rope_mode": self.rope_mode, "meta_dtype": self.meta_dtype, "fp_residual": self.fp_residual,
                "kind": "kivi"}


@dataclass(frozen=True)
class KIVILayout:
    """Bytes per token of one layer's KIVI record (fractional: block metadata is amortized)."""

    d_c: int
    d_r: int
    fmt: KIVIFormat

    def __post_init__(self):
        self.fmt.content.check_dim(self.d_c, "content path")
        if (self.d_r * self.fmt.rope_bits) % 8:
            raise UnsupportedFormatError(f"RoPE path: {self.d_r} channels at {self.fmt.rope_bits} bits do not fill whole bytes")
        if self.fmt.rope_bits == 3 and self.d_r % 8:
            raise UnsupportedFormatError(f"RoPE path: 3-bit packing needs a multiple of 8 channels, got {self.d_r}")

    @property
    def field_bytes(self) -> dict[str, float]:
        rf = self.fmt.rope_channel_format
        return {
            "content_codes": self.fmt.content.code_bytes(self.d_c),
            "rope_codes": self.d_r * self.fmt.rope_bits // 8,
            "content_meta": self.fmt.content.meta_bytes(self.d_c),
            "rope_meta": self.d_r * rf.meta_fields * rf.meta_elem_bytes / self.fmt.block,
        }

    @property
    def bytes_per_token(self) -> float:
        """Steady state: codes plus block metadata amortized over the block (no residual)."""
        return sum(self.field_bytes.values())

    def residual_tokens(self, n_tokens: int) -> int:
        return n_tokens % self.fmt.block

    def bytes_per_token_at(self, n_tokens: int) -> float:
        """Per-token bytes of a sequence of `n_tokens`: completed blocks quantized, the residual
        RoPE keys at BF16 with fp_residual, else as codes plus one block's metadata (their content
        latents are quantized per token as usual)."""
        if n_tokens <= 0:
            raise ValueError("n_tokens must be positive")
        f = self.field_bytes
        res = self.residual_tokens(n_tokens)
        done = n_tokens - res
        content = f["content_codes"] + f["content_meta"]
        if self.fmt.fp_residual:
            res_bytes = res * 2 * self.d_r
        else:
            res_bytes = res * f["rope_codes"] + (f["rope_meta"] * self.fmt.block if res else 0)
        rope = done * (f["rope_codes"] + f["rope_meta"]) + res_bytes
        return content + rope / n_tokens


class _ChannelBlockStore:
    """RoPE keys of one layer: completed blocks quantized per channel over `block` tokens, plus a
    full-precision residual of the unfinished block."""

    # a block's codes depend on all its tokens: a crop into a completed block keeps them only dequantized (a rollback
    # does not restore the store), and one forward over a block reads it quantized over tokens a decode has not seen
    per_token_codes = False

    def __init__(self, fmt: KIVIFormat, dim: int):
        self.fmt, self.dim, self.block = fmt, dim, fmt.block
        self.qfmt = fmt.rope_channel_format
        self.codes: torch.Tensor | None = None  # [B, n_blocks, dim, block·bits/8] uint8
        self.meta: torch.Tensor | None = None  # [B, n_blocks, dim, 1, fields]
        self.residual: torch.Tensor | None = None  # [B, r < block, dim]

    def append(self, x: torch.Tensor) -> None:
        """x: [B, T, dim] new RoPE keys."""
        x = x if self.residual is None else torch.cat([self.residual, x], dim=1)
        B, T, D = x.shape
        n_full = T // self.block
        if n_full:
            blocks = x[:, : n_full * self.block].reshape(B, n_full, self.block, D).transpose(2, 3)  # [B, n, D, block]
            q = quantize(blocks.contiguous(), self.qfmt)  # groups along the token axis: one per channel per block
            self.codes = q.codes if self.codes is None else torch.cat([self.codes, q.codes], dim=1)
            self.meta = q.meta if self.meta is None else torch.cat([self.meta, q.meta], dim=1)
        rest = x[:, n_full * self.block :]
        self.residual = rest if rest.shape[1] else None

    def read(self, dtype: torch.dtype) -> torch.Tensor | None:
        parts = []
        if self.codes is not None:
            blocks = dequantize(Quantized(self.codes, self.meta), self.qfmt, self.block, dtype)  # [B, n, D, block]
            B, n = blocks.shape[:2]
            parts.append(blocks.transpose(2, 3).reshape(B, n * self.block, self.dim))
        if self.residual is not None:
            parts.append(self.residual.to(dtype) if self.fmt.fp_residual else self._read_partial(dtype))
        if not parts:
            return None
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def _read_partial(self, dtype: torch.dtype) -> torch.Tensor:
        """The residual [B, r, dim] quantized per channel over its r < block tokens: padded to a
        block by repeating its last token (which leaves each channel's range unchanged)."""
        r = self.residual
        pad = r[:, -1:].expand(-1, self.block - r.shape[1], -1)
        return self._round_trip(torch.cat([r, pad], dim=1).unsqueeze(1), dtype)[:, 0, : r.shape[1]]

    def _round_trip(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks x [B, n, block, dim] quantized per channel over each block's tokens, read back in `dtype`."""
        q = quantize(x.transpose(2, 3).contiguous(), self.qfmt)  # [B, n, dim, block]: one group per channel
        return dequantize(q, self.qfmt, self.block, dtype).transpose(2, 3)

    def prefix_reads(self, new: torch.Tensor, first: torch.Tensor, length: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
        """Blocks read before they are complete: for each n the tokens first[n] .. first[n] + length[n] − 1 of a block
        beginning at first[n], as a read holding only those of it reads them (quantized per channel over them as
        ``_read_partial`` quantizes the residual, or unquantized with fp_residual) -> [B, Σ length, dim] in `dtype`.
        The tokens lie in the residual or among `new` [B, N, dim], the tokens about to be appended: call it before
        ``append``. first, length: [n] int64, first[n] a block boundary at or after the completed blocks."""
        held = new if self.residual is None else torch.cat([self.residual, new], dim=1)
        pos = torch.arange(self.block)
        last = (length - 1)[:, None]
        idx = first[:, None] - self.quantized_length + torch.minimum(pos[None], last)  # [n, block], last token repeated
        x = held[:, idx.to(held.device)]  # [B, n, block, dim]
        x = x.to(dtype) if self.fmt.fp_residual else self._round_trip(x, dtype)
        return x[:, (pos[None] <= last).to(x.device)]

    @property
    def quantized_length(self) -> int:
        return 0 if self.codes is None else self.codes.shape[1] * self.block

    @property
    def length(self) -> int:
        return self.quantized_length + (0 if self.residual is None else self.residual.shape[1])

    def nbytes(self) -> int:
        """Stored bytes: codes, metadata, and the residual (2 bytes a value with fp_residual, else
        its codes and one block's metadata)."""
        n = sum(t.numel() * t.element_size() for t in (self.codes, self.meta) if t is not None)
        if self.residual is None:
            return n
        if self.fmt.fp_residual:
            return n + self.residual.numel() * 2
        B, r, D = self.residual.shape
        return n + B * (r * D * self.fmt.rope_bits // 8 + D * self.qfmt.meta_fields * self.qfmt.meta_elem_bytes)

    def index_batch(self, fn) -> None:
        self.codes = None if self.codes is None else fn(self.codes)
        self.meta = None if self.meta is None else fn(self.meta)
        self.residual = None if self.residual is None else fn(self.residual)

    def crop(self, keep: int) -> None:
        """Keep the first `keep` tokens. Cutting into a quantized block moves its kept tokens
        (dequantized) back into the residual; they are quantized again when the block refills."""
        if keep >= self.length:
            return
        q_len = self.quantized_length
        if keep >= q_len:
            self.residual = self.residual[:, : keep - q_len] if keep > q_len else None
            return
        full = keep // self.block
        partial = None
        if keep % self.block:
            partial = self.read(torch.float32)[:, full * self.block : keep]
        self.codes = self.codes[:, :full] if full else None
        self.meta = self.meta[:, :full] if full else None
        self.residual = partial


class KIVILayer(QuantMLALayer):
    """A QuantMLALayer whose RoPE path is stored KIVI-style (see the module docstring)."""

    def __init__(self, fmt: KIVIFormat, d_c: int, d_r: int, fp_window: int = 0, layer_idx: int | None = None):
        super().__init__(CacheFormat(fmt.content, BF16), d_c, d_r, fp_window, layer_idx)
        self.kivi = fmt
        self.layout = KIVILayout(d_c, d_r, fmt)
        self.rope = _ChannelBlockStore(fmt, d_r)

    def reset(self) -> None:
        self.__init__(self.kivi, self.d_c, self.d_r, self.fp_window, self.layer_idx)


class KIVICache(QuantMLACache):
    """QuantMLACache with KIVI-style RoPE keys in every MLA layer.

    >>> cache = KIVICache(model, KIVIFormat(PathFormat(4, 64), rope_bits=4, block=32))
    """

    def __init__(self, model_or_config, fmt: KIVIFormat | None = None, fp_window: int = 0):
        fmt = fmt or KIVIFormat()
        super().__init__(model_or_config, QuantCacheConfig(content=fmt.content, rope=BF16, method="kivi",
                                                           fp_window=fp_window))
        self.kivi = fmt
        for i, layer in enumerate(self.layers):
            if isinstance(layer, QuantMLALayer):
                self.layers[i] = KIVILayer(fmt, self.spec.d_c, self.spec.d_r, fp_window, layer_idx=layer.layer_idx)

    def bytes_per_token_at(self, n_tokens: int) -> float:
        return sum(l.layout.bytes_per_token_at(n_tokens) for l in self.mla_layers())
