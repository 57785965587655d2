"""The CUDA C++ decode path (``mla_decode.cu``): one build per cache layout, cached on disk, launched on
torch's current stream (so CUDA graphs capture it).

    plan = decode_plan(layout, rows, out_dtype, device)   # None (with plan_reason) where it cannot run
    launch_decode(plan, grid, args)                        # the same arguments as the Triton kernel

A plan fixes the kernel's constants: the layout (section offsets, field bytes, formats), the 16-bit tile
type (fp16 when every quantized path stores fp16 metadata and no path is raw BF16, else bf16), BM = 16·RM
query rows per CTA, 8 warps, BN = 32 tokens per tile and the cp.async stages that fit two CTAs per SM
(one where they do not). ``build.py`` compiles it with nvcc into a cubin under ``QUANTMLA_CUDA_CACHE``
(default ``~/.cache/quantmla/cuda``); ``driver.py`` loads it through the CUDA driver API.

``QUANTMLA_DECODE_KERNEL=triton`` turns this path off; ``=cuda`` makes a failed build an error instead
of a fall back to Triton with a warning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from quantmla.cache.layout import PageLayout
from quantmla.quant.format import PathFormat

NUM_WARPS = 8
BLOCK_N = 32
SMEM_PER_SM = 233472  # H100/H200: 228 KiB per SM
SMEM_PER_CTA = 232448  # 227 KiB per block
SMEM_RESERVED = 1024  # per CTA, by the runtime

_KIND = {"raw": 0, "affine": 1, "symmetric": 2, "fp8": 3}
_MB = {"float16": 2, "bfloat16": 3, "float32": 4}
_OUT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def mode() -> str:
    """"auto" (default), "cuda" (errors instead of falling back) or "triton" (this path off)."""
    m = os.environ.get("QUANTMLA_DECODE_KERNEL", "auto").strip().lower()
    return m if m in ("auto", "cuda", "triton") else "auto"


@dataclass(frozen=True)
class DecodePlan:
    """The constants of one build (macros of mla_decode.cu) and its launch shape."""

    macros: tuple[tuple[str, int], ...]
    block_m: int
    stages: int
    ctas_per_sm: int
    smem: int

    @property
    def block_n(self) -> int:
        return dict(self.macros)["BN"]

    @property
    def num_warps(self) -> int:
        return dict(self.macros)["NW"]

    def describe(self) -> str:
        m = dict(self.macros)
        tile = "f16" if m["HALF"] else "bf16"
        ws = "ws" if m.get("WS") else ""
        frag = "/frag" if m.get("REG") else "/tm" if m.get("TM") else ""
        return f"cuda/{tile}{frag}/M{self.block_m}N{self.block_n}w{self.num_warps}{ws}s{self.stages}c{self.ctas_per_sm}"


def _path(fmt: PathFormat, dim: int) -> tuple[int, int, int, int] | str:
    """(kind, bits, group, metadata code) of a path, or why the CUDA kernel cannot read it."""
    if not fmt.quantized:
        return _KIND["raw"], 16, dim, 3
    if fmt.mode == "fp8":
        return (_KIND["fp8"], 8, fmt.group_size, _MB[fmt.meta_dtype]) if fmt.group_size % 16 == 0 else \
            "fp8 groups not a multiple of 16"
    if fmt.bits not in (2, 4, 8):
        return f"{fmt.bits}-bit codes"
    if fmt.per_page:  # the 8-byte build steps read a page's (scale, zero) per channel pair
        if (fmt.group_size != 1 and fmt.group_size % 2) or (dim * fmt.bits // 8) % 8:
            return "per-page groups of an odd number of channels, or packed rows not a multiple of 8"
        return _KIND[fmt.mode], fmt.bits, fmt.group_size, _MB[fmt.meta_dtype]
    if fmt.group_size % 4 or (dim * fmt.bits // 8) % 4:
        return "groups or packed rows not a multiple of 4"
    return _KIND[fmt.mode], fmt.bits, fmt.group_size, _MB[fmt.meta_dtype]


def smem_bytes(layout: PageLayout, block_m: int, stages: int, ksplit: int, block_n: int = BLOCK_N,
               ws: bool = False, fragments: bool = False) -> int:
    """Dynamic shared memory of one CTA, bytes: the same map as mla_decode.cu (which asserts they agree)."""
    tok = layout.token
    fb = tok.field_bytes
    ldk = tok.d_c + tok.d_r + 8

    def a16(n: int) -> int:
        return (n + 15) // 16 * 16

    def pitch(n: int) -> int:  # fragments: code rows an odd number of 16-byte chunks apart
        return n if not fragments or (n // 16) % 2 else n + 16

    direct = not tok.fmt.content.quantized and not tok.fmt.rope.quantized
    bn = block_n
    rope_meta = tok.page_field_bytes["rope_page_meta"] if tok.fmt.rope.per_page else bn * fb["rope_meta"]
    codes = a16(a16(bn * pitch(fb["content_codes"])) + bn * pitch(fb["rope_codes"]))
    raw = a16(a16(codes + bn * fb["content_meta"]) + rope_meta)
    raw = bn * ldk * 2 if direct else raw
    q = block_m * ldk * 2
    kv = 0 if direct or fragments else (2 if ws else 1) * bn * ldk * 2
    s = ksplit * block_m * (bn + 8) * 4
    p = block_m * (bn + 8) * 2
    return q + kv + stages * raw + s + p + 3 * block_m * 4 + 16 + 8 * stages  # + an mbarrier per stage


plan_reason: dict = {}


def chosen(layout: PageLayout, rows: int) -> bool:
    """Whether the API's default takes this kernel, by the H200 measurements (lab/results/kernels/
    decode_vs_peer_h200.json against decode_triton_h200.json): at 16 query rows it is the faster kernel in
    every format; at 128 rows it is for integer content codes only (BF16 and FP8 run faster in Triton's
    64-row tiles there)."""
    fmt = layout.token.fmt.content
    return rows <= 16 or (fmt.quantized and fmt.mode != "fp8")


def fragments_reason(layout: PageLayout, block_m: int, num_warps: int, block_n: int, ksplit: int,
                     ws: bool) -> str | None:
    """Why the fragments path (no built tile: the products expand the codes in registers, tile_frag.cuh)
    cannot read `layout` in this tiling, or None where it can."""
    tok = layout.token
    c, r = tok.fmt.content, tok.fmt.rope
    fb = tok.field_bytes
    if (block_m, num_warps, block_n, ksplit, ws) != (16, 8, 32, 4, False):
        return "the 16-row plan only (8 warps, 32-token tiles, four channel shares)"
    for f in (c, r):
        if not f.quantized or f.mode not in ("affine", "symmetric") or f.bits not in (2, 4) or f.per_page:
            return f"{f.describe()}: 2- or 4-bit integer codes with per-token metadata"
        if f.meta_dtype != "float16" or f.group_size % 16:
            return f"{f.describe()}: fp16 metadata and groups of whole 16-channel steps"
    if tok.d_r != 64 or tok.d_c != 512:
        return f"d_c {tok.d_c}, d_r {tok.d_r}: 512 and 64 channels"
    if any(f.mode == "affine" and fb[k] % 4 for f, k in ((c, "content_meta"), (r, "rope_meta"))):
        return "affine metadata rows of whole (scale, zero) pairs"
    return None


TM_BLOCK_N, TM_WARPS, TM_MAX_STAGES = 64, 4, 6


def tokens_m_reason(layout: PageLayout, rows: int) -> str | None:
    """Why the tokens-as-M kernel (mla_decode_tm.cu: tokens are the MMA's M dimension, the codes masked in
    place into its A operand) cannot read `layout` for `rows` query rows, or None where it can."""
    tok = layout.token
    c, r = tok.fmt.content, tok.fmt.rope
    if rows > 16:
        return f"{rows} query rows: it takes at most 16 (heads x query tokens)"
    if (tok.d_c, tok.d_r) != (512, 64):
        return f"d_c {tok.d_c}, d_r {tok.d_r}: it reads DeepSeek's geometry, 512 and 64"
    for f, name in ((c, "content"), (r, "RoPE")):
        if not f.quantized or f.mode != "affine" or f.bits not in (2, 4) or f.per_page or f.meta_dtype != "float16":
            return f"{name} path {f.describe()}: 2- or 4-bit affine codes with per-token fp16 metadata"
    if c.group_size % 64:
        return f"content groups of {c.group_size}: a multiple of 64 channels"
    if r.group_size % (tok.d_r * r.bits // 8) or tok.d_r % r.group_size:
        return f"RoPE groups of {r.group_size}: a whole number of code planes ({tok.d_r * r.bits // 8} channels)"
    if layout.page_size % TM_BLOCK_N:
        return f"page size {layout.page_size}: a multiple of {TM_BLOCK_N}"
    return None


def smem_bytes_tm(layout: PageLayout, stages: int) -> int:
    """Dynamic shared memory of one tokens-as-M CTA, bytes: the map of mla_decode_tm.cu (which asserts it)."""
    tok = layout.token
    fb = tok.field_bytes
    a16 = lambda n: (n + 15) // 16 * 16  # noqa: E731
    bn, bm, cg = TM_BLOCK_N, 16, tok.d_c // tok.fmt.content.group_size
    ng = cg + tok.d_r // tok.fmt.rope.group_size
    stage = a16(a16(a16(bn * fb["content_codes"]) + bn * fb["rope_codes"]) + bn * fb["content_meta"])
    stage = a16(stage + bn * fb["rope_meta"])
    head = a16(bm * (tok.d_c + tok.d_r + 8) * 2 + ng * bm * 4 + bm * 4 + cg * bm * (bn + 8) * 2)
    return head + stages * stage + TM_WARPS * bm * (1 + cg) * 4 + 8 * stages


def tokens_m_plan(layout: PageLayout, rows: int, out_dtype: torch.dtype, ctas_per_sm: int = 2) -> DecodePlan | str:
    """The tokens-as-M build for `layout` (or why there is none): the most stages (2 to TM_MAX_STAGES) that fit
    `ctas_per_sm` CTAs per SM (registers are capped to match: 2 CTAs allow 255 a thread, 3 allow 168)."""
    why = tokens_m_reason(layout, rows)
    if why:
        return why
    fits = [s for s in range(TM_MAX_STAGES, 1, -1)
            if ctas_per_sm * (smem_bytes_tm(layout, s) + SMEM_RESERVED) <= SMEM_PER_SM]
    if not fits:
        return f"the stages do not fit {ctas_per_sm} CTAs per SM in shared memory"
    tok, o = layout.token, layout.offsets
    fb = tok.field_bytes
    stages = fits[0]
    smem = smem_bytes_tm(layout, stages)
    macros = dict(
        TM=1, D_C=tok.d_c, D_R=tok.d_r, PS=layout.page_size, PAGE_BYTES=layout.page_bytes,
        OFF_CC=o["content_codes"], OFF_RC=o["rope_codes"], OFF_CM=o["content_meta"], OFF_RM=o["rope_meta"],
        FB_CC=fb["content_codes"], FB_RC=fb["rope_codes"], FB_CM=fb["content_meta"], FB_RM=fb["rope_meta"],
        C_BITS=tok.fmt.content.bits, C_GS=tok.fmt.content.group_size, R_BITS=tok.fmt.rope.bits,
        R_GS=tok.fmt.rope.group_size, HALF=1, NW=TM_WARPS, BN=TM_BLOCK_N, STAGES=stages, OUT_KIND=_OUT[out_dtype],
        SMEM_EXPECTED=smem, MIN_CTAS=ctas_per_sm,
    )
    return DecodePlan(tuple(sorted(macros.items())), 16, stages, ctas_per_sm, smem)


def decode_plan(layout: PageLayout, rows: int, out_dtype: torch.dtype, device: torch.device, *,
                num_warps: int | None = None, block_n: int | None = None, ksplit: int | None = None,
                fragments: bool | None = None, tokens_m: bool | None = None) -> DecodePlan | None:
    """The build that reads `layout` for `rows` query rows per sequence on `device`, or None (the reason
    is kept in ``plan_reason[layout]``): not CUDA, compute capability below 8.0, or a layout it cannot read.
    `num_warps` (8 or 16), `block_n` (tokens per tile, 32 or 64) and `ksplit` (warps sharing one score
    tile's channels) are the kernel's tiling; `fragments=True` takes the path without a built tile (None
    where it cannot read the layout); `tokens_m=True` the tokens-as-M kernel (mla_decode_tm.cu; None where it
    cannot read the layout, the reason from `tokens_m_reason`). Fragments are not the default: on the H200 it is slower than building the tile
    (INT4/INT4 at 32 x 16384: 161.4 against 140.1 us for the decode kernel,
    lab/results/kernels/decode_cuda_fragments_h200.json). Default: 8 warps and 32-token tiles at 16 rows; beyond 16
    rows 16 warps and 64-token tiles where they fit (one build per 64 tokens for twice the rows; INT4/INT4
    at 128 heads, 32 x 8192: 443 against 604 us on the H200, lab/results/kernels/decode_cuda_tilings_128h_h200.json)."""
    if tokens_m:
        if mode() == "triton":
            plan_reason[layout] = "QUANTMLA_DECODE_KERNEL=triton"
            return None
        if torch.device(device).type != "cuda" or (not torch.cuda.is_available() and not _assume_cuda()):
            plan_reason[layout] = "not a CUDA device"
            return None
        if torch.cuda.get_device_capability(device) < (9, 0):
            plan_reason[layout] = "tokens as M: needs compute capability 9.0 (bulk copies)"
            return None
        if out_dtype not in _OUT:
            plan_reason[layout] = f"output dtype {out_dtype}"
            return None
        plan = tokens_m_plan(layout, rows, out_dtype)
        if isinstance(plan, str):
            plan_reason[layout] = f"tokens as M: {plan}"
            return None
        return plan
    if num_warps is None and block_n is None:
        for nw, bn in ((16, 64), (NUM_WARPS, BLOCK_N)) if rows > 16 else ((NUM_WARPS, BLOCK_N),):
            plan = decode_plan(layout, rows, out_dtype, device, num_warps=nw, block_n=bn, ksplit=ksplit,
                               fragments=fragments)
            if plan is not None:
                return plan
        return None

    def no(why: str) -> None:
        plan_reason[layout] = why

    if mode() == "triton":
        return no("QUANTMLA_DECODE_KERNEL=triton")
    if torch.device(device).type != "cuda":
        return no("not a CUDA device")
    if not torch.cuda.is_available() and not _assume_cuda():
        return no("no CUDA device is available")
    if torch.cuda.get_device_capability(device) < (8, 0):
        return no("needs compute capability 8.0 or later (mma.sync bf16, cp.async)")
    tok = layout.token
    nw, bn = num_warps or NUM_WARPS, block_n or BLOCK_N
    if nw not in (8, 16) or bn not in (32, 64):
        return no(f"a tiling of {nw} warps and {bn}-token tiles (it has 8 or 16 warps, 32 or 64 tokens)")
    if tok.d_c % (16 * nw) or tok.d_r % 16 or layout.page_size % bn:
        return no(f"d_c {tok.d_c} (multiple of {16 * nw}), d_r {tok.d_r} (of 16), page size "
                  f"{layout.page_size} (of {bn})")
    if out_dtype not in _OUT:
        return no(f"output dtype {out_dtype}")
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
    if r_page and not ((half and rm == 2) or (not half and rm == 3 and rb <= 4)):
        return no(f"RoPE path {tok.fmt.rope.describe()}: a page's metadata is read in the tile's 16-bit type "
                  "(fp16 metadata with an fp16 tile, or bf16 metadata with codes of at most 4 bits)")
    pmb = tok.page_field_bytes["rope_page_meta"]
    if pmb % 16:
        return no(f"the RoPE page metadata ({pmb} bytes) is not whole 16-byte chunks")
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
    why_not = fragments_reason(layout, block_m, nw, bn, ksplit, ws)
    if fragments and why_not:
        return no(f"fragments: {why_not}")
    reg = bool(fragments) and why_not is None
    stages = ctas = 0

    def size(s: int) -> int:
        return smem_bytes(layout, block_m, s, ksplit, bn, ws, reg)

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
        WS=int(ws), OUT_KIND=_OUT[out_dtype], SMEM_EXPECTED=smem,
    )
    if r_page:  # absent otherwise: the plans (and their builds) of per-token formats stay as they are
        macros.update(R_PAGE=1, PMB_R=pmb)
    if reg:
        macros.update(REG=1)
    return DecodePlan(tuple(sorted(macros.items())), block_m, stages, ctas, smem)


def _assume_cuda() -> bool:
    """Tests plan builds on machines without a GPU by patching torch.cuda.get_device_capability."""
    try:
        torch.cuda.get_device_capability(0)
        return True
    except (RuntimeError, AssertionError, AttributeError):
        return False


def prepare(plan: DecodePlan, device: torch.device) -> None:
    """Build and load `plan` now (not at the first launch, which may be inside a CUDA-graph capture)."""
    from quantmla.kernels.cuda import driver
    from quantmla.kernels.cuda.build import cubin_for

    driver.function(cubin_for(plan.macros, device), "mla_decode", plan.smem, device)


def launch_decode(plan: DecodePlan, grid: tuple[int, int], args: tuple, device: torch.device) -> None:
    """Run the build of `plan` over grid (units, head blocks) on the current stream. `args` are the
    Triton decode kernel's: (qc, qr, pages, pc16, pr16, bt, seq_lens, units, out, lse, po, plse,
    stride_bt, H, S_q, R, causal, qk_scale·log2 e)."""
    from quantmla.kernels.cuda import driver
    from quantmla.kernels.cuda.build import cubin_for

    qc, qr, pages, _, _, bt, sl, units, out, lse, po, plse, stride_bt, H, SQ, R, causal, scale = args
    fn = driver.function(cubin_for(plan.macros, device), "mla_decode", plan.smem, device)
    # the kernel reads the queries in 16-byte pieces: a view that starts off a 16-byte boundary is copied
    qc, qr = (q if q.data_ptr() % 16 == 0 else q.clone() for q in (qc, qr))
    ptrs = [t.data_ptr() for t in (qc, qr, pages, bt, sl, units, out, lse, po, plse)]
    driver.launch(fn, grid, plan.num_warps * 32, plan.smem, torch.cuda.current_stream(device).cuda_stream,
                  [("p", p) for p in ptrs] + [("i", int(stride_bt)), ("i", int(H)), ("i", int(SQ)), ("i", int(R)),
                                              ("i", int(causal)), ("f", float(scale))])
