"""The CUDA C++ decode path: three kernels, one build per cache layout and plan, cached on disk, launched on
torch's current stream (so CUDA graphs capture it). ``tokens_m.py`` plans the tokens-as-M kernel
(``mla_decode_tm.cu``), ``built_tile.py`` the built-tile kernel (``mla_decode.cu``), ``warpgroup.py`` the heads-as-M
kernel on warpgroup MMAs (``mla_decode_wg.cu``, 64 rows or more; ``mla_decode_seesaw.cu`` its warpgroups out of
phase), ``plan.py`` holds what they share.

    plan = decode_plan(layout, rows, out_dtype, device)   # None (with plan_reason) where it cannot run
    launch_decode(plan, grid, args)                        # the same arguments as the Triton kernel

A plan fixes the kernel's constants (macros of its source). ``build.py`` compiles it with nvcc into a cubin under ``QUANTMLA_CUDA_CACHE``
(default ``~/.cache/quantmla/cuda``); ``driver.py`` loads it through the CUDA driver API.

``QUANTMLA_DECODE_KERNEL=triton`` turns this path off; ``=cuda`` makes a failed build an error instead
of a fall back to Triton with a warning.
"""

from __future__ import annotations

import torch

from quantmla.cache.layout import PageLayout
from quantmla.kernels.partials import partial_dtype
from quantmla.kernels.cuda.built_tile import (  # noqa: F401 (the package's names)
    BLOCK_N, NUM_WARPS, built_tile_plan, chosen, smem_bytes)
from quantmla.kernels.cuda.plan import (  # noqa: F401
    _OUT, SMEM_PER_CTA, SMEM_PER_SM, SMEM_RESERVED, DecodePlan, _assume_cuda, device_reason, is_fp8, mode, partial_kind,
    plan_reason)
from quantmla.kernels.cuda.tokens_m import (  # noqa: F401
    FP8_TM_MIN_TOKENS, TM_BLOCK_N, TM_MAX_CONTENT_SCALE, TM_MAX_STAGES, TM_MIN_STAGES, TM_P_BUFFERS,
    TM_TWO_BLOCKS_MIN_TOKENS, TM_VOTE_MAX_CONTENT_SCALE, TM_WARPS, TM_WS_2BIT_STAGES, TM_WS_MIN_TOKENS, smem_bytes_tm,
    tokens_m_by_default, tokens_m_default_blocks, tokens_m_plan, tokens_m_reason, tokens_m_ws_min_tokens)
from quantmla.kernels.cuda.warpgroup import (  # noqa: F401
    WG_BLOCK_M, WG_MIN_ROWS, lowbit, smem_bytes_wg, tensor_maps, warpgroup_by_default, warpgroup_plan, warpgroup_reason)


def decode_plan(layout: PageLayout, rows: int, out_dtype: torch.dtype, device: torch.device, *,
                num_warps: int | None = None, block_n: int | None = None, ksplit: int | None = None,
                tokens_m: bool | None = None, token_blocks: int | None = None,
                warpgroup: bool = False, specialized: bool | None = None,
                ctas_per_sm: int | None = None, s8_scores: bool = False, scale_vote: bool = False,
                seesaw: bool = False) -> DecodePlan | None:
    """The build that reads `layout` for `rows` query rows per sequence on `device`, or None (the reason
    is kept in ``plan_reason[layout]``): not CUDA, compute capability below 8.0, or a layout it cannot read.
    `num_warps` (8 or 16), `block_n` (tokens per tile, 32 or 64) and `ksplit` (warps sharing one score
    tile's channels) are the kernel's tiling (`token_blocks`, 1 or 2 blocks of 16 tokens a warp's scores take,
    for the tokens-as-M kernel; None: its default for the layout; `specialized` its scores' and output's warps apart
    or not, None its default; `ctas_per_sm` of them, default 2; `s8_scores` its scores on 8-bit warpgroup MMAs;
    `scale_vote` its SCALE_VOTE build, for content scales past TM_MAX_CONTENT_SCALE);
    `tokens_m=True` the tokens-as-M kernel (mla_decode_tm.cu; None where it cannot read the layout, the reason from
    `tokens_m_reason`); `warpgroup=True` the heads-as-M kernel on warpgroup MMAs (mla_decode_wg.cu; None where it
    cannot, the reason from `warpgroup_reason`); `seesaw=True` the heads-as-M kernel with its warpgroups out of phase
    (mla_decode_seesaw.cu, BF16). Default: 8 warps and 32-token tiles at 16 rows; beyond 16 rows 16 warps and 64-token
    tiles where they fit (one build per 64 tokens for twice the rows; INT4/INT4 at 128 heads, 32 x 8192: 443 against
    604 us on the H200,
    lab/results/kernels/decode_cuda_tilings_128h_h200.json).
    """
    warpgroup = warpgroup or seesaw  # (it takes the heads-as-M launch shape)
    why = device_reason(device, (9, 0) if tokens_m or warpgroup else (8, 0),
                        "tokens as M: needs compute capability 9.0 (bulk copies)" if tokens_m
                        else "heads as M: needs compute capability 9.0 (warpgroup MMAs)" if warpgroup
                        else "needs compute capability 8.0 or later (mma.sync bf16, cp.async)")
    if why is None and out_dtype not in _OUT:
        why = f"output dtype {out_dtype}"
    if why:
        plan_reason[layout] = why
        return None
    key = (layout, rows, out_dtype, num_warps, block_n, ksplit, tokens_m, token_blocks, warpgroup,
           specialized, ctas_per_sm, s8_scores, scale_vote, seesaw,
           partial_dtype(layout))  # (QUANTMLA_PARTIALS may change it)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(layout, rows, out_dtype, num_warps, block_n, ksplit, tokens_m,
                                   token_blocks, warpgroup, specialized, ctas_per_sm, s8_scores, scale_vote, seesaw)
    if isinstance(plan, str):
        plan_reason[layout] = plan
        return None
    return plan


_PLANS: dict = {}  # decode_plan's arguments past the device, and the partials' dtype -> its plan, or why there is none


def _plan(layout, rows, out_dtype, num_warps, block_n, ksplit, tokens_m, token_blocks, warpgroup,
          specialized, ctas_per_sm, s8_scores, scale_vote=False, seesaw=False) -> DecodePlan | str:
    """decode_plan on a device that can run the kernels: the plan, or why there is none."""
    if warpgroup:
        plan = warpgroup_plan(layout, rows, out_dtype, seesaw=seesaw)
        return f"heads as M: {plan}" if isinstance(plan, str) else plan
    if tokens_m:
        plan = tokens_m_plan(layout, rows, out_dtype, ctas_per_sm=ctas_per_sm or 2, blocks_per_warp=token_blocks,
                             specialized=specialized, s8_scores=s8_scores, scale_vote=scale_vote)
        return f"tokens as M: {plan}" if isinstance(plan, str) else plan
    plan = built_tile_plan(layout, rows, out_dtype, num_warps=num_warps, block_n=block_n, ksplit=ksplit)
    return plan if plan is not None else plan_reason.get(layout, "no built-tile plan")


def prepare(plan: DecodePlan, device: torch.device) -> None:
    """Build and load `plan` now (not at the first launch, which may be inside a CUDA-graph capture)."""
    from quantmla.kernels.cuda import driver
    from quantmla.kernels.cuda.build import cubin_for

    driver.function(cubin_for(plan.macros, device), "mla_decode", plan.smem, device)


def launch_decode(plan: DecodePlan, grid: tuple[int, int], args: tuple, device: torch.device) -> None:
    """Run the build of `plan` over grid (units, head blocks) on the current stream (the heads-as-M kernel's grid is
    (head blocks, units): a unit's head blocks run side by side and share its tiles in L2). `args` are the
    Triton decode kernel's: (qc, qr, pages, pc16, pr16, bt, seq_lens, units, out, lse, po, plse,
    stride_bt, H, S_q, R, causal, qk_scale·log2 e)."""
    from quantmla.kernels.cuda import driver
    from quantmla.kernels.cuda.build import cubin_for

    qc, qr, pages, _, _, bt, sl, units, out, lse, po, plse, stride_bt, H, SQ, R, causal, scale = args
    if po.data_ptr() != lse.data_ptr() and po.dtype != partial_kind(plan):  # (po is lse where no unit splits)
        # a caller's mistake, not a build that failed: a ValueError, which launch_cuda does not take for a fall back
        raise ValueError(f"the build writes {partial_kind(plan)} partials into a {po.dtype} workspace: allocate it as "
                         "kernels.partials.partial_dtype(layout) gives")
    fn = driver.function(cubin_for(plan.macros, device), "mla_decode", plan.smem, device)
    extra = []
    if dict(plan.macros).get("WG"):
        grid = (grid[1], grid[0])
        extra = [] if lowbit(plan) else [("s", m) for m in tensor_maps(pages, plan)]
    # the kernel reads the queries and (heads-as-M, rows staged) writes the output in 16-byte pieces: a view that
    # starts off a 16-byte boundary is read from a copy, or written through one
    qc, qr = (q if q.data_ptr() % 16 == 0 else q.clone() for q in (qc, qr))
    dst = out if out.data_ptr() % 16 == 0 else torch.empty_like(out)
    ptrs = [t.data_ptr() for t in (qc, qr, pages, bt, sl, units, dst, lse, po, plse)]
    driver.launch(fn, grid, plan.num_warps * 32, plan.smem, torch.cuda.current_stream(device).cuda_stream,
                  [("p", p) for p in ptrs] + [("i", int(stride_bt)), ("i", int(H)), ("i", int(SQ)), ("i", int(R)),
                                              ("i", int(causal)), ("f", float(scale))] + extra)
    if dst is not out:
        out.copy_(dst)
