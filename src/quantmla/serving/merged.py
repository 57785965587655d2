"""Linear maps that read one input, computed as one GEMM inside engine steps.

At decode's few rows a GEMM's time is mostly its weight's read plus a fixed latency of a few µs, so two
products of the same input cost less as one product of their stacked weights: on the H200, with the rows of a
32-sequence decode step, q_proj and kv_a_proj_with_mqa of DeepSeek-V2-Lite take 6.9 + 6.1 µs apart and 7.6 µs
stacked; the MLP's gate and up projections 2 x 15.4 µs apart and 27.2 µs stacked
(``lab/results/profile/projection_gemms_h200.json``).

The stacked weight costs no memory: each module's ``weight`` (and ``bias``) becomes a view of its row block in
the stacked tensor (the ``Parameter`` objects stay the same), and :meth:`MergedLinears.release` gives each
module its own storage back. Until then an in-place update of a module's weight updates the stacked one; a
module whose weight was replaced (``.data`` set anew) is no longer a view of it, and a module replaced as a whole
(``attn.q_proj = nn.Linear(...)``) is no longer the one its owner holds (``owners``); :meth:`MergedLinears.current`
says so in either case, so callers fall back to the modules' own products rather than a stale copy. Saving the model
meanwhile writes each module's own rows (``save_pretrained`` and safetensors' ``save_file`` take the views as they are).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def merge_reason(linears: list[nn.Module]) -> str | None:
    """Why `linears` cannot be stacked into one GEMM, or None: each a plain ``nn.Linear`` without hooks or a
    replaced forward (accelerate's offloading wraps ``forward``), its weight materialized, all on one device and
    dtype, with one input width, all with biases or none."""
    for lin in linears:
        if type(lin) is not nn.Linear:
            return f"{type(lin).__name__} is not a plain nn.Linear"
        if lin._forward_hooks or lin._forward_pre_hooks or "forward" in lin.__dict__:
            return "a module has forward hooks or a replaced forward (offloading, adapters)"
        if lin.weight.device.type == "meta":
            return "a weight is not materialized (meta device)"
    w0 = linears[0].weight
    if any(lin.weight.device != w0.device or lin.weight.dtype != w0.dtype for lin in linears):
        return "weights on different devices or of different dtypes"
    if any(lin.in_features != linears[0].in_features for lin in linears):
        return "different input widths"
    if len({lin.bias is None for lin in linears}) > 1:
        return "some have biases and some not"
    return None


class MergedLinears:
    """``linears`` (plain ``nn.Linear`` of one input width, see :func:`merge_reason`) as one product.

    ``weight`` [sum of out_features, in_features] stacks their weights in order; calling it on x [..., in]
    returns one output per module, [..., out_i] (views of one GEMM's output). ``owners()`` (optional) returns the
    modules their owners hold now, in the same order (e.g. ``lambda: [mlp.gate_proj, mlp.up_proj]``)."""

    def __init__(self, linears: list[nn.Module], owners: Callable[[], list[nn.Module]] | None = None):
        why = merge_reason(linears)
        if why:
            raise ValueError(f"cannot merge these linears: {why}")
        self.linears = list(linears)
        self.owners = owners
        self.sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            self.weight = torch.cat([lin.weight.detach() for lin in linears])
            self.bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
            start = 0
            for lin, n in zip(linears, self.sizes):
                lin.weight.data = self.weight[start:start + n]
                if self.bias is not None:
                    lin.bias.data = self.bias[start:start + n]
                start += n
        self._views = self._pointers()

    def _pointers(self) -> list[tuple]:
        return [(lin.weight.data_ptr(), tuple(lin.weight.shape), None if lin.bias is None else lin.bias.data_ptr())
                for lin in self.linears]

    def current(self) -> bool:
        """Whether every module is still its owner's (``owners``) and its weight still the view of its block (neither
        replaced since the merge)."""
        if self.owners is not None and any(a is not b for a, b in zip(self.owners(), self.linears, strict=True)):
            return False
        return self._pointers() == self._views

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))

    def release(self) -> None:
        """Give every module that still views its block a storage of its own (the same values)."""
        with torch.no_grad():
            for lin, (wp, _, bp) in zip(self.linears, self._views):
                if lin.weight.data_ptr() == wp:
                    lin.weight.data = lin.weight.data.clone()
                if lin.bias is not None and lin.bias.data_ptr() == bp:
                    lin.bias.data = lin.bias.data.clone()
        self.weight = self.bias = None
        self._views = []
