"""The plan of the built-tile decode kernel (mla_decode.cu): each tile built once in shared memory as 16-bit
values and read by both products. A plan fixes the layout (section offsets, field bytes, formats), the
16-bit tile type (fp16 when every quantized path stores fp16 metadata and no path is raw BF16, else bf16),
BM = 16·RM query rows per CTA, 8 or 16 warps, BN = 32 or 64 tokens per tile and the stages that fit two
CTAs per SM (one where they do not)."""

from __future__ import annotations

import torch

from quantmla.cache.layout import PageLayout
from quantmla.kernels.cuda.plan import (_KIND, _OUT, SMEM_PER_CTA, SMEM_PER_SM, SMEM_RESERVED, DecodePlan, partial_macros,
                                        path_codes, plan_reason)
from quantmla.quant.format import PathFormat

NUM_WARPS = 8
BLOCK_N = 32


def _path(fmt: PathFormat, dim: int) -> tuple[int, int, int, int] | str:
    """(kind, bits, group, metadata code) of a path, or why the CUDA kernel cannot read it."""
    if not fmt.quantized:
        return path_codes(fmt, dim)
    if fmt.mode == "fp8":
        return path_codes(fmt, dim) if fmt.group_size % 16 == 0 else "fp8 groups not a multiple of 16"
    if fmt.bits not in (2, 4, 8):
        return f"{fmt.bits}-bit codes"
    if fmt.per_page:  # the 8-byte build steps read a page's (scale, zero) per channel pair
        if (fmt.group_size != 1 and fmt.group_size % 2) or (dim * fmt.bits // 8) % 8:
            return "per-page groups of an odd number of channels, or packed rows not a multiple of 8"
        return path_codes(fmt, dim)
    if fmt.group_size % 4 or (dim * fmt.bits // 8) % 4:
        return "groups or packed rows not a multiple of 4"
    return path_codes(fmt, dim)


def smem_bytes(layout: PageLayout, block_m: int, stages: int, ksplit: int, block_n: int = BLOCK_N,
               ws: bool = False) -> int:
    """Dynamic shared memory of one CTA, bytes: the same map as mla_decode.cu (which asserts they agree)."""
    tok = layout.token
    fb = tok.field_bytes
    ldk = tok.d_c + tok.d_r + 8

    def a16(n: int) -> int:
        return (n + 15) // 16 * 16

    direct = not tok.fmt.content.quantized and not tok.fmt.rope.quantized
    bn = block_n
    rope_meta = layout.tile_rope_meta_bytes(bn)
    codes = a16(a16(bn * fb["content_codes"]) + bn * fb["rope_codes"])
    raw = a16(a16(codes + bn * fb["content_meta"]) + rope_meta)
    raw = bn * ldk * 2 if direct else raw
    q = block_m * ldk * 2
    kv = 0 if direct else (2 if ws else 1) * bn * ldk * 2
    s = ksplit * block_m * (bn + 8) * 4
    p = block_m * (bn + 8) * 2
    return q + kv + stages * raw + s + p + 3 * block_m * 4 + 16 + 8 * stages  # + an mbarrier per stage


def chosen(layout: PageLayout, rows: int) -> bool:
    """Whether the API's default takes this kernel where the heads-as-M kernel (warpgroup.py, the first choice at 64
    rows or more on Hopper) cannot run, by the H200 measurements (lab/results/kernels/decode_vs_peer_h200.json against
    decode_triton_h200.json): at 16 query rows it is the faster kernel in every format; at 128 rows it is for integer
    content codes only (FP8 runs faster in Triton's 64-row tiles before Hopper)."""
    fmt = layout.token.fmt.content
    return rows <= 16 or (fmt.quantized and fmt.mode != "fp8")


def built_tile_plan(layout: PageLayout, rows: int, out_dtype: torch.dtype, *, num_warps: int | None = None,
                    block_n: int | None = None, ksplit: int | None = None) -> DecodePlan | None:
    """The built-tile build for `layout` and `rows` on a device that can run it (decode_plan checks that), or
    None with the reason in ``plan_reason[layout]``; the tiling as decode_plan says."""
    if num_warps is None and block_n is None:
        for nw, bn in ((16, 64), (NUM_WARPS, BLOCK_N)) if rows > 16 else ((NUM_WARPS, BLOCK_N),):
            plan = built_tile_plan(layout, rows, out_dtype, num_warps=nw, block_n=bn, ksplit=ksplit)
            if plan is not None:
                return plan
        return None

    def no(why: str) -> None:
        plan_reason[layout] = why

    tok = layout.token
    nw, bn = num_warps or NUM_WARPS, block_n or BLOCK_N
    if nw not in (8, 16) or bn not in (32, 64):
        return no(f"a tiling of {nw} warps and {bn}-token tiles (it has 8 or 16 warps, 32 or 64 tokens)")
    if tok.d_c % (16 * nw) or tok.d_r % 16 or layout.page_size % bn:
        return no(f"d_c {tok.d_c} (multiple of {16 * nw}), d_r {tok.d_r} (of 16), page size "
                  f"{layout.page_size} (of {bn})")
    paths = [_path(tok.fmt.content, tok.d_c), _path(tok.fmt.rope, tok.d_r)]
    bad = [p for p in paths if isinstance(p, str)]
    if bad:
        return no(bad[0])
    fb = tok.field_bytes
    if any((bn * fb[k]) % 16 for k in fb):
        return no(f"a section of a {bn}-token tile is not whole 16-byte chunks")
    (ck, cb, cg, cm), (rk, rb, rg, rm) = paths
    # fp16 tile when every quantized path keeps fp16 metadata and none is raw bf16 or e4m3
    half = all(k in (_KIND["affine"], _KIND["symmetric"]) and m == 2 for k, _, _, m in paths)
    r_page = tok.fmt.rope.per_page
    r_blk = layout.rope_meta_block
    if not layout.tile_covers_rope_sets(bn):
        return no(f"RoPE path {tok.fmt.rope.describe()}: a metadata set per {r_blk} tokens against {bn}-token tiles "
                  "(a tile covers whole sets or lies in one)")
    if r_page and not ((half and rm == 2) or (not half and rm == 3 and rb <= 4)):
        return no(f"RoPE path {tok.fmt.rope.describe()}: a page's metadata is read in the tile's 16-bit type "
                  "(fp16 metadata with an fp16 tile, or bf16 metadata with codes of at most 4 bits)")
    pmb = layout.rope_meta_set_bytes
    if pmb % 16:
        return no(f"a RoPE metadata set of the page ({pmb} bytes) is not whole 16-byte chunks")
    rm_ = 1 if rows <= 16 else 2 if rows <= 32 else 4
    block_m = 16 * rm_
    # 16 warps of 32-token tiles at 16 rows: warp-specialized (8 compute, 8 copy and build)
    ws = nw == 16 and bn == 32 and block_m == 16 and any(k != _KIND["raw"] for k, _, _, _ in paths)
    nwc = nw // 2 if ws else nw  # warps that compute
    ot = rm_ * (bn // 8)
    if ksplit is None:  # 16 rows: four channel shares, so a warp's query fragments fit in 36 registers
        ksplit = nwc // ot if ot < nwc else 1
        if block_m == 16 and (ot * 4) % nwc == 0 and (bn // 8) % max(1, ot * 4 // nwc) == 0:
            ksplit = 4
        if (tok.d_c + tok.d_r) % (16 * ksplit):
            ksplit = 1
    if (ot * ksplit) % nwc or (tok.d_c + tok.d_r) % (16 * ksplit) or (bn // 8) % max(1, ot * ksplit // nwc):
        return no("score tiles do not split over the warps")
    stages = ctas = 0

    def size(s: int) -> int:
        return smem_bytes(layout, block_m, s, ksplit, bn, ws)

    for want in (1,) if ws else (2, 1):  # WS: 16 warps of up to 128 registers, one CTA per SM
        fits = [s for s in (4, 3, 2) if size(s) + SMEM_RESERVED <= SMEM_PER_SM // want and size(s) <= SMEM_PER_CTA]
        if fits:
            stages, ctas = fits[0], want
            break
    if not stages:
        return no("the tile does not fit in shared memory")
    o = layout.offsets
    smem = size(stages)
    macros = dict(
        D_C=tok.d_c, D_R=tok.d_r, PS=layout.page_size, PAGE_BYTES=layout.page_bytes,
        OFF_CC=o["content_codes"], OFF_RC=o["rope_codes"], OFF_CM=o["content_meta"],
        OFF_RM=o["rope_page_meta"] if r_page else o["rope_meta"],
        FB_CC=fb["content_codes"], FB_RC=fb["rope_codes"], FB_CM=fb["content_meta"], FB_RM=fb["rope_meta"],
        C_KIND=ck, C_BITS=cb, C_GS=cg, C_MB=cm, R_KIND=rk, R_BITS=rb, R_GS=rg, R_MB=rm,
        HALF=int(half), RM=rm_, NW=nw, BN=bn, KSPLIT=ksplit, STAGES=stages, MIN_CTAS=ctas,
        WS=int(ws), OUT_KIND=_OUT[out_dtype], SMEM_EXPECTED=smem, **partial_macros(layout),
    )
    if r_page:  # absent otherwise: the plans (and their builds) of per-token formats stay as they are
        macros.update(R_PAGE=1, PMB_R=pmb)
        if r_blk != layout.page_size:
            macros.update(R_BLK=r_blk)
    return DecodePlan(tuple(sorted(macros.items())), block_m, stages, ctas, smem)


