"""The plan of the heads-as-M decode kernel (mla_decode_wg.cu): 64 query rows a CTA (heads x query tokens) as the
M of Hopper's warpgroup MMAs, two warpgroups, 64-token tiles, one CTA per SM. A BF16 cache's tiles land in two stages
as they are stored; integer codes (LOWBIT) land in three raw stages and are built into one 16-bit tile (fp16 where
both paths' metadata is fp16, else bf16; wg_build.cuh).
It is the many-heads kernel: at 128 heads the products, not the bytes, set a call's time, and a 64-row warpgroup MMA
gives them the tensor cores' full width."""

from __future__ import annotations

import torch

from quantmla.cache.layout import PageLayout
from quantmla.errors import QuantMLAError
from quantmla.kernels.cuda.plan import _OUT, SMEM_PER_CTA, DecodePlan, is_fp8, partial_macros, path_codes

WG_BLOCK_M, WG_BLOCK_N, WG_WARPS, WG_STAGES = 64, 64, 8, 2
WG_LOWBIT_STAGES, WG_FP8_STAGES = 3, 1  # raw stages: integer codes, FP8 (656 bytes a token: one stage fits)
WG_MIN_ROWS = 64
"""Fewer query rows than this pad the 64-row MMA; the tokens-as-M and built-tile kernels take them."""


def warpgroup_reason(layout: PageLayout, rows: int) -> str | None:
    """Why the heads-as-M kernel cannot read `layout` for `rows` query rows, or None where it can."""
    tok = layout.token
    c, r = tok.fmt.content, tok.fmt.rope
    if rows < WG_MIN_ROWS:
        return f"{rows} query rows: it takes {WG_MIN_ROWS} or more (heads x query tokens)"
    if (tok.d_c, tok.d_r) != (512, 64):
        return f"d_c {tok.d_c}, d_r {tok.d_r}: it reads DeepSeek's geometry, 512 and 64"
    if c.mode == "fp8":
        if not is_fp8(layout) or c.group_size % 8:
            return f"{c.describe()} / {r.describe()}: FP8 as fp8_ds_mla stores it (fp32 scales, a BF16 RoPE key)"
    elif c.quantized != r.quantized:
        return f"{c.describe()} / {r.describe()}: both paths BF16, or both integer codes (or FP8 and BF16)"
    elif not c.quantized and (c.bits != 16 or r.bits != 16):  # a 16-bit path stores raw bf16
        return f"{c.describe()} / {r.describe()}: it reads a BF16 cache, integer codes or FP8"
    else:
        for f in (c, r):
            if f.quantized and f is r and f.per_page:
                why = rope_page_reason(layout)
                if why:
                    return f"{f.describe()}: {why}"
            elif f.quantized and (f.mode not in ("affine", "symmetric") or f.bits not in (2, 4, 8) or f.per_page
                                  or f.group_size % 8):
                return (f"{f.describe()}: it reads a BF16 cache or 2-, 4- or 8-bit integer codes with per-token groups of "
                        "8 channels or more, or RoPE keys grouped per page")
    if layout.page_size % WG_BLOCK_N:
        return f"page size {layout.page_size}: a multiple of {WG_BLOCK_N}"
    return None


def rope_page_reason(layout: PageLayout) -> str | None:
    """Why the heads-as-M build cannot read `layout`'s RoPE path grouped per page (wg_build.cuh's PM: a (scale, zero)
    per channel pair from the set each token reads, in the fp16 tile), or None."""
    r, blk = layout.token.fmt.rope, layout.rope_meta_block
    if not half_operands(layout) or r.mode not in ("affine", "symmetric") or r.bits not in (2, 4, 8):
        return "2-, 4- or 8-bit affine or symmetric codes, both paths with fp16 metadata"
    if not layout.tile_covers_rope_sets(WG_BLOCK_N) or layout.rope_meta_set_bytes % 16:
        return (f"sets of {blk} tokens, {layout.rope_meta_set_bytes} bytes: a tile covers whole 16-byte sets or lies "
                "in one")
    return None


WG_ROPE_PAGE_DEFAULT = True
"""Whether the API's default config reads a RoPE path grouped per page on the heads-as-M kernel
(`warpgroup_by_default`; False: on the built tile at 64 rows and more). On an H100 at 128 heads its whole calls take
INT4/INT4 with 16-token RoPE blocks in 200.4 against the built tile's 362.2 µs at 32 x 8192 and 45.6 against 67.4 at
1 x 32768, within 2 % of the per-token format's (lab/results/kernels/decode_rope_pages_128h_h100.json)."""


def warpgroup_by_default(layout: PageLayout) -> bool:
    """Whether the API's default config tries the heads-as-M kernel for `layout` first (where it reads it): every
    per-token format, a RoPE path grouped per page where WG_ROPE_PAGE_DEFAULT is set."""
    return WG_ROPE_PAGE_DEFAULT or not layout.token.fmt.rope.per_page


def smem_bytes_wg(layout: PageLayout | None = None) -> int:
    """Dynamic shared memory of one CTA, bytes (the map of mla_decode_wg.cu, which asserts it): the query block and
    two stages of nine 64 x 64 bf16 chunks (a BF16 cache; `layout` None or BF16) or one built tile and the raw
    stages of a tile's four page sections (three for integer codes, one for FP8), P, the rows' maxima and sums, the query rows' factors
    (fp16 operands), the stages' mbarriers, and 1024 bytes to align the chunks."""
    chunk = 64 * 128
    lowbit = layout is not None and layout.token.fmt.content.quantized
    stages = (WG_FP8_STAGES if is_fp8(layout) else WG_LOWBIT_STAGES) if lowbit else WG_STAGES
    fb = layout.token.field_bytes if lowbit else {}
    tile_bytes = WG_BLOCK_N * (fb["content_codes"] + fb["rope_codes"] + fb["content_meta"]) + \
        layout.tile_rope_meta_bytes(WG_BLOCK_N) if lowbit else 0
    tiles, raw = (2, stages * tile_bytes) if lowbit else (3, 0)
    qf = WG_BLOCK_M * 4 if lowbit and half_operands(layout) else 0  # the query rows' factors (fp16 operands)
    bars = 16 * -(-8 * stages // 16)
    return tiles * 9 * chunk + chunk + 4 * WG_BLOCK_M * 4 + 2 * WG_BLOCK_M * 4 + qf + raw + bars + 1024


def half_operands(layout: PageLayout) -> bool:
    """Whether the kernel's operands are fp16 (integer codes whose metadata is fp16: a value is one HFMA2 on exact
    codes, rounded once to fp16, 3 bits finer than bf16; the query rows scaled by powers of two into fp16's range),
    not bf16."""
    c, r = layout.token.fmt.content, layout.token.fmt.rope
    return c.quantized and r.quantized and c.meta_dtype == r.meta_dtype == "float16"


def warpgroup_plan(layout: PageLayout, rows: int, out_dtype: torch.dtype, seesaw: bool = False) -> DecodePlan | str:
    """The heads-as-M build for `layout` (or why there is none); `seesaw`: its two warpgroups out of phase, each
    taking a whole tile's scores in turn (mla_decode_seesaw.cu; a BF16 cache only)."""
    why = warpgroup_reason(layout, rows)
    if why:
        return why
    if seesaw and layout.token.fmt.content.quantized:
        return f"{layout.token.fmt.content.describe()}: the warpgroups out of phase read a BF16 cache only"
    smem = smem_bytes_wg(layout)
    if smem > SMEM_PER_CTA:
        return f"{smem} bytes of shared memory a CTA: more than {SMEM_PER_CTA}"
    tok, o = layout.token, layout.offsets
    fb = tok.field_bytes
    macros = dict(
        WG=1, D_C=tok.d_c, D_R=tok.d_r, PS=layout.page_size, PAGE_BYTES=layout.page_bytes,
        OFF_CC=o["content_codes"], OFF_RC=o["rope_codes"], FB_CC=fb["content_codes"], FB_RC=fb["rope_codes"],
        HALF=0, NW=WG_WARPS, BN=WG_BLOCK_N, OUT_KIND=_OUT[out_dtype], SMEM_EXPECTED=smem, TMA=1,
        **partial_macros(layout),
    )
    stages = WG_STAGES
    if tok.fmt.content.quantized:  # the codes and metadata of both paths through raw stages (no tensor maps)
        stages = WG_FP8_STAGES if is_fp8(layout) else WG_LOWBIT_STAGES
        r_page = tok.fmt.rope.per_page
        macros.update(LOWBIT=1, SPLIT=1, TMA=0, RAW_N=stages, OFF_CM=o["content_meta"],
                      OFF_RM=o["rope_page_meta"] if r_page else o["rope_meta"], FB_CM=fb["content_meta"],
                      FB_RM=fb["rope_meta"])
        if r_page:  # absent otherwise: the per-token formats' builds stay as they are
            macros.update(R_PAGE=1, PMB_R=layout.rope_meta_set_bytes)
            if layout.rope_meta_block != layout.page_size:
                macros["R_BLK"] = layout.rope_meta_block
        for p, (f, dim) in (("C", (tok.fmt.content, tok.d_c)), ("R", (tok.fmt.rope, tok.d_r))):
            macros.update(zip((f"KIND_{p}", f"BITS_{p}", f"GS_{p}", f"MB_{p}"), path_codes(f, dim)))
        macros["HALF"] = int(half_operands(layout))
        # the output products' k-steps committed apart, each one's tokens of the next tile built as it is done (at
        # 128 heads 1 to 2 % faster for integer codes, 4 to 6 % for FP8, the same outputs: docs/decode_heads_m.md)
        macros["PV_STEPS"] = 1
    if seesaw:
        macros["SEESAW"] = 1  # (the map it takes fits the heads-as-M plan's shared memory: the kernel asserts it)
    return DecodePlan(tuple(sorted(macros.items())), WG_BLOCK_M, stages, 1, smem)


def lowbit(plan: DecodePlan) -> bool:
    """Whether a heads-as-M plan builds its tiles from integer codes (no tensor maps: raw stages of bulk copies)."""
    return bool(dict(plan.macros).get("LOWBIT"))


_MAPS: dict = {}  # (pages' address, pages, plan constants) -> the two tensor maps (kept alive: launches read them)


def tensor_maps(pages: torch.Tensor, plan: DecodePlan) -> tuple:
    """The kernel's two tensor maps (CUtensorMap, 128 bytes each, as ctypes buffers) over the pages (contiguous
    uint8, page_bytes each) in the plan's layout: the latent section (dims: d_c channels, tokens of a page, pages) and
    the RoPE section (d_r channels, tokens, pages), boxes of 64 channels x 64 tokens x 1 page in the 128-byte
    swizzle, 16-bit elements. Cached per buffer."""
    from quantmla.kernels.cuda import driver

    m = dict(plan.macros)
    n_pages = pages.numel() // m["PAGE_BYTES"]
    key = (pages.data_ptr(), n_pages, plan.macros)
    if key not in _MAPS:
        if not pages.is_contiguous():
            raise QuantMLAError("the heads-as-M decode kernel reads the pages through tensor maps: pass contiguous pages")
        _MAPS[key] = tuple(driver.tensor_map_2byte(pages.data_ptr() + off, (width, m["PS"], n_pages), (row, m["PAGE_BYTES"]),
                                                   (64, 64, 1))
                           for off, width, row in ((m["OFF_CC"], m["D_C"], m["FB_CC"]), (m["OFF_RC"], m["D_R"], m["FB_RC"])))
    return _MAPS[key]
