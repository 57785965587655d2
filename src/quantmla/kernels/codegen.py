"""Generated decode kernels that apply docs/design.md §5's kernel trick, one kernel per cache format.

For affine groups (symmetric ones are affine with ``zero = −2^(b−1)·scale``)

    q·ĉ      = Σ_g s_g (q_g · codes_g) + z_g Σ q_g
    Σ_t p_t ĉ_t = Σ_t (p_t s_{t,g}) codes_t + Σ_t p_t z_{t,g}

so the tensor cores see the codes as exact small integers in bf16 and the scales act on the
[rows, tokens] scores and probabilities, never on every channel. A code c < 16 becomes the bf16
``128 + c`` with one OR (bits ``0x4300 | c``); the offset 128 is taken out exactly through the
same per-group sums (``− 128 s_g Σ q_g`` for the scores, ``− 128 Σ_t bf16(p_t s_t)`` for the output,
using the very bf16 values the tensor cores multiplied). 8-bit codes go through fp32 exactly.

The work is split into *chunks*: ``W = min(group, bytes per plane)`` consecutive channels of one
bit plane, read as one [tokens, W] byte tile. Each chunk has its own query slice and (content
path) its own output accumulator, so the number of chunks is part of the kernel's code: this module
writes the kernel source for a format into a cache folder and imports it (Triton needs source
files). Formats whose chunks are narrower than 16 channels (the tensor-core minimum) use the
generic kernel in ``decode.py``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from quantmla.cache.layout import PageLayout
from quantmla.quant.format import PathFormat

_MODULES: dict[str, object] = {}
GENERATOR_VERSION = "8"


@dataclass(frozen=True)
class Chunk:
    idx: int
    ch0: int  # first channel
    width: int  # channels
    plane: int
    byte0: int  # first byte of its [tokens, width] byte tile inside the token's codes
    group: int


def chunks_of(fmt: PathFormat, dim: int) -> list[Chunk] | None:
    """The chunks of a path, or None if the path is BF16 (one raw chunk) ... see ``plan``."""
    if not fmt.quantized:
        return [Chunk(0, 0, dim, 0, 0, 0)]
    nb = dim * fmt.bits // 8
    w = min(fmt.group_size, nb)
    out = []
    for k in range(8 // fmt.bits):
        for r in range(nb // w):
            ch0 = k * nb + r * w
            out.append(Chunk(len(out), ch0, w, k, r * w, ch0 // fmt.group_size))
    return out


def supported(layout: PageLayout) -> bool:
    """True when every chunk of both paths is at least 16 channels wide (tensor-core K minimum) and the RoPE
    metadata is per token."""
    tok = layout.token
    if tok.fmt.rope.per_page:  # its scales are the page's, per channel: the generic kernel reads them
        return False
    for fmt, dim in ((tok.fmt.content, tok.d_c), (tok.fmt.rope, tok.d_r)):
        if fmt.quantized and (fmt.mode not in ("affine", "symmetric") or fmt.bits not in (2, 4, 8) or fmt.meta_elem_bytes != 2):
            return False
        if min(c.width for c in chunks_of(fmt, dim)) < 16:
            return False
    return True


def _plane_asm(bits: int, plane: int) -> str:
    """PTX for 4 packed bytes -> 4 bf16 (128 + code of `plane`), two bf16x2 registers."""
    shift = plane * bits
    m = (1 << bits) - 1
    mask = f"0x{m:04X}{m:04X}"
    sh = f"shr.b32 t0, t0, {shift}; shr.b32 t1, t1, {shift}; " if shift else ""
    return (
        "{ .reg .b32 t0, t1; "
        "prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342; "
        + sh
        + f"lop3.b32 $0, t0, {mask}, 0x43004300, 0xEA; lop3.b32 $1, t1, {mask}, 0x43004300, 0xEA; }}"
    )


def _path_source(
    name: str, fmt: PathFormat, dim: int, off_codes: int, off_meta: int, content: bool, unpack: str = "asm",
    orient: str = "heads",
) -> dict[str, list[str]]:
    """Code fragments of one path ("c" content, "r" rope): prologue, tile, scores, pv, epilogue.

    orient "heads": scores are [rows, tokens] (rows = the MMA M dimension); "tokens": the transposed
    problem, scores [tokens, rows] and outputs [channels, rows], so a tile of 64+ tokens (and 64+
    channels for the output) fills the M dimension of Hopper's wgmma even with 16 heads."""
    P = name  # variable prefix
    T = orient == "tokens"
    TV = "[:, None]" if T else "[None, :]"  # a per-token vector broadcast over the score tile
    RV = "[None, :]" if T else "[:, None]"  # a per-row vector broadcast
    AX = 0 if T else 1  # the token axis of the score tile

    def qload(ch0: str, w: int) -> str:
        if T:
            return f"tl.load({Q} + qrow[None, :] * {dim} + ({ch0} + tl.arange(0, {w}))[:, None], mask=rmask[None, :], other=0.0)"
        return f"tl.load({Q} + qrow[:, None] * {dim} + ({ch0} + tl.arange(0, {w}))[None, :], mask=rmask[:, None], other=0.0)"

    def sdot(q: str, x: str, acc: str | None = None) -> str:
        a = f", {acc}" if acc else ""
        return f"tl.dot({x}, {q}{a})" if T else f"tl.dot({q}, tl.trans({x}){a})"

    def pvdot(pb: str, x: str) -> str:
        return f"tl.dot(tl.trans({x}), {pb})" if T else f"tl.dot({pb}, {x})"

    def accshape(w: int) -> str:
        return f"[{w}, BLOCK_M]" if T else f"[BLOCK_M, {w}]"

    store = "_store_out_t" if T else "_store_out"
    Q = "QC" if content else "QR"
    V16 = "PC16" if content else "PR16"
    chunks = chunks_of(fmt, dim)
    pro, tile, score, pv, epi, init = [], [], [], [], [], []
    if not fmt.quantized:
        pro.append(f"q{P}0 = {qload('0', dim)}")
        pro.append(f"if DOT_F32:\n        q{P}0 = q{P}0.to(tl.float32)")
        tile.append(f"x{P}0 = tl.load({V16} + (page16 + {off_codes // 2} + tok * {dim})[:, None] + tl.arange(0, {dim})[None, :], mask=tmask[:, None], other=0.0)")
        tile.append(f"if DOT_F32:\n            x{P}0 = x{P}0.to(tl.float32)")
        score.append(f"s = {sdot(f'q{P}0', f'x{P}0', 's')}")
        if content:
            init.append(f"acc{P}0 = tl.zeros({accshape(dim)}, tl.float32)")
            pv.append("if DOT_F32:\n            pb = _bf16_rne(p).to(tl.float32)\n        else:\n            pb = p.to(tl.bfloat16)")
            pv.append(f"acc{P}0 = acc{P}0 * alpha{RV} + {pvdot('pb', f'x{P}0')}")
            epi.append(f"o{P}0 = acc{P}0 / l_safe{RV}")
            epi.append(f"{store}(OUT, PO, LSE, PLSE, qrow, prow, rmask, o{P}0, {dim}, 0, tl.arange(0, {dim}), nsplit)")
        return dict(pro=pro, init=init, tile=tile, score=score, pv=pv, epi=epi)

    bits, gs = fmt.bits, fmt.group_size
    nb = dim * bits // 8
    F = fmt.meta_fields
    G = dim // gs
    mask = (1 << bits) - 1
    off = 0 if bits == 8 else 128  # the magic offset carried by the bf16 codes
    groups = sorted({c.group for c in chunks})
    for c in chunks:
        pro.append(f"q{P}{c.idx} = {qload(str(c.ch0), c.width)}")
    for g in groups:
        terms = " + ".join(f"tl.sum(q{P}{c.idx}.to(tl.float32), {AX})" for c in chunks if c.group == g)
        pro.append(f"qs{P}{g} = {terms}")
    for c in chunks:
        pro.append(f"if DOT_F32:\n        q{P}{c.idx} = q{P}{c.idx}.to(tl.float32)")
    # tile: metadata per group, byte tiles per byte range, codes per chunk
    # metadata is prefetched one tile ahead (loop-carried), so its latency hides behind the math
    def meta_loads(sfx: str, p16: str, tk: str, msk: str) -> list[str]:
        out = [f"mb{P}{sfx} = {p16} + {off_meta // 2} + {tk} * {G * F}"]
        for g in groups:
            out.append(f"sc{P}{g}{sfx} = tl.load({V16} + mb{P}{sfx} + {g * F}, mask={msk}, other=0.0)")
            if fmt.mode == "affine":
                out.append(f"zl{P}{g}{sfx} = tl.load({V16} + mb{P}{sfx} + {g * F + 1}, mask={msk}, other=0.0)")
        return out

    meta_first = meta_loads("", "page16", "tok", "tmask")
    meta_next = meta_loads("_n", "page16_n", "tok_n", "tmask_n")
    meta_rotate = [f"sc{P}{g} = sc{P}{g}_n" for g in groups]
    if fmt.mode == "affine":
        meta_rotate += [f"zl{P}{g} = zl{P}{g}_n" for g in groups]
    for g in groups:
        tile.append(f"scf{P}{g} = sc{P}{g}.to(tl.float32)")
        if fmt.mode == "affine":
            tile.append(f"zc{P}{g} = zl{P}{g}.to(tl.float32)")
        else:
            tile.append(f"zc{P}{g} = scf{P}{g} * {-float(1 << (bits - 1))}")
        if content:  # the zero point in units of the scale, less the codes' offset (masked tokens: scale 0)
            tile.append(f"zr{P}{g} = tl.where(scf{P}{g} != 0.0, zc{P}{g} / scf{P}{g}, 0.0) - {float(off)}")
    tile.append(f"cb{P} = page8 + {off_codes} + tok * {nb}")
    for byte0 in sorted({c.byte0 for c in chunks}):
        w = next(c.width for c in chunks if c.byte0 == byte0)
        tile.append(
            f"by{P}{byte0} = tl.load(P8 + cb{P}[:, None] + ({byte0} + tl.arange(0, {w}))[None, :], mask=tmask[:, None], other=0)"
        )
    for c in chunks:
        src = f"by{P}{c.byte0}"
        if bits == 8:
            tile.append(f"x{P}{c.idx} = _codes8({src}, DOT_F32)")
        else:
            shifted = src if c.plane == 0 else f"({src} >> {c.plane * bits})"
            masked = shifted if c.plane == 8 // bits - 1 else f"({shifted} & {mask})"
            if unpack == "asm":
                tile.append(
                    f"if DOT_F32:\n            x{P}{c.idx} = _codes_magic({masked}, DOT_F32)\n        else:\n"
                    f"            x{P}{c.idx} = tl.inline_asm_elementwise(\"{_plane_asm(bits, c.plane)}\", \"=r,=r,r\", [{src}], "
                    f"dtype=tl.bfloat16, is_pure=False, pack=4)"
                )
            else:
                tile.append(f"x{P}{c.idx} = _codes_magic({masked}, DOT_F32)")
    # scores: Σ_g s_g · (q_g · (codes + off)) + Σ q_g · (z_g − off · s_g)
    for g in groups:
        cs = [c for c in chunks if c.group == g]
        expr = sdot(f"q{P}{cs[0].idx}", f"x{P}{cs[0].idx}")
        for c in cs[1:]:
            expr = sdot(f"q{P}{c.idx}", f"x{P}{c.idx}", expr)
        score.append(f"s += {expr} * scf{P}{g}{TV}")
        zterm = f"zc{P}{g}" if off == 0 else f"(zc{P}{g} - {float(off)} * scf{P}{g})"
        score.append(f"s += qs{P}{g}{RV} * {zterm}{TV}")
    if content:
        for c in chunks:
            init.append(f"acc{P}{c.idx} = tl.zeros({accshape(c.width)}, tl.float32)")
        for g in groups:
            init.append(f"zacc{P}{g} = tl.zeros([BLOCK_M], tl.float32)")
        for g in groups:
            pv.append(f"pt = p * scf{P}{g}{TV}")
            pv.append(
                f"if DOT_F32:\n            pb{g} = _bf16_rne(pt).to(tl.float32)\n            pbf = pb{g}\n"
                f"        else:\n            pb{g} = pt.to(tl.bfloat16)\n            pbf = pb{g}.to(tl.float32)"
            )
            # Σ_t w_t (z_t / s_t − off) with the same rounded weights w = bf16(p·s) the codes were
            # multiplied by: the output is Σ_t (w_t / s_t)·ĉ_t, each value weighted by p_t(1 + δ), |δ| ≤ 2^-9,
            # as in the BF16 path (weighting the zero point by the unrounded p instead leaves an error
            # of order |z|/|ĉ| times larger)
            pv.append(f"zacc{P}{g} = zacc{P}{g} * alpha + tl.sum(pbf * zr{P}{g}{TV}, {AX})")
            for c in chunks:
                if c.group == g:
                    pv.append(f"acc{P}{c.idx} = acc{P}{c.idx} * alpha{RV} + {pvdot(f'pb{g}', f'x{P}{c.idx}')}")
        for c in chunks:
            epi.append(f"o{P}{c.idx} = (acc{P}{c.idx} + zacc{P}{c.group}{RV}) / l_safe{RV}")
            epi.append(
                f"{store}(OUT, PO, LSE, PLSE, qrow, prow, rmask, o{P}{c.idx}, {dim}, {c.ch0}, tl.arange(0, {c.width}), nsplit)"
            )
    return dict(
        pro=pro, init=init, tile=tile, score=score, pv=pv, epi=epi,
        meta_first=meta_first, meta_next=meta_next, meta_rotate=meta_rotate,
    )


UNPACK_MODES = ("asm", "tl")
ORIENTS = ("heads", "tokens")


def kernel_source(layout: PageLayout, unpack: str = "asm", orient: str = "heads") -> str:
    """Source of the fused kernel. unpack: "asm" (codes -> bf16 in inline PTX, done once in the
    load layout: prmt + lop3, two codes per instruction) or "tl" (plain Triton ops, which the
    compiler may redo in each dot-operand layout)."""
    if unpack not in UNPACK_MODES or orient not in ORIENTS:
        raise ValueError(f"unpack must be one of {UNPACK_MODES}, orient one of {ORIENTS}")
    tok = layout.token
    o = layout.offsets
    cp = _path_source("c", tok.fmt.content, tok.d_c, o["content_codes"], o["content_meta"], True, unpack, orient)
    rp = _path_source("r", tok.fmt.rope, tok.d_r, o["rope_codes"], o["rope_meta"], False, unpack, orient)
    T = orient == "tokens"
    s_shape = "[BLOCK_N, BLOCK_M]" if T else "[BLOCK_M, BLOCK_N]"
    vis = "(t[:, None] < limit[None, :]) & tmask[:, None]" if T else "(t[None, :] < limit[:, None]) & tmask[None, :]"
    AX = 0 if T else 1
    RV = "[None, :]" if T else "[:, None]"

    def block(lines: list[str], indent: str) -> str:
        return "\n".join(indent + ln for ln in lines)

    meta_first = cp.get("meta_first", []) + rp.get("meta_first", [])
    meta_rotate = cp.get("meta_rotate", []) + rp.get("meta_rotate", [])
    meta_next_block = []
    if meta_first:
        meta_next_block = [
            "t_n = t + BLOCK_N",
            "tmask_n = t_n < end",
            f"page_n = tl.load(bt_row + t_n // {layout.page_size}, mask=tmask_n, other=0).to(tl.int64)",
            f"tok_n = t_n % {layout.page_size}",
            f"page16_n = page_n * {layout.page_bytes // 2}",
        ] + cp.get("meta_next", []) + rp.get("meta_next", [])
    if not meta_first:
        meta_first = ["pass"]
        meta_rotate = ["pass"]
        meta_next_block = ["pass"]

    ps, pb = layout.page_size, layout.page_bytes
    return f'''# Generated by quantmla.kernels.codegen (v{GENERATOR_VERSION}, unpack={unpack}, orient={orient}) for {tok.fmt.describe()}, d_c={tok.d_c}, d_r={tok.d_r},
# page {ps} tokens / {pb} bytes, offsets {dict(o)}. Do not edit.
import triton
import triton.language as tl

from quantmla.kernels.decode import _bf16_rne, _partial, unit_rows, work_unit


@triton.jit
def _codes_magic(x, DOT_F32: tl.constexpr):
    """codes < 16 (any int type) -> bf16 128 + code (exact), or its fp32 value in the interpreter.
    The 32 -> 16-bit truncation keeps Triton from hoisting the dot-operand layout conversion above
    the unpacking (which would read single bytes from shared memory)."""
    y = (x.to(tl.int32) | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    if DOT_F32:
        y = (x.to(tl.int32) + 128).to(tl.float32)
    return y


@triton.jit
def _codes8(x, DOT_F32: tl.constexpr):
    """8-bit codes -> exact bf16 through fp32 (0x4B000000 | c is 2^23 + c)."""
    f = (x.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    if DOT_F32:
        y = f
    else:
        y = f.to(tl.bfloat16)
    return y


@triton.jit
def _store_out(OUT, PO, LSE, PLSE, qrow, prow, rmask, o, D: tl.constexpr, CH0: tl.constexpr, ch, nsplit):
    if nsplit == 1:
        tl.store(OUT + qrow[:, None] * D + CH0 + ch[None, :], o.to(OUT.dtype.element_ty), mask=rmask[:, None])
    else:
        tl.store(PO + prow[:, None] * D + CH0 + ch[None, :], _partial(o, PO), mask=rmask[:, None])


@triton.jit
def _store_out_t(OUT, PO, LSE, PLSE, qrow, prow, rmask, o, D: tl.constexpr, CH0: tl.constexpr, ch, nsplit):
    """o: [channels, rows] (transposed orientation)."""
    if nsplit == 1:
        tl.store(OUT + qrow[None, :] * D + CH0 + ch[:, None], o.to(OUT.dtype.element_ty), mask=rmask[None, :])
    else:
        tl.store(PO + prow[None, :] * D + CH0 + ch[:, None], _partial(o, PO), mask=rmask[None, :])


@triton.jit(do_not_specialize=["stride_bt", "H", "SQ", "R", "CAUSAL"])
def mla_decode_fused(
    QC, QR, P8, PC16, PR16, BT, SEQLENS, UNITS, OUT, LSE, PO, PLSE,
    stride_bt, H, SQ, R, CAUSAL, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    hb = tl.program_id(0)
    u = tl.program_id(1)
    b, start, end, nsplit, L = work_unit(UNITS, SEQLENS, u)
    rows, rmask, limit, qrow = unit_rows(hb, b, L, H, SQ, R, CAUSAL, BLOCK_M)
    prow = u.to(tl.int64) * R + rows
{block(cp["pro"], "    ")}
{block(rp["pro"], "    ")}
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
{block(cp["init"], "    ")}
    bt_row = BT + b.to(tl.int64) * stride_bt
    t = start + tl.arange(0, BLOCK_N)
    tmask = t < end
    page = tl.load(bt_row + t // {ps}, mask=tmask, other=0).to(tl.int64)
    tok = t % {ps}
    page16 = page * {pb // 2}
{block(meta_first, "    ")}
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        page = tl.load(bt_row + t // {ps}, mask=tmask, other=0).to(tl.int64)
        tok = t % {ps}
        page8 = page * {pb}
        page16 = page * {pb // 2}
{block(meta_next_block, "        ")}
{block(cp["tile"], "        ")}
{block(rp["tile"], "        ")}
        s = tl.zeros({s_shape}, tl.float32)
{block(cp["score"], "        ")}
{block(rp["score"], "        ")}
        s = s * qk_scale
        vis = {vis}
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, {AX}))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe{RV})
        l_i = l_i * alpha + tl.sum(p, {AX})
{block(cp["pv"], "        ")}
        m_i = m_new
{block(meta_rotate, "        ")}
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
{block(cp["epi"], "    ")}
    if nsplit == 1:
        tl.store(LSE + qrow, lse, mask=rmask)
    else:
        tl.store(PLSE + prow, lse, mask=rmask)
'''


def _cache_dir() -> Path:
    d = os.environ.get("QUANTMLA_KERNEL_CACHE") or os.path.join(tempfile.gettempdir(), f"quantmla-kernels-{os.getuid()}")
    p = Path(d)
    p.mkdir(parents=True, exist_ok=True)
    return p


_BY_LAYOUT: dict = {}


def fused_kernel(layout: PageLayout, unpack: str = "asm", orient: str = "heads"):
    """The generated ``mla_decode_fused`` Triton kernel for `layout` (written and imported once)."""
    key = (layout, layout.page_bytes, tuple(layout.offsets.items()), unpack, orient)
    fn = _BY_LAYOUT.get(key)
    if fn is None:
        fn = _BY_LAYOUT[key] = _load(layout, unpack, orient)
    return fn


def _load(layout: PageLayout, unpack: str, orient: str):
    src = kernel_source(layout, unpack, orient)
    h = hashlib.sha1(src.encode()).hexdigest()[:16]
    if h in _MODULES:
        return _MODULES[h].mla_decode_fused
    path = _cache_dir() / f"mla_decode_{h}.py"
    if not path.exists() or path.read_text() != src:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(src)
        os.replace(tmp, path)
    name = f"quantmla_generated_mla_decode_{h}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    _MODULES[h] = mod
    return mod.mla_decode_fused
