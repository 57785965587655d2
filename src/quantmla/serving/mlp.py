"""The model's gated MLP modules as one stacked GEMM and one activation kernel inside engine steps.

A transformers gated MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, the dense layers and the shared
experts of the MLA families) is four kernels before its down projection: two GEMMs over the same input, the SiLU,
the product. While an engine that asked for it runs a step, such a module computes its gate and up projections as
one product of their stacked weights (``serving/merged.py``: the weights become views of it, no memory added)
and the SiLU and the product as one kernel (``kernels.activation.silu_mul``); outside steps (``generate()``,
other engines) the module's own forward runs.

A module is fused only where, on a probe input of its dtype and device, the fused path gives what its own
forward gives (within the rounding of that dtype): a module with another activation, biases of its own kind or
hooks keeps its forward, and the engine says which and why (``Engine.mlps``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quantmla.serving.merged import MergedLinears, merge_reason
from quantmla.serving.patching import patch, unpatch

_KEY = "_quantmla_mlp"
# the largest |fused - own| over the probe, relative to the largest |own|: roundings, not another function
_TOL = {torch.float32: 1e-5, torch.float16: 2.0**-8, torch.bfloat16: 2.0**-6}


def gated_mlps(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module for every module with ``gate_proj``, ``up_proj`` and ``down_proj`` submodules and an
    ``act_fn`` (the transformers MLA families' MLPs and shared experts)."""
    return {name: m for name, m in model.named_modules()
            if all(isinstance(getattr(m, a, None), nn.Module) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))}


def _fused(module: nn.Module, merged: MergedLinears, x: torch.Tensor) -> torch.Tensor:
    from quantmla.kernels.activation import silu_mul

    return module.down_proj(silu_mul(F.linear(x, merged.weight, merged.bias)))


def probe(module: nn.Module, forward: Callable) -> tuple[MergedLinears | None, str | None]:
    """Stack the module's gate and up projections and check the fused path against `forward` (its own) on a
    probe input: (the stacked product, None), or (None, why not) with the module as it was."""
    lins = [module.gate_proj, module.up_proj]
    why = merge_reason(lins)
    if why:
        return None, why
    w = module.gate_proj.weight
    g = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(5, module.gate_proj.in_features, generator=g, device=w.device).to(w.dtype)
    with torch.no_grad():
        ref = forward(x)
        merged = MergedLinears(lins, lambda: [module.gate_proj, module.up_proj])
        try:
            got = _fused(module, merged, x)
        except (ValueError, RuntimeError) as e:
            merged.release()
            return None, str(e).splitlines()[0]
    if ref.shape != got.shape or ref.dtype != got.dtype:
        merged.release()
        return None, f"its forward gives {ref.dtype} {tuple(ref.shape)}, the fused path {got.dtype} {tuple(got.shape)}"
    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
    if err > _TOL.get(w.dtype, 2.0**-6):
        merged.release()
        return None, f"its forward differs from SiLU(gate) * up by {err:.2g} (relative): another activation?"
    return merged, None


def _forward(module, *args, **kwargs):
    reg = module.__dict__[_KEY]
    eng = reg["current"]()
    x = kwargs["x"] if "x" in kwargs else kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    if eng is not None and id(eng) in reg["engines"] and reg["merged"].current() and x.device == reg["merged"].weight.device:
        return _fused(module, reg["merged"], x)
    return reg["orig"](*args, **kwargs)


def attach(model: nn.Module, engine, current: Callable[[], object], cpu: bool = False) -> dict[str, str]:
    """Fuse the gated MLPs of `model` inside `engine`'s steps (``current()`` is the engine whose step runs, or
    None). Returns name -> "fused" or why a module keeps its own forward. `cpu`: CPU modules too (the Triton
    interpreter: tests)."""
    report = {}
    for name, m in gated_mlps(model).items():
        merged = None
        if _KEY not in m.__dict__:  # the first engine on this module: stack and check it
            if not (m.gate_proj.weight.is_cuda or cpu):
                report[name] = "not on a CUDA device"
                continue
            merged, why = probe(m, m.forward)
            if why:
                report[name] = why
                continue
        reg = patch(m, _KEY, _forward, engine, current=current, merged=merged)
        report[name] = "fused" if reg["merged"].current() else "a weight was replaced since the stack: its own forward runs"
    return report


def detach(model: nn.Module, engine) -> None:
    """Undo :func:`attach` for `engine`; the last engine gives the modules their own forwards and weights back."""
    for m in gated_mlps(model).values():
        unpatch(m, _KEY, engine, on_last=lambda reg: reg["merged"].release())
