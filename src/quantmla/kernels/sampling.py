"""Greedy tokens of a decode step's logits in two kernels (Triton): torch's

    where(isfinite(logits).all(-1), logits.argmax(-1), NONFINITE)

is about seven kernels over the [R, V] logits on CUDA (the finiteness test as four elementwise kernels, its row
reduction, the argmax and the select), each a launch of its own. Here the first kernel reads every block of BLOCK_V
logits of a row once and keeps its largest value, that value's first index and whether the block holds NaN or
Inf; the second merges a row's blocks. The index is torch's: the first of the row's largest values (every logit
compared exactly, in fp32, which holds bf16 and fp16 values unrounded).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # logits a program of the first pass reads (102400-word vocabularies: 25 a row)
EXACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # compared in fp32 without rounding


@triton.jit(do_not_specialize=["stride", "V"])
def _block_argmax_kernel(X, VAL, IDX, BAD, stride, V, NB, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    m = cols < V
    x = tl.load(X + r * stride + cols, mask=m, other=float("-inf")).to(tl.float32)
    bad = m & ((x != x) | (tl.abs(x) == float("inf")))
    x = tl.where(bad, float("-inf"), x)
    v, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(VAL + r * NB + b, v)
    tl.store(IDX + r * NB + b, b * BLOCK + i)
    tl.store(BAD + r * NB + b, tl.max(bad.to(tl.int32), axis=0))


@triton.jit
def _row_argmax_kernel(VAL, IDX, BAD, OUT, NB, NONFINITE, NBP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, NBP)
    m = k < NB
    v = tl.load(VAL + r * NB + k, mask=m, other=float("-inf"))
    i = tl.load(IDX + r * NB + k, mask=m, other=0)
    bad = tl.load(BAD + r * NB + k, mask=m, other=0)
    best = tl.min(tl.where(m & (v == tl.max(v, axis=0)), i, 2147483647), axis=0)
    tl.store(OUT + r, tl.where(tl.max(bad, axis=0) > 0, NONFINITE, best).to(tl.int64))


def greedy_tokens(logits: torch.Tensor, nonfinite: int) -> torch.Tensor:
    """Greedy tokens of logits [R, V] (bf16, fp16 or fp32; rows may be strided, the last dim contiguous) -> int64 [R]:
    each row's first largest logit, or `nonfinite` for a row that holds NaN or Inf."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"greedy_tokens: logits must be a floating-point [rows, vocabulary] tensor, not "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if logits.dtype not in EXACT_DTYPES:
        raise ValueError(f"greedy_tokens: {logits.dtype} logits do not all fit fp32 unrounded (ties and range would "
                         f"change); take torch's argmax for them, or cast to one of {EXACT_DTYPES}")
    R, V = logits.shape
    if V == 0:
        raise ValueError("greedy_tokens: the vocabulary is empty: no token to choose")
    if V >= 2**31:
        raise ValueError(f"greedy_tokens: a vocabulary of {V} words does not fit the kernel's int32 indices")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    if R == 0:
        return out
    block = min(BLOCK_V, triton.next_power_of_2(V))
    nb = triton.cdiv(V, block)
    val = torch.empty((R, nb), dtype=torch.float32, device=x.device)
    idx = torch.empty((R, nb), dtype=torch.int32, device=x.device)
    bad = torch.empty((R, nb), dtype=torch.int32, device=x.device)
    _block_argmax_kernel[(R, nb)](x, val, idx, bad, x.stride(0), V, nb, BLOCK=block, num_warps=8)
    _row_argmax_kernel[(R,)](val, idx, bad, out, nb, nonfinite, NBP=triton.next_power_of_2(nb), num_warps=1)
    return out
