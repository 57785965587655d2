"""What one cache path stores per token: bits, channel group size, mode, metadata dtype.

A ``PathFormat`` is the single description of a path's quantized record. Byte counts here are the
ones the cache layout, the Cache subclass, the page pool and the kernels all use.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from quantmla.errors import UnsupportedFormatError

MODES = ("affine", "symmetric", "fp8")
GROUPINGS = ("token", "page")
CLIPS = (1.0, 0.96875, 0.9375, 0.875, 0.75, 0.5)  # 1 - 2^-k: a power-of-two shrink rounds alike on every device
INT_BITS = (2, 3, 4, 8)
META_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class PathFormat:
    """Channel-group quantization of one path (content latent or RoPE key).

    bits:       2, 3, 4 or 8 (integer codes), 8 with mode "fp8" (e4m3), or 16 (stored unquantized).
    group_size: channels sharing one scale (and zero point, for "affine").
    mode:       "affine" (x ≈ code·scale + zero), "symmetric" (x ≈ (code − 2^(b−1))·scale), "fp8".
    meta_dtype: dtype of the stored scale / zero point ("float16", "bfloat16" or "float32"; the
                FP8 format users run on DeepSeek models, fp8_ds_mla, stores one fp32 scale per 128).
    grouping:   "token": a group is `group_size` channels of one token (metadata per token);
                "page": a group is `group_size` channels over the tokens of one page of the paged
                cache (metadata per page: KIVI's per-channel keys at the page size; integer codes,
                RoPE path only). The codes are packed per token either way.
    block:      grouping "page" only: tokens sharing one metadata set inside a page, a power of two
                dividing the page size; a page of P tokens then holds P / block sets, token t of the
                page using set t // block. 0 (the default): one set for the whole page.
    clip:       the share of a group's range its codes span (integer codes): affine groups' [lo, hi]
                shrinks by (1 − clip)/2 of its width at each end, symmetric groups' largest magnitude
                by the factor clip, before the scale is set; values beyond saturate at the end codes.
                1 (the full range) or 1 − 2^-k (CLIPS), so the writers round alike on every device.
                Only writers read it: the stored bytes and their reading are the same for every clip.
    """

    bits: int = 4
    group_size: int = 64
    mode: str = "affine"
    meta_dtype: str = "float16"
    grouping: str = "token"
    clip: float = 1.0
    block: int = 0

    def __post_init__(self):
        if self.grouping not in GROUPINGS:
            raise UnsupportedFormatError(f"grouping must be one of {GROUPINGS}, got {self.grouping!r}")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 0 or (
                self.block & (self.block - 1)):
            raise UnsupportedFormatError(f"block must be 0 (the whole page) or a power of two, got {self.block!r}")
        if self.block and self.grouping != "page":
            raise UnsupportedFormatError(
                f"block {self.block} sets the tokens sharing metadata inside a page, for grouping 'page'; a per-token "
                "format has no such blocks: use block 0, or grouping 'page'")
        if self.bits == 16:
            if self.clip != 1.0:
                raise UnsupportedFormatError("a 16-bit path stores raw values and has no range to clip; use clip 1")
            if self.grouping != "token":
                raise UnsupportedFormatError("a 16-bit path stores raw values and has no groups; use grouping 'token'")
            return
        if self.grouping == "page" and self.mode == "fp8":
            raise UnsupportedFormatError("per-page groups store integer codes; use mode 'affine' or 'symmetric'")
        if self.mode not in MODES:
            raise UnsupportedFormatError(f"unknown quantization mode {self.mode!r}; use one of {MODES}")
        if self.mode == "fp8" and self.bits != 8:
            raise UnsupportedFormatError(f"fp8 (e4m3) stores 8 bits per value, got bits={self.bits}; set bits=8")
        if self.mode != "fp8" and self.bits not in INT_BITS:
            raise UnsupportedFormatError(
                f"unsupported bit width {self.bits}; integer codes take bits in {INT_BITS} (or 16 for no quantization)"
            )
        if self.group_size < 1 or self.group_size & (self.group_size - 1):
            raise UnsupportedFormatError(f"group_size must be a power of two >= 1, got {self.group_size}")
        if self.meta_dtype not in META_DTYPES:
            raise UnsupportedFormatError(f"meta_dtype must be one of {tuple(META_DTYPES)}, got {self.meta_dtype!r}")
        if self.clip not in CLIPS or isinstance(self.clip, bool):
            raise UnsupportedFormatError(f"clip must be one of {CLIPS} (1 - 2^-k), got {self.clip!r}")
        if self.clip != 1.0 and self.mode == "fp8":
            raise UnsupportedFormatError("clip applies to integer codes; an fp8 path keeps clip 1")

    # -- derived sizes (per token, for a path of `dim` channels) -----------------------------------
    @property
    def quantized(self) -> bool:
        return self.bits != 16

    @property
    def meta_fields(self) -> int:
        """Stored metadata values per group: scale and zero (affine) or scale alone."""
        if not self.quantized:
            return 0
        return 2 if self.mode == "affine" else 1

    @property
    def clip_exp(self) -> int:
        """k with clip = 1 − 2^-k (0 for the full range)."""
        return 0 if self.clip == 1.0 else round(-math.log2(1.0 - self.clip))

    @property
    def torch_meta_dtype(self) -> torch.dtype:
        return META_DTYPES[self.meta_dtype]

    def check_dim(self, dim: int, path: str = "path") -> None:
        """Raise a clear error if this format cannot store `dim` channels."""
        if not self.quantized:
            return
        if dim % self.group_size:
            raise UnsupportedFormatError(
                f"{path}: group_size {self.group_size} does not divide its {dim} channels; "
                f"pick a group size that divides {dim}"
            )
        if (dim * self.bits) % 8:
            raise UnsupportedFormatError(f"{path}: {dim} channels at {self.bits} bits do not fill whole bytes")
        if self.bits == 3 and dim % 8:
            raise UnsupportedFormatError(f"{path}: 3-bit packing needs a multiple of 8 channels, got {dim}")

    @property
    def meta_elem_bytes(self) -> int:
        """Bytes of one stored metadata value (2 for fp16/bf16, 4 for fp32; 2 for BF16 values)."""
        return self.torch_meta_dtype.itemsize if self.quantized else 2

    def groups(self, dim: int) -> int:
        return dim // self.group_size if self.quantized else 0

    def code_bytes(self, dim: int) -> int:
        """Bytes of codes per token (16-bit: the raw bf16 values)."""
        return dim * 2 if not self.quantized else dim * self.bits // 8

    @property
    def per_page(self) -> bool:
        """Metadata per page of the paged cache instead of per token."""
        return self.grouping == "page"

    def meta_bytes(self, dim: int) -> int:
        """Metadata bytes per token (0 where the metadata is per page)."""
        return 0 if self.per_page else self.set_meta_bytes(dim)

    def set_meta_bytes(self, dim: int) -> int:
        """Bytes of one metadata set: every group's scale (and zero) once."""
        return self.groups(dim) * self.meta_fields * self.meta_elem_bytes

    def meta_block(self, page_size: int) -> int:
        """Tokens sharing one metadata set in a page of `page_size` tokens (per-page formats): the block, or
        the whole page for block 0. Raises UnsupportedFormatError where the block does not divide the page."""
        if self.block and page_size % self.block:
            raise UnsupportedFormatError(
                f"{self.describe()}: blocks of {self.block} tokens do not divide the page of {page_size} tokens; "
                f"pick a block that divides {page_size} (or block 0, the whole page)")
        return self.block or page_size

    def page_meta_bytes(self, dim: int, page_size: int) -> int:
        """Metadata bytes per page of `page_size` tokens: page_size / block sets (one for block 0); 0 where
        the metadata is per token."""
        if not self.per_page:
            return 0
        return page_size // self.meta_block(page_size) * self.set_meta_bytes(dim)

    def bytes_per_token(self, dim: int, page_size: int | None = None) -> float:
        """Codes and metadata per token; per-page metadata counts as its share of a full page of
        `page_size` tokens (needed for grouping "page"): set bytes / block, or / page_size for block 0."""
        if self.per_page:
            if not page_size:
                raise ValueError("bytes per token of a per-page format need the page size")
            return self.code_bytes(dim) + self.page_meta_bytes(dim, page_size) / page_size
        return self.code_bytes(dim) + self.meta_bytes(dim)

    def describe(self) -> str:
        if not self.quantized:
            return "BF16"
        name = "FP8" if self.mode == "fp8" else f"INT{self.bits}"
        where = ("·page" + (f"/{self.block}" if self.block else "")) if self.per_page else ""
        clip = "" if self.clip == 1.0 else f"·clip{self.clip:g}"
        return f"{name}/g{self.group_size}{where}" + ("" if self.mode == "affine" or self.mode == "fp8" else "s") + clip

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["grouping"] == "token":  # the default: files written before per-page groups stay as they were
            del d["grouping"]
        if d["clip"] == 1.0:  # likewise for the full range
            del d["clip"]
        if d["block"] == 0:  # and for one metadata set a page
            del d["block"]
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "path format") -> "PathFormat":
        """A format from its JSON form ({"bits": 4, "group_size": 64, ...}); `where` names it in errors."""
        if not isinstance(d, dict):
            raise UnsupportedFormatError(f"{where} must be an object like {{\"bits\": 4, \"group_size\": 64}}, got {d!r}")
        unknown = set(d) - {"bits", "group_size", "mode", "meta_dtype", "grouping", "clip", "block"}
        if unknown:
            raise UnsupportedFormatError(f"{where}: unknown path-format fields {sorted(unknown)}")
        for key, kind in (("bits", int), ("group_size", int), ("mode", str), ("meta_dtype", str), ("grouping", str),
                          ("block", int)):
            v = d.get(key)
            if key in d and (not isinstance(v, kind) or isinstance(v, bool)):
                raise UnsupportedFormatError(
                    f"{where}: {key} must be {'an integer' if kind is int else 'a string'}, got {v!r} "
                    f"({type(v).__name__}); write it as {'a JSON number without quotes, e.g. 4' if kind is int else 'a JSON string'}")
        if "clip" in d and (not isinstance(d["clip"], (int, float)) or isinstance(d["clip"], bool)):
            raise UnsupportedFormatError(f"{where}: clip must be a number such as 0.875, got {d['clip']!r}")
        return cls(**{**d, **({"clip": float(d["clip"])} if "clip" in d else {})})


BF16 = PathFormat(bits=16)
