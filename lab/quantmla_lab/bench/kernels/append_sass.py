"""Static SASS of the append kernel, without a GPU: for each format and tiling, `_append_kernel` compiled for sm_90
with the constants `append_to_pages` passes, and its instructions, CTA barriers (`BAR`), shared-memory stores and
loads and warp shuffles counted. A group whose reduction spans warps goes through shared memory and barriers.

    TRITON_INTERPRET=0 PYTHONPATH=src:lab python3 -m quantmla_lab.bench.kernels.append_sass \
        --out lab/results/kernels/append_sass_sm90.json

Counts are of the whole kernel as compiled (both paths' code where the paths are apart), by this machine's Triton
and its bundled ptxas; another Triton version can count otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch

from quantmla.cache.layout import PageLayout, TokenLayout
from quantmla.kernels import support
from quantmla_lab.bench.common import parse_fresh, record, save
from quantmla_lab.bench.kernels.append_tilings import parse_tiling
from quantmla_lab.bench.kernels.decode_speed import D_C, D_R, METHODS, PAGE
from quantmla_lab.bench.kernels.sass_count import cuobjdump

_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.uint8: "*u8"}
COUNTS = {"BAR": r"\bBAR\.", "STS": r"\bSTS\b", "LDS": r"\bLDS\b", "SHFL": r"\bSHFL\."}


def compile_append(layout: PageLayout, block_t: int, warps: int, apart: bool):
    """`_append_kernel` for `layout` compiled for sm_90 (bf16 inputs, int64 slots), as append_to_pages launches it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantmla.kernels.append import _append_kernel

    pages = torch.zeros(2, layout.page_bytes, dtype=torch.uint8)
    _, pc, pr = support.page_views(pages, layout)
    consts, (cbf, rbf) = support.layout_constexprs(layout)
    consts.pop("R_PAGE")
    fmt = layout.token.fmt
    consts.update(C_BF16=cbf, R_BF16=rbf, BLOCK_T=block_t, R_WRITE=True, C_CLIP=fmt.content.clip_exp,
                  R_CLIP=fmt.rope.clip_exp)
    if "PATHS_APART" in _append_kernel.arg_names:  # (a library before the knob compiles with the paths together)
        consts["PATHS_APART"] = apart
    elif apart:
        raise SystemExit("this library's append kernel has no PATHS_APART: give WARPS:0 tilings")
    sig = {"XC": "*bf16", "XR": "*bf16", "SLOTS": "*i64", "P8": "*u8", "PC16": _PTR[pc.dtype], "PR16": _PTR[pr.dtype],
           "T": "i32", "stride_xc": "i32", "stride_xr": "i32", **{k: "constexpr" for k in consts}}
    src = ASTSource(fn=_append_kernel, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def sass_counts(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ins = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    return {"instructions": len(ins), **{k: sum(1 for ln in ins if re.search(p, ln)) for k, p in COUNTS.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["bf16", "fp8", "int4/int4", "int2/int4"], choices=list(METHODS))
    p.add_argument("--tilings", nargs="+", default=["4:0", "4:1", "1:0", "1:1"], metavar="WARPS:APART")
    p.add_argument("--block-t", type=int, default=1, help="tokens a program")
    p.add_argument("--out", default=None)
    a = parse_fresh(p) if argv is None else p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1: kernels defined under the interpreter cannot be compiled; set it to 0")
    tilings = [parse_tiling(t) for t in a.tilings]
    if any(w is None for w, _ in tilings):
        raise SystemExit("--tilings: give WARPS:APART pairs (the default depends on the tokens of a call)")
    import triton

    res = record(triton=triton.__version__, target="sm_90", block_t=a.block_t, rows=[])
    for m in a.methods:
        layout = PageLayout(TokenLayout(D_C, D_R, METHODS[m]), PAGE)
        for w, apart in tilings:
            c = sass_counts(compile_append(layout, a.block_t, w, apart).asm["cubin"])
            res["rows"].append({"method": m, "warps": w, "paths_apart": apart, **c})
            print(f"{m:10s} {w} warps apart {int(apart)}  " + "  ".join(f"{k} {v}" for k, v in c.items()), flush=True)
    save(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
