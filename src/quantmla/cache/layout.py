"""The quantized MLA cache layout — defined once, used by the Cache subclass's accounting, the
paged GPU pool and the kernels.

Per token and layer the cache holds a *record*:

    content codes  d_c·b_c/8 bytes     (planar-packed, see quant.packing)
    RoPE codes     d_r·b_r/8 bytes
    content meta   G_c × fields × 2 or 4 bytes   (fp16/bf16/fp32 scale[, zero] per group)
    RoPE meta      G_r × fields × 2 or 4 bytes

A *page* stores ``page_size`` tokens as four sections, one per field above, each a contiguous
``[page_size, field_bytes]`` array starting at a 16-byte aligned offset, then the per-page sections
(``PAGE_SECTIONS``); the page size in bytes is rounded up to 16. A 16-bit path stores raw bf16
values as its "codes" and no metadata.

A RoPE path grouped per page (``PathFormat(grouping="page")``: one scale and zero point per channel
group over the page's tokens, KIVI's key grouping at the page size) keeps no per-token metadata; its
groups' metadata is the page's ``rope_page_meta`` section, ``[page_size / block, G_r, fields]`` in the
meta dtype (block-major; one set, ``[1, G_r, fields]``, for block 0): token t of a page reads set
``t // block``.

The named formats (``PRESETS``, ``preset``) are defined here once; the kernel benchmark, the serving
benchmark and the evaluation harness all take them from here. ``fp8`` is the cache users run on
DeepSeek models today (FlashMLA's and vLLM's fp8_ds_mla): 512 e4m3 latent values with one fp32 scale
per 128, and the 64 RoPE values in bf16 — 656 bytes per token at d_c 512, d_r 64.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantmla.quant.format import BF16, PathFormat

ALIGN = 16
DEFAULT_PAGE_SIZE = 64
SECTIONS = ("content_codes", "rope_codes", "content_meta", "rope_meta")
PAGE_SECTIONS = ("rope_page_meta",)


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class CacheFormat:
    """The two paths' formats: content latent and RoPE key."""

    content: PathFormat = BF16
    rope: PathFormat = BF16

    def describe(self) -> str:
        return f"content {self.content.describe()} + RoPE {self.rope.describe()}"

    def to_dict(self) -> dict:
        return {"content": self.content.to_dict(), "rope": self.rope.to_dict()}

    @classmethod
    def from_dict(cls, d: dict, where: str = "cache format") -> "CacheFormat":
        """Both paths from their JSON form {"content": {...}, "rope": {...}}; `where` names it in errors."""
        from quantmla.errors import UnsupportedFormatError

        missing = [k for k in ("content", "rope") if not isinstance(d, dict) or k not in d]
        if missing:
            raise UnsupportedFormatError(f"{where} has no {' or '.join(repr(k) for k in missing)} format; each path "
                                         "needs one, like \"content\": {\"bits\": 4, \"group_size\": 64}")
        return cls(PathFormat.from_dict(d["content"], f"{where}, content"), PathFormat.from_dict(d["rope"], f"{where}, rope"))


def int_format(content_bits: int, rope_bits: int, content_group: int = 128, rope_group: int = 64) -> CacheFormat:
    """INT<content_bits>/INT<rope_bits> affine groups (16 bits: that path stored as BF16)."""
    c = BF16 if content_bits == 16 else PathFormat(content_bits, content_group)
    r = BF16 if rope_bits == 16 else PathFormat(rope_bits, rope_group)
    return CacheFormat(c, r)


FP8_DS_MLA = CacheFormat(PathFormat(8, 128, "fp8", "float32"), BF16)

PRESETS: dict[str, CacheFormat] = {
    "bf16": CacheFormat(BF16, BF16),
    "fp8": FP8_DS_MLA,
    "int8/int8": int_format(8, 8),
    "int4/int8": int_format(4, 8),
    "int4/int4": int_format(4, 4),
    "int2/int4": int_format(2, 4),
}
"""Named cache formats at DeepSeek's groups per token (content groups of 128, RoPE groups of 64)."""


def preset(name: str, content_group: int | None = None, rope_group: int | None = None) -> CacheFormat:
    """A named format ("bf16", "fp8", "int4/int4", ...), optionally with other integer group sizes.

    fp8 keeps its fixed layout (one fp32 scale per 128 channels, bf16 RoPE) whatever the groups."""
    key = name.strip().lower()
    if key not in PRESETS:
        from quantmla.errors import UnsupportedFormatError

        raise UnsupportedFormatError(f"unknown cache format {name!r}; choose from {', '.join(PRESETS)}")
    fmt = PRESETS[key]

    def regroup(f: PathFormat, g: int | None) -> PathFormat:
        if g is None or not f.quantized or f.mode == "fp8":
            return f
        return PathFormat(f.bits, g, f.mode, f.meta_dtype)

    return CacheFormat(regroup(fmt.content, content_group), regroup(fmt.rope, rope_group))


@dataclass(frozen=True)
class TokenLayout:
    """Bytes of one token's record in one layer: latent rank d_c, RoPE dim d_r."""

    d_c: int
    d_r: int
    fmt: CacheFormat

    def __post_init__(self):
        self.fmt.content.check_dim(self.d_c, "content path")
        self.fmt.rope.check_dim(self.d_r, "RoPE path")
        if self.fmt.content.per_page:
            from quantmla.errors import UnsupportedFormatError

            raise UnsupportedFormatError("per-page groups are a RoPE-path format (per-channel keys); the content "
                                         "path takes per-token groups (grouping 'token')")

    @property
    def field_bytes(self) -> dict[str, int]:
        c, r = self.fmt.content, self.fmt.rope
        return {
            "content_codes": c.code_bytes(self.d_c),
            "rope_codes": r.code_bytes(self.d_r),
            "content_meta": c.meta_bytes(self.d_c),
            "rope_meta": r.meta_bytes(self.d_r),
        }

    @property
    def bytes_per_token(self) -> int:
        """The per-token record (per-page metadata not counted: see PageLayout.page_field_bytes)."""
        return sum(self.field_bytes.values())


@dataclass(frozen=True)
class PageLayout:
    """Byte offsets of the four per-token sections and the per-page ones inside one page of `page_size` tokens."""

    token: TokenLayout
    page_size: int = DEFAULT_PAGE_SIZE
    offsets: dict[str, int] = field(init=False, compare=False)
    page_bytes: int = field(init=False, compare=False)

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.token.fmt.rope.per_page:
            self.token.fmt.rope.meta_block(self.page_size)  # refuses a block that does not divide the page
        off, offsets = 0, {}
        for name in SECTIONS:
            offsets[name] = off
            off = align_up(off + self.page_size * self.token.field_bytes[name])
        for name in PAGE_SECTIONS:
            offsets[name] = off
            off = align_up(off + self.page_field_bytes[name])
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "page_bytes", align_up(off))

    @property
    def page_field_bytes(self) -> dict[str, int]:
        """Bytes of each per-page section (0 where the RoPE metadata is per token)."""
        return {"rope_page_meta": self.token.fmt.rope.page_meta_bytes(self.token.d_r, self.page_size)}

    @property
    def rope_meta_block(self) -> int:
        """Tokens sharing one RoPE metadata set of the page (the format's block, the page size for block 0);
        0 where the RoPE metadata is per token."""
        rope = self.token.fmt.rope
        return rope.meta_block(self.page_size) if rope.per_page else 0

    @property
    def rope_meta_set_bytes(self) -> int:
        """Bytes of one RoPE metadata set of the page (the section holds page_size / rope_meta_block of them,
        block-major); 0 where the RoPE metadata is per token."""
        if not self.rope_meta_block:
            return 0
        return self.page_field_bytes["rope_page_meta"] // (self.page_size // self.rope_meta_block)

    def tile_rope_meta_bytes(self, tokens: int) -> int:
        """RoPE metadata a kernel's tile of `tokens` tokens of one page reads, bytes: the page's sets its tokens read
        (one where a set covers the tile; per-page formats), or its tokens' own."""
        if not self.rope_meta_block:
            return tokens * self.token.field_bytes["rope_meta"]
        return max(1, tokens // self.rope_meta_block) * self.rope_meta_set_bytes

    def tile_covers_rope_sets(self, tokens: int) -> bool:
        """Whether a kernel's tile of `tokens` tokens (a divisor or multiple of the page size) covers whole RoPE
        metadata sets of the page or lies inside one (always, where the RoPE metadata is per token)."""
        blk = self.rope_meta_block
        return not blk or (tokens % blk == 0 if blk < tokens else blk % tokens == 0)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocated_bytes(self, seq_lens: list[int] | int, layers: int = 1, block_table_entry_bytes: int = 4) -> int:
        """Bytes a paged cache allocates for these sequences: pages plus block tables and lengths."""
        lens = [seq_lens] if isinstance(seq_lens, int) else list(seq_lens)
        pages = [self.pages_for(n) for n in lens]
        data = sum(pages) * self.page_bytes * layers
        tables = sum(pages) * block_table_entry_bytes + 4 * len(lens)
        return data + tables


def compression(d_c: int, d_r: int, fmt: CacheFormat, tokens: int, page_size: int = DEFAULT_PAGE_SIZE) -> float:
    """BF16 allocated bytes over `fmt`'s allocated bytes, one sequence of `tokens` tokens."""
    ref = PageLayout(TokenLayout(d_c, d_r, CacheFormat()), page_size).allocated_bytes(tokens)
    got = PageLayout(TokenLayout(d_c, d_r, fmt), page_size).allocated_bytes(tokens)
    return ref / got
