"""Capture what MLA attention modules see during a forward: hidden states, position embeddings,
and their outputs — the inputs calibration, analysis and the reference checks work from."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from quantmla.model.spec import mla_modules


@contextmanager
def capture_attention_inputs(model: torch.nn.Module, layers: list[int] | None = None, outputs: bool = False):
    """Yields a dict slot -> list of {"hidden", "position_embeddings"[, "output"]} per forward call."""
    mods = mla_modules(model)
    records: dict[int, list[dict]] = {i: [] for i in mods if layers is None or i in layers}
    handles = []

    def pre_hook(slot):
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            records[slot].append({"hidden": hidden.detach(), "position_embeddings": kwargs.get("position_embeddings")})

        return hook

    def post_hook(slot):
        def hook(module, args, kwargs, out):
            records[slot][-1]["output"] = (out[0] if isinstance(out, tuple) else out).detach()

        return hook

    for slot in records:
        handles.append(mods[slot].register_forward_pre_hook(pre_hook(slot), with_kwargs=True))
        if outputs:
            handles.append(mods[slot].register_forward_hook(post_hook(slot), with_kwargs=True))
    try:
        yield records
    finally:
        for h in handles:
            h.remove()
