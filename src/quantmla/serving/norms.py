"""The model's RMSNorm modules as one kernel a call inside engine steps (``kernels.norm.rms_norm``).

A decode step of a 27-layer DeepSeek-V2-Lite model calls RMSNorm 82 times, and each call of the transformers
module is eight small kernels (two casts, pow, mean, add, rsqrt and two products): on the H200 about 1 ms of a
3 to 9 ms step. While an engine that asked for it runs a step, each such module's forward runs the fused
kernel instead; outside steps (``generate()``, other engines) the module's own forward runs.

A module is fused only where its own forward, on a probe input of its dtype and device, gives what the kernel
gives (within the rounding of that dtype): a family whose norm computes something else (a ``1 + weight``
scale, another cast order) keeps its own forward, and the engine says which and why (``Engine.norms``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quantmla.serving.patching import patch, unpatch

_KEY = "_quantmla_norm"


def rms_norm_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module for every module whose class name ends in "RMSNorm" with a 1-D ``weight`` and a
    float ``variance_epsilon`` (the transformers MLA families' norms)."""
    out = {}
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if (type(m).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1
                and isinstance(getattr(m, "variance_epsilon", None), float)):
            out[name] = m
    return out


def probe(module: nn.Module, forward: Callable) -> str | None:
    """Why the fused kernel does not reproduce `forward` (the module's own) on a probe input, or None."""
    from quantmla.kernels.norm import rms_norm

    w = module.weight
    g = torch.Generator(device=w.device).manual_seed(0)
    x = (torch.randn(5, w.shape[0], generator=g, device=w.device) * 3).to(w.dtype)
    with torch.no_grad():
        ref = forward(x)
        try:
            got = rms_norm(x, w, module.variance_epsilon)
        except (ValueError, RuntimeError) as e:
            return str(e).splitlines()[0]
    if ref.shape != got.shape or ref.dtype != got.dtype:
        return f"its forward gives {ref.dtype} {tuple(ref.shape)}, the kernel {got.dtype} {tuple(got.shape)}"
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(w.dtype, 1e-2)
    err = float(((got.float() - ref.float()).abs() / (ref.float().abs() + 1e-6)).max())
    return None if err <= tol else f"its forward differs from the kernel's by {err:.2g} (relative)"


def _forward(module, *args, **kwargs):
    reg = module.__dict__[_KEY]
    eng = reg["current"]()
    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    if eng is not None and id(eng) in reg["engines"] and x.device == module.weight.device:
        from quantmla.kernels.norm import rms_norm

        return rms_norm(x, module.weight, module.variance_epsilon)
    return reg["orig"](*args, **kwargs)


def attach(model: nn.Module, engine, current: Callable[[], object], cpu: bool = False) -> dict[str, str]:
    """Fuse the RMSNorm modules of `model` inside `engine`'s steps (``current()`` is the engine whose step
    runs, or None). Returns name -> "fused" or why a module keeps its own forward. `cpu`: CPU modules too
    (the Triton interpreter: tests)."""
    report = {}
    for name, m in rms_norm_modules(model).items():
        reg = m.__dict__.get(_KEY)
        orig = reg["orig"] if reg is not None else m.forward
        why = probe(m, orig) if m.weight.is_cuda or cpu else "not on a CUDA device"
        report[name] = why or "fused"
        if not why:
            patch(m, _KEY, _forward, engine, current=current)
    return report


def fused_in(module: nn.Module, engine) -> bool:
    """Whether `module`'s forward runs the fused kernel inside `engine`'s steps (``attach`` fused it for that engine)."""
    reg = module.__dict__.get(_KEY)
    return reg is not None and id(engine) in reg["engines"]


def detach(model: nn.Module, engine) -> None:
    """Undo :func:`attach` for `engine`; the last engine gives the modules their own forwards back."""
    for m in rms_norm_modules(model).values():
        unpatch(m, _KEY, engine)
