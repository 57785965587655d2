"""Does a programmatic dependent launch hide a decode step's small products' fixed cost? A chain of layers timed.

At decode's few rows the attention's small products (q_proj with kv_a_proj_with_mqa stacked, 3648 x 2048; o_proj,
2048 x 2048) take 6 to 7 µs a call whatever their bytes (``projection_gemms_h200.json``: kv_a_proj_with_mqa's 2.4 MB
as long as o_proj's 8.4 MB): a launch, the first reads' round trips and a tail, not bandwidth. Their weights do not
depend on the step, so a product launched early (Hopper's programmatic dependent launch: the kernel before it lets its
dependents launch at its start, ``gdc_launch_dependents``; the product waits for that kernel's results only where it
reads them, ``gdc_wait``) could bring its weight into L2 (``prefetch.global.L2``) while the kernel before it runs.

This bench captures CUDA graphs of ``--layers`` layers, each an RMSNorm of the previous layer's output (the first
``--hidden`` columns; the norm is ``kernels.norm``'s arithmetic) and a product with a weight of its own
(``--out-features`` x ``--hidden``, so no layer's weight is in L2 from the layer before), and times, µs a layer:

    cublas            the norm, then ``F.linear`` (cuBLAS), as the engine runs them
    cublas+pdl        the norm launched with PDL (it waits at its start), then ``F.linear``
    triton            the norm, then ``skinny_gemm.skinny_linear`` (one program a block of output columns over all of K)
    triton+pdl        both launched with PDL: the product's programs launch while the norm runs and wait for it
    triton+pdl+l2     the same, each program first prefetching its weight rows into L2

Every variant's last output is checked against the cuBLAS chain's (relative max difference, saved). Medians over 5
groups of ``--reps`` replays (CUDA events).

    python -m quantmla_lab.bench.serving.pdl_chain --out $OUT/profile/pdl_chain_h200.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from quantmla.kernels.norm import rms_norm_row
from quantmla_lab.bench.common import parse_fresh, record, save
from quantmla_lab.bench.serving.skinny_gemm import gdc_launch_dependents, gdc_wait, skinny_linear

VARIANTS = ("cublas", "cublas+pdl", "triton", "triton+pdl", "triton+pdl+l2")


@triton.jit(do_not_specialize=["stride_x", "stride_y"])
def _norm_kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    """``kernels.norm._rms_norm_kernel``, optionally launched with PDL: its dependents may launch at once, and it
    waits for the kernel before it (whose output it reads) first."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    rms_norm_row(X, W, Y, stride_x, stride_y, N, eps, BLOCK, BF16)


def norm(x: torch.Tensor, w: torch.Tensor, eps: float, pdl: bool) -> torch.Tensor:
    """RMSNorm of x's rows (strided rows allowed) into a new tensor; `pdl`: launched with PDL."""
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    opts = {"launch_pdl": True} if pdl else {}
    _norm_kernel[(M,)](x, w, y, x.stride(0), y.stride(0), N, eps, BLOCK=triton.next_power_of_2(N),
                       BF16=x.dtype == torch.bfloat16, PDL=pdl, num_warps=4, **opts)
    return y


def chain(variant: str, x0, norm_w, weights, tiling, hidden: int, eps: float = 1e-6) -> torch.Tensor:
    """The layers of `variant` over x0; returns the last layer's output."""
    pdl = "pdl" in variant
    x = x0
    for w, nw in zip(weights, norm_w):
        h = norm(x, nw, eps, pdl)
        y = F.linear(h, w) if variant.startswith("cublas") else skinny_linear(h, w, tiling, pdl, variant.endswith("l2"))
        x = y[:, :hidden]
    return y


def parse_tiling(text: str) -> tuple[int, int, int, int]:
    try:
        t = tuple(int(v) for v in text.split(","))
    except ValueError:
        t = ()
    if len(t) != 4 or any(v <= 0 for v in t):
        raise SystemExit(f"--tilings {text!r}: write BLOCK_N,BLOCK_K,WARPS,STAGES, e.g. 32,256,4,3")
    return t


def main(argv=None) -> int:
    from quantmla_lab.bench.kernels.timing import capture_graph
    from quantmla_lab.bench.serving.step_overhead import replay_ms

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", type=int, default=[8, 32])
    p.add_argument("--out-features", nargs="+", type=int, default=[3648, 2048])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--tilings", nargs="+", default=["32,256,4,3", "16,256,4,4"], help="BLOCK_N,BLOCK_K,WARPS,STAGES")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=None)
    a = parse_fresh(p) if argv is None else p.parse_args(argv)
    tilings = [parse_tiling(t) for t in a.tilings]
    if any(r < 1 or r > 64 for r in a.rows) or any(n < a.hidden for n in a.out_features):
        raise SystemExit("--rows must be 1 to 64 and every --out-features at least --hidden")
    if not torch.cuda.is_available():
        raise SystemExit("pdl_chain times CUDA graphs: it needs a CUDA device")
    if gdc_wait is None and any("pdl" in v for v in a.variants):
        raise SystemExit(f"triton {triton.__version__} has no grid dependency control: run without the pdl variants")
    dev, L = torch.device("cuda"), a.layers
    g = torch.Generator(device=dev).manual_seed(0)
    res = record(layers=L, hidden=a.hidden, reps=a.reps, groups=5, rows=[])
    for nout in a.out_features:
        weights = [(torch.randn(nout, a.hidden, generator=g, device=dev) * a.hidden ** -0.5).to(torch.bfloat16)
                   for _ in range(L)]
        norm_w = [(1 + 0.1 * torch.randn(a.hidden, generator=g, device=dev)).to(torch.bfloat16) for _ in range(L)]
        for M in a.rows:
            x0 = torch.randn(M, a.hidden, generator=g, device=dev).to(torch.bfloat16)
            ref = chain("cublas", x0, norm_w, weights, tilings[0], a.hidden).float()
            for variant in a.variants:
                for tiling in tilings if variant.startswith("triton") else [None]:
                    out = {}
                    graph = capture_graph(lambda: out.__setitem__("y", chain(variant, x0, norm_w, weights, tiling,
                                                                             a.hidden)))
                    graph.replay()
                    torch.cuda.synchronize()
                    diff = float((out["y"].float() - ref).abs().max() / ref.abs().max())
                    us = replay_ms(graph, 5 * a.reps) * 1e3 / L
                    row = {"out_features": nout, "rows": M, "variant": variant, "tiling": tiling,
                           "us_per_layer": round(us, 3), "rel_diff_vs_cublas": diff}
                    res["rows"].append(row)
                    print(f"{nout:5d} x {a.hidden} M={M:2d} {variant:14s} {str(tiling or ''):18s} {us:7.2f} us a layer"
                          f"  rel diff {diff:.1e}", flush=True)
                    del graph
    save(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
