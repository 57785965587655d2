"""Module forwards that engines swap while their steps run: one registry per module and purpose.

Several engines may serve one model. The first engine to patch a module for a purpose (``key``) keeps the
module's own forward in the module's registry, ``module.__dict__[key]``, and installs its ``forward``; every
engine adds its entry; the last engine to leave gives the module its own forward back (after ``on_last``, which
releases what the registry holds, such as stacked weights). The swapped forward finds the running engine's entry
and otherwise calls ``registry["orig"]``.
"""

from __future__ import annotations

import types
from collections.abc import Callable

from torch import nn


def patch(module: nn.Module, key: str, forward: Callable, engine, entry=True, **state) -> dict:
    """Register `engine` (with `entry`) on `module` under `key`, installing `forward` and the registry's
    `state` (kept from the first engine) if no engine has yet. Returns the registry."""
    reg = module.__dict__.get(key)
    if reg is None:
        reg = {"orig": module.forward, "engines": {}, **state}
        module.__dict__[key] = reg
        module.forward = types.MethodType(forward, module)
    reg["engines"][id(engine)] = entry
    return reg


def unpatch(module: nn.Module, key: str, engine, on_last: Callable[[dict], None] | None = None) -> None:
    """Remove `engine` from `module`'s registry under `key`; the last engine gives the module its own forward back."""
    reg = module.__dict__.get(key)
    if reg is None:
        return
    reg["engines"].pop(id(engine), None)
    if not reg["engines"]:
        if on_last is not None:
            on_last(reg)
        module.__dict__.pop("forward", None)
        module.__dict__.pop(key, None)
