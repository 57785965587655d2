"""A candidate for decode's small products: y = x·Wᵀ for a few rows of x as one Triton kernel that streams W.

At decode's 1 to 64 rows a product reads its weight once and does little else, and cuBLAS's kernels for the
attention's small weights (q_proj with kv_a_proj_with_mqa stacked, 3648 x 2048; o_proj, 2048 x 2048) read them at
1.3 to 2.0 TB/s (``lab/results/profile/projection_gemms_h200.json``). Here each program owns ``BLOCK_N`` rows of W
(output columns) over the whole of K, so the grid has N / BLOCK_N programs and every weight byte is read once;
the rows of x, padded to 16 for the tensor cores, stay in registers between key blocks. ``projection_gemms.py``
times it beside cuBLAS as one form a tiling. On the H200 it is slower than cuBLAS on the stacked product (7.7-8.0
against 6.9-7.2 µs at 1 to 64 rows) and within 0.5 µs of it on the small ones
(``lab/results/profile/projection_gemms_triton_h200.json``), so the engine does not use it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried by the bench
TILINGS = ((16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3), (16, 512, 4, 3))


try:  # triton >= 3.3: grid dependency control (programmatic dependent launch)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _prefetch_l2(ptrs):
    """prefetch.global.L2 of each pointer's line (nothing is read into registers)."""
    return tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _skinny_kernel(X, W, Y, M, N, K, sxm, swn, sym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr = False, L2_LINES: tl.constexpr = 0):
    """A program owns BLOCK_N rows of W over all of K. With PDL (launched with programmatic dependent launch) its
    dependents may launch at once and it waits for the kernel that wrote x only before reading x; L2_LINES > 0 (K·2 /
    128, 16-bit W) prefetches its rows of W into L2 before that wait."""
    n0 = tl.program_id(0) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    if PDL:
        gdc_launch_dependents()
    if L2_LINES > 0:
        i = tl.arange(0, BLOCK_N * L2_LINES)
        r = n0 + i // L2_LINES
        _prefetch_l2(tl.where(r < N, W + r.to(tl.int64) * swn + (i % L2_LINES) * 64, W))
    if PDL:
        gdc_wait()
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + m[:, None] * sxm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(W + n[:, None].to(tl.int64) * swn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(Y + m[:, None] * sym + n[None, :], acc.to(Y.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, tiling: tuple[int, int, int, int] = TILINGS[0], pdl: bool = False,
                  l2: bool = False) -> torch.Tensor:
    """``F.linear(x, w)`` for x [M, K] with M <= 64 rows and w [N, K] (last dims contiguous), fp32 accumulation,
    output in x's dtype. `tiling`: (BLOCK_N, BLOCK_K, num_warps, num_stages). `pdl`: launched with programmatic
    dependent launch (Hopper); `l2`: each program prefetches its 16-bit rows of w into L2 first (a GPU only)."""
    M, K = x.shape
    N = w.shape[0]
    if M > 64 or w.shape[1] != K or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"skinny_linear: x [{M}, {K}] (at most 64 rows) and w [N, {K}] with contiguous rows, "
                         f"got w {tuple(w.shape)}")
    block_n, block_k, warps, stages = tiling
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    opts = {"launch_pdl": True} if pdl else {}
    _skinny_kernel[(triton.cdiv(N, block_n),)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                               BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n,
                                               BLOCK_K=block_k, PDL=pdl, L2_LINES=K * w.element_size() // 128 if l2
                                               else 0, num_warps=warps, num_stages=stages, **opts)
    return y
