"""Static SASS of the CUDA decode kernel's default plans, without a GPU: instructions, registers, stack, and
the build step's opcodes (LOP3, PRMT, HADD2, HFMA2). The plan is made for sm_90 (as on the H200), compiled
by nvcc into the build cache, and read back with cuobjdump (from PATH or Triton's bundled copy).

    python -m quantmla_lab.bench.kernels.sass_count int4/int4 int2/int4 --rows 16
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from unittest import mock

import torch

from quantmla.cache.layout import PageLayout, TokenLayout, preset
from quantmla.kernels import cuda
from quantmla.kernels.cuda.build import compile_cubin

BUILD_OPS = ("LOP3", "PRMT", "HADD2", "HFMA2", "IMAD", "LDS", "STS")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if bundled.exists():
        return str(bundled)
    raise SystemExit("cuobjdump is not on PATH and this Triton bundles none")


def count(name: str, rows: int, d_c: int = 512, d_r: int = 64) -> dict:
    layout = PageLayout(TokenLayout(d_c, d_r, preset(name)), 64)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):  # the H200's sm_90; no GPU needed
        plan = cuda.decode_plan(layout, rows, torch.bfloat16, torch.device("cuda"))
    if plan is None:
        raise SystemExit(f"{name}: no CUDA plan ({cuda.plan_reason.get(layout)})")
    cubin = compile_cubin(plan.macros, "sm_90a")
    tool = cuobjdump()
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = [m.group(1) for m in re.finditer(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M)]
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    reg = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    c = Counter(ops)
    return {"format": name, "rows": rows, "plan": plan.describe(), "instructions": len(ops),
            "registers": int(reg.group(1)) if reg else None, "stack_bytes": int(stack.group(1)) if stack else None,
            **{op: c.get(op, 0) for op in BUILD_OPS}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("formats", nargs="+", help="named formats (cache.layout.PRESETS)")
    p.add_argument("--rows", type=int, default=16, help="query rows per sequence (heads x query tokens)")
    a = p.parse_args(argv)
    for name in a.formats:
        r = count(name, a.rows)
        print("  ".join(f"{k} {v}" for k, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
