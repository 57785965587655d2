"""Launching a decode: the configured kernel (CUDA C++ or Triton), and on a compile or build failure the next one
down (CUDA -> fused Triton -> generic Triton -> fewer stages) with a warning, remembered a process."""

from __future__ import annotations

import warnings
from dataclasses import replace

from quantmla.cache.layout import PageLayout
from quantmla.errors import QuantMLAError, UnsupportedFormatError
from quantmla.kernels.schedule import DecodeConfig, default_config, interpreting
from quantmla.kernels.support import layout_constexprs

_FALLBACK: dict = {}


def _is_compile_error(e: Exception) -> bool:
    name = type(e).__name__
    return name in ("CompilationError", "OutOfResources", "CompileTimeAssertionFailure") or "PassManager" in str(e) or (
        isinstance(e, RuntimeError) and ("MLIR" in str(e) or "LLVM" in str(e) or "ptxas" in str(e))
    )


def launch_decode(grid, args, layout: PageLayout, cfg: DecodeConfig) -> str:
    """Launch the configured kernel; on a compile failure fall back (fused -> generic -> deq 1 ->
    one stage) with a warning. Returns the variant that ran."""
    from quantmla.kernels import codegen
    from quantmla.kernels.decode import _mla_decode_kernel

    if cfg.kernel == "cuda":
        variant = launch_cuda(grid, args, layout, cfg)
        if variant is not None:
            return variant
        tcfg = default_config(args[15], layout)  # Triton's tiling of these rows, at the schedule's row block
        cfg = tcfg if tcfg.block_m == cfg.block_m else replace(tcfg, block_m=cfg.block_m, kernel="generic")
    consts, _ = layout_constexprs(layout)
    tries = []
    if cfg.kernel == "fused" and codegen.supported(layout):
        tries.append(("fused", 0, cfg.num_stages))
        if cfg.unpack == "asm":
            tries.append(("fused-tl", 0, cfg.num_stages))
    tries += [("generic", cfg.deq, cfg.num_stages), ("generic", 1, cfg.num_stages), ("generic", 1, 1)]
    key = (layout, cfg)
    first = _FALLBACK.get(key, 0)
    last = None
    for i, (kind, deq, stages) in enumerate(tries[first:], start=first):
        try:
            opts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_F32=interpreting(), num_warps=cfg.num_warps, num_stages=stages)
            if kind.startswith("fused"):
                unpack = "tl" if kind == "fused-tl" else cfg.unpack
                codegen.fused_kernel(layout, unpack, cfg.orient)[grid](*args, **opts)
            else:
                _mla_decode_kernel[grid](*args, **consts, DEQ=deq, **opts)
            if i != first:
                _FALLBACK[key] = i
                warnings.warn(f"decode kernel {tries[first]} for {cfg.describe()} failed to compile ({last}); ran {tries[i]}")
            return f"{kind}/d{deq}/s{stages}" if kind == "generic" else f"{kind}/{cfg.unpack if kind == 'fused' else 'tl'}/{cfg.orient}"
        except Exception as e:  # compile-time failures only (nothing has been launched)
            if not _is_compile_error(e) or interpreting():
                raise
            last = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    raise QuantMLAError(f"the decode kernel did not compile for {cfg.describe()}: {last}")


_CUDA_FAILED: dict = {}  # plan -> why its build failed (tried once per process)


def launch_cuda(grid, args, layout: PageLayout, cfg: DecodeConfig) -> str | None:
    """Run the CUDA C++ kernel (kernels/cuda) over the Triton kernel's arguments. Where it cannot (no plan
    for this layout, rows and output dtype, or a build that failed) it warns and returns None, and the
    Triton kernel runs; QUANTMLA_DECODE_KERNEL=cuda makes that an error."""
    from quantmla.kernels import cuda

    R, out, device = args[15], args[8], args[2].device
    plan = cuda.decode_plan(layout, R, out.dtype, device, num_warps=cfg.num_warps, block_n=cfg.block_n,
                            tokens_m=cfg.tokens_m, token_blocks=cfg.token_blocks,
                            warpgroup=cfg.warpgroup, specialized=cfg.specialized, s8_scores=cfg.s8_scores,
                            scale_vote=cfg.scale_vote, seesaw=cfg.seesaw,
                            ctas_per_sm=cfg.ctas_per_sm if cfg.tokens_m else None)
    if plan is None:
        why = cuda.plan_reason.get(layout, "no plan")
    elif plan.block_m != cfg.block_m:
        why = f"its row block is {plan.block_m}, the schedule's {cfg.block_m}"
    elif plan.block_n != cfg.block_n:  # the units start on the schedule's key tiles, the kernel's copies on its own
        why = f"its key tile is {plan.block_n} tokens, the schedule's {cfg.block_n}"
    elif plan in _CUDA_FAILED:
        why = _CUDA_FAILED[plan]
    else:
        try:
            cuda.launch_decode(plan, (grid[1], grid[0]), args, device)
            return plan.describe()
        except QuantMLAError as e:
            why = _CUDA_FAILED[plan] = str(e).splitlines()[0]
    if cuda.mode() == "cuda":
        raise UnsupportedFormatError(f"the CUDA decode kernel cannot run {cfg.describe()}: {why}")
    warnings.warn(f"the CUDA decode kernel cannot run this call ({why}); the Triton kernel runs instead")
    return None
