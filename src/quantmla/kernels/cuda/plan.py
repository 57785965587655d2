"""What every CUDA decode plan shares: the constants of one build (DecodePlan), the shared-memory budget of
an H100/H200 SM, the codes of the layout's kinds, fp8_ds_mla's shape, the kernel mode and why a device cannot run a
plan."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from quantmla.cache.layout import PageLayout
    from quantmla.quant.format import PathFormat

SMEM_PER_SM = 233472  # H100/H200: 228 KiB per SM
SMEM_PER_CTA = 232448  # 227 KiB per block
SMEM_RESERVED = 1024  # per CTA, by the runtime

_KIND = {"raw": 0, "affine": 1, "symmetric": 2, "fp8": 3}
_MB = {"float16": 2, "bfloat16": 3, "float32": 4}
_OUT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

plan_reason: dict = {}
"""layout -> why the last plan asked for it is None"""


def mode() -> str:
    """"auto" (default), "cuda" (errors instead of falling back) or "triton" (this path off)."""
    m = os.environ.get("QUANTMLA_DECODE_KERNEL", "auto").strip().lower()
    return m if m in ("auto", "cuda", "triton") else "auto"


@dataclass(frozen=True)
class DecodePlan:
    """The constants of one build (macros of mla_decode.cu) and its launch shape."""

    macros: tuple[tuple[str, int], ...]
    block_m: int
    stages: int
    ctas_per_sm: int
    smem: int

    @property
    def block_n(self) -> int:
        return dict(self.macros)["BN"]

    @property
    def num_warps(self) -> int:
        return dict(self.macros)["NW"]

    def describe(self) -> str:
        m = dict(self.macros)
        tile = "f16" if m["HALF"] else "bf16"
        ws = ("ws" if m.get("WS") else "") + ("q" if m.get("S8_QK") else "") + ("v" if m.get("SCALE_VOTE") else "")
        frag = ("/tm" if m.get("TM") else "/ss" if m.get("SEESAW") else "/wg" if m.get("WG")
                else "")
        tpw = f"t{m['TPW']}" if m.get("TPW", 1) != 1 else ""
        return (f"cuda/{tile}{frag}/M{self.block_m}N{self.block_n}w{self.num_warps}{tpw}{ws}s{self.stages}"
                f"c{self.ctas_per_sm}")


def _assume_cuda() -> bool:
    """Tests plan builds on machines without a GPU by patching torch.cuda.get_device_capability."""
    try:
        torch.cuda.get_device_capability(0)
        return True
    except (RuntimeError, AssertionError, AttributeError):
        return False


def device_reason(device: torch.device | str, capability: tuple[int, int], why: str) -> str | None:
    """Why `device` cannot run a CUDA decode plan (the kernel turned off, not a CUDA device, none available, or a
    compute capability below `capability`: then `why`), or None."""
    if mode() == "triton":
        return "QUANTMLA_DECODE_KERNEL=triton"
    if torch.device(device).type != "cuda":
        return "not a CUDA device"
    if not torch.cuda.is_available() and not _assume_cuda():
        return "no CUDA device is available"
    if torch.cuda.get_device_capability(device) < capability:
        return why
    return None


def path_codes(fmt: PathFormat, dim: int) -> tuple[int, int, int, int]:
    """(kind, bits, group, metadata code) of a path of `dim` channels, as the kernels' KIND_, BITS_, GS_ and MB_
    macros take them. A 16-bit path is raw bf16: its group is the whole path and its metadata code bf16's, neither
    read."""
    if not fmt.quantized:
        return _KIND["raw"], 16, dim, _MB["bfloat16"]
    return _KIND[fmt.mode], fmt.bits, fmt.group_size, _MB[fmt.meta_dtype]


def partial_macros(layout: PageLayout) -> dict:
    """The split partials' type (PART_KIND, PART_SHIFT of out_io.cuh) for a layout, as
    ``partials.partial_dtype`` gives its workspace: fp16 holding o·2^-PART_SHIFT (1), bf16 (2), or nothing (fp32,
    the build as it was)."""
    from quantmla.kernels.partials import PARTIAL_FP16_SHIFT, partial_dtype

    dt = partial_dtype(layout)
    return (dict(PART_KIND=1, PART_SHIFT=PARTIAL_FP16_SHIFT) if dt == torch.float16 else dict(PART_KIND=2)
            if dt == torch.bfloat16 else {})


def partial_kind(plan: DecodePlan) -> torch.dtype:
    """The dtype of the partial output a build of `plan` writes."""
    return {1: torch.float16, 2: torch.bfloat16}.get(dict(plan.macros).get("PART_KIND", 0), torch.float32)


def is_fp8(layout: PageLayout) -> bool:
    """fp8_ds_mla's shape: e4m3 content with one fp32 scale a group, the RoPE key stored unquantized in bf16."""
    c, r = layout.token.fmt.content, layout.token.fmt.rope
    return c.mode == "fp8" and c.meta_dtype == "float32" and not c.per_page and not r.quantized and r.bits == 16
