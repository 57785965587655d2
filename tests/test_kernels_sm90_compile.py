"""The GPU kernels compile for Hopper (sm_90) on a machine without a GPU.

The interpreter tests (test_kernels.py) check what the kernels compute, not that Triton's GPU
compiler accepts them: a layout, reduction or dtype the interpreter takes can still fail to compile.
Here each kernel the API launches by default is compiled ahead of time for ``GPUTarget("cuda", 90,
32)`` (Triton's bundled ptxas; nothing is launched), with the argument types and constexprs the API
passes: the fused decode kernels of the INT4/INT4, INT2/INT4 and BF16 formats at 16 and 128 heads,
the dequantizing kernel of the FP8 format, the split combine, the append and read kernels, and the
greedy tokens'.
Kernels defined under TRITON_INTERPRET=1 cannot be compiled, so the compiles run in one child
process with TRITON_INTERPRET=0 (this file run as a script), and each test reads its case's result.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from quantmla.cache.layout import PageLayout, TokenLayout, preset
from quantmla.kernels import api, codegen, support

triton = pytest.importorskip("triton")

D_C, D_R, PAGE = 512, 64, 64
_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.uint8: "*u8",
        torch.int32: "*i32", torch.int64: "*i64"}


def compile_sm90(fn, args: tuple, constexprs: dict, num_warps: int, num_stages: int):
    """Compile `fn` for sm_90 with the types of `args` (tensors, ints, floats) and `constexprs`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {}
    for name, a in zip(fn.arg_names, args):
        sig[name] = _PTR[a.dtype] if isinstance(a, torch.Tensor) else ("i32" if isinstance(a, int) else "fp32")
    for name in fn.arg_names[len(args):]:
        sig[name] = "constexpr"
    assert set(constexprs) == set(fn.arg_names[len(args):]), "every constexpr of the kernel is given"
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def _decode_args(layout: PageLayout, heads: int, partials: torch.dtype = torch.float32):
    pages = torch.zeros(4, layout.page_bytes, dtype=torch.uint8)
    _, pc, pr = support.page_views(pages, layout)
    q = torch.zeros(1, 1, heads, D_C, dtype=torch.bfloat16)
    qr = torch.zeros(1, 1, heads, D_R, dtype=torch.bfloat16)
    i32 = torch.zeros(4, dtype=torch.int32)
    out = torch.zeros(1, 1, heads, D_C, dtype=torch.bfloat16)
    f32 = torch.zeros(4, dtype=torch.float32)
    po = torch.zeros(4, dtype=partials)  # the workspace (fp16 where partial_dtype gives it: codes of <= 4 bits)
    return (q, qr, pages, pc, pr, i32, i32, i32, out, f32, po, f32, 4, heads, 1, heads, 1, 0.1)


def decode_case(name: str, heads: int, partials: torch.dtype = torch.float32) -> None:
    layout = PageLayout(TokenLayout(D_C, D_R, preset(name)), PAGE)
    cfg = api.default_config(heads, layout, "cuda")
    opts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_F32=False)
    args = _decode_args(layout, heads, partials)
    if cfg.kernel == "fused" and codegen.supported(layout):
        fn = codegen.fused_kernel(layout, cfg.unpack, cfg.orient)
        consts = opts
    else:
        from quantmla.kernels.decode import _mla_decode_kernel as fn

        consts, _ = support.layout_constexprs(layout)
        consts = {**consts, **opts, "DEQ": cfg.deq}
    k = compile_sm90(fn, args, consts, cfg.num_warps, cfg.num_stages)
    assert "mma" in k.asm["ptx"]  # the scores and values go through the tensor cores


def combine_case(heads: int, splits: int, partials: torch.dtype = torch.float32) -> None:
    from quantmla.kernels.decode import _mla_combine_kernel

    br, bd, bs = api.combine_blocks(1, heads, D_C, splits, 132)
    f32 = torch.zeros(4, dtype=torch.float32)
    po = torch.zeros(4, dtype=partials)
    args = (po, f32, torch.zeros(2, dtype=torch.int32), torch.zeros(4, dtype=torch.bfloat16), f32, heads)
    one = api.combine_one_step(splits, bs)
    compile_sm90(_mla_combine_kernel, args, dict(D_C=D_C, BLOCK_R=br, BLOCK_D=bd, BLOCK_S=bs, ONE_STEP=one), 4, 2)


def append_read_case(name: str) -> None:
    from quantmla.kernels.append import _append_kernel
    from quantmla.kernels.read import _read_kernel

    layout = PageLayout(TokenLayout(D_C, D_R, preset(name)), PAGE)
    pages = torch.zeros(4, layout.page_bytes, dtype=torch.uint8)
    _, pc, pr = support.page_views(pages, layout)
    consts, (cbf, rbf) = support.layout_constexprs(layout)
    xc = torch.zeros(4, D_C, dtype=torch.bfloat16)
    xr = torch.zeros(4, D_R, dtype=torch.bfloat16)
    slots = torch.zeros(4, dtype=torch.int64)
    append_consts = {k: v for k, v in consts.items() if k != "R_PAGE"}  # per-token records only (as the API)
    for n in (4, 4096):  # the API's tilings of a decode step and of a prefill chunk
        block_t, warps, apart = api.append_tiling(layout, n)
        compile_sm90(_append_kernel, (xc, xr, slots, pages, pc, pr, 4, D_C, D_R),
                     {**append_consts, "C_BF16": cbf, "R_BF16": rbf, "BLOCK_T": block_t, "R_WRITE": True,
                      "C_CLIP": 0, "R_CLIP": 2, "PATHS_APART": apart}, warps, 1)
    compile_sm90(_read_kernel, (xc, xr, slots, pages, pc, pr, 4, D_C, D_R), {**consts, "BLOCK_T": 16}, 4, 1)


def page_rope_case(heads: int, block: int = 0) -> None:
    """A RoPE path per channel per page (INT4, one group per channel; a metadata set per `block` tokens, or
    one a page): the generic decode kernel reading the page's metadata, the read kernel, and the append
    kernels (content, requantize a page, stage its keys)."""
    from quantmla.cache.layout import CacheFormat
    from quantmla.kernels.append import _append_kernel, _page_rope_kernel, _stage_rope_kernel
    from quantmla.kernels.decode import _mla_decode_kernel
    from quantmla.kernels.read import _read_kernel
    from quantmla.quant import PathFormat

    rope = PathFormat(4, 1, grouping="page", block=block)
    layout = PageLayout(TokenLayout(D_C, D_R, CacheFormat(PathFormat(4, 128), rope)), PAGE)
    cfg = api.default_config(heads, layout)  # no device: the GPU tilings
    consts, (cbf, rbf) = support.layout_constexprs(layout)
    assert consts["R_PAGE"] and cfg.kernel != "fused"
    compile_sm90(_mla_decode_kernel, _decode_args(layout, heads),
                 {**consts, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "DOT_F32": False, "DEQ": cfg.deq},
                 cfg.num_warps, cfg.num_stages)
    pages = torch.zeros(4, layout.page_bytes, dtype=torch.uint8)
    _, pc, pr = support.page_views(pages, layout)
    xc = torch.zeros(4, D_C, dtype=torch.bfloat16)
    xr = torch.zeros(4, D_R, dtype=torch.bfloat16)
    slots = torch.zeros(4, dtype=torch.int64)
    compile_sm90(_read_kernel, (xc, xr, slots, pages, pc, pr, 4, D_C, D_R), {**consts, "BLOCK_T": 16}, 4, 1)
    append_consts = {k: v for k, v in consts.items() if k != "R_PAGE"}
    compile_sm90(_append_kernel, (xc, xr, slots, pages, pc, pr, 4, D_C, D_R),
                 {**append_consts, "C_BF16": cbf, "R_BF16": rbf, "BLOCK_T": 4, "R_WRITE": False, "C_CLIP": 3, "R_CLIP": 0,
                  "PATHS_APART": False}, 4, 1)
    rows = torch.zeros(4, dtype=torch.int32)
    stage = torch.zeros(2, PAGE, D_R, dtype=torch.bfloat16)
    for affine, mb in ((True, 2), (False, 2), (False, 4)):  # affine and symmetric groups, fp16 and fp32 metadata
        compile_sm90(_page_rope_kernel, (xr, slots, rows, stage, pages, pr, 4, D_R, PAGE * D_R),
                     dict(D_R=D_R, PS=PAGE, PAGE_BYTES=layout.page_bytes, OFF_RC=layout.offsets["rope_codes"],
                          OFF_PM=layout.offsets["rope_page_meta"], BLK=layout.rope_meta_block, BITS=4, GS=1,
                          AFFINE=affine, MB=mb, META_BF16=False, CLIP=4), 4, 1)
    compile_sm90(_stage_rope_kernel, (xr, slots, rows, stage, 4, D_R, PAGE * D_R), dict(D_R=D_R, PS=PAGE), 1, 1)


def norm_rope_case(norm: bool) -> None:
    """The engine's RMSNorm kernel (bf16, 2048 wide) and its RoPE kernel at 16 heads, with the latent's norm (512
    wide) in the same launch or not, as ``rope_rotate`` / ``norm_and_rotate`` launch them on a GPU."""
    from quantmla.kernels.norm import _rms_norm_kernel
    from quantmla.kernels.rope import MODES, _rope_kernel

    b16, f32 = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float32)
    compile_sm90(_rms_norm_kernel, (b16, b16, b16, 2048, 2048, 2048, 1e-6), dict(BLOCK=2048, BF16=True), 4, 3)
    compile_sm90(_rope_kernel, (b16, b16, f32, f32, b16, b16, b16, b16, b16, 4, 16, 3072, 192, 576, 32, 1, 32, 1, 576,
                                1e-6, 512),
                 dict(D=64, MODE=MODES.index("pairs"), TB=1, HB=32, BF16=True, BLOCK_C=512, NORM=norm), 4, 3)


def greedy_case() -> None:
    """The greedy tokens' two kernels (``sampling.greedy_tokens``) over bf16 logits of a 102400-word vocabulary."""
    from quantmla.kernels.sampling import BLOCK_V, _block_argmax_kernel, _row_argmax_kernel

    b16, f32, i32, i64 = (torch.zeros(4, dtype=d) for d in (torch.bfloat16, torch.float32, torch.int32, torch.int64))
    compile_sm90(_block_argmax_kernel, (b16, f32, i32, i32, 102400, 102400, 25), dict(BLOCK=BLOCK_V), 8, 3)
    compile_sm90(_row_argmax_kernel, (f32, i32, i32, i64, 25, -1), dict(NBP=32), 1, 1)


CASES = {
    "rms norm, rope": (norm_rope_case, (False,)),
    "rms norm, rope with the latent norm": (norm_rope_case, (True,)),
    **{f"decode {n} H{h}": (decode_case, (n, h)) for n, h in
       [("int4/int4", 16), ("int2/int4", 16), ("bf16", 16), ("int4/int4", 128), ("fp8", 16), ("fp8", 128)]},
    **{f"decode {n} H{h} fp16 partials": (decode_case, (n, h, torch.float16)) for n, h in
       [("int4/int4", 16), ("int2/int4", 16), ("int4/int4", 128)]},
    **{f"combine H{h} splits {s}": (combine_case, (h, s)) for h, s in [(16, 128), (16, 264), (128, 8)]},
    **{f"combine H{h} splits {s} fp16 partials": (combine_case, (h, s, torch.float16)) for h, s in [(16, 33), (16, 264)]},
    **{f"append+read {n}": (append_read_case, (n,)) for n in ["fp8", "int4/int4", "bf16"]},
    **{f"page rope H{h}": (page_rope_case, (h,)) for h in (16, 128)},
    "page rope blocks of 16 H16": (page_rope_case, (16, 16)),
    "greedy tokens": (greedy_case, ()),
}


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, f"the compile process failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90(case, compiled):
    if compiled.get("__skip__"):
        pytest.skip(compiled["__skip__"])
    assert compiled[case] == "ok", compiled[case]


if __name__ == "__main__":  # the child process: compile every case, print one JSON line of results
    try:
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        print(json.dumps({"__skip__": "this Triton has no ahead-of-time compile API"}))
        raise SystemExit(0)
    results = {}
    for case, (fn, a) in CASES.items():
        try:
            fn(*a)
            results[case] = "ok"
        except Exception as e:  # noqa: BLE001 - reported per case
            results[case] = f"{type(e).__name__}: {str(e)[:1500]}"
    print(json.dumps(results))
