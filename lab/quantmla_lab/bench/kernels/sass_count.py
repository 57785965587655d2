"""Static SASS of the CUDA decode kernel's default plans, without a GPU: instructions, registers, stack, and
the build step's opcodes (LOP3, PRMT, HADD2, HFMA2). The plan is made for sm_90 (as on the H200), compiled
by nvcc into the build cache, and read back with cuobjdump (from PATH or Triton's bundled copy).

    python -m quantmla_lab.bench.kernels.sass_count int4/int4 int2/int4 --rows 16

`--tokens-m` takes the tokens-as-M kernel (the API's default at 16 rows on sm_90) and counts one tile's scores
phase per warp: the instructions from its copy wait (`SYNCS.PHASECHK`) to the vote's barrier (`BAR.RED`), by
opcode (`scores_*`).

`--set MACRO=V` compiles the plan with a macro replaced or added (e.g. `--set MIN_CTAS=4`: registers capped for
four CTAs an SM; `stack_bytes` then shows what spills).

`--fragments` takes the plan that reads the codes straight into the products' operands. `--dump DIR`
writes each plan's instructions (`DIR/<format>_<rows>[_fragments].sass`, without their encodings), so
that two source trees' builds can be compared with `diff -r`. A format is a preset name or a
`CacheFormat` JSON string, e.g. '{"content": {"bits": 2, "group_size": 64, "mode": "symmetric",
"meta_dtype": "bfloat16"}, "rope": {"bits": 8, "group_size": 32, "mode": "symmetric"}}'.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from unittest import mock

import torch

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout, preset
from quantmla.kernels import cuda
from quantmla.kernels.cuda.build import compile_cubin

BUILD_OPS = ("LOP3", "PRMT", "HADD2", "HFMA2", "IMAD", "LDS", "STS")
SCORES_OPS = ("HMMA", "LDSM", "LOP3", "SHF", "FFMA", "LDS")


def scores_phase(ops: list[str]) -> dict:
    """One tile's scores phase of the tokens-as-M kernel (its opcodes from the first copy wait to the next
    `BAR.RED`, the vote): instructions per warp, and those of SCORES_OPS; {} where the SASS has no such span."""
    start = next((i for i, op in enumerate(ops) if op.startswith("SYNCS.PHASECHK")), None)
    end = None if start is None else next((i for i in range(start, len(ops)) if ops[i].startswith("BAR.RED")), None)
    if end is None:
        return {}
    span = [op.split(".")[0] for op in ops[start:end + 1]]
    c = Counter(span)
    return {"scores_instructions": len(span), **{f"scores_{op}": c.get(op, 0) for op in SCORES_OPS}}


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if bundled.exists():
        return str(bundled)
    raise SystemExit("cuobjdump is not on PATH and this Triton bundles none")


def _format(name: str) -> CacheFormat:
    return CacheFormat.from_dict(json.loads(name)) if name.lstrip().startswith("{") else preset(name)


def count(name: str, rows: int, d_c: int = 512, d_r: int = 64, fragments: bool = False,
          dump: Path | None = None, tokens_m: bool = False, overrides: dict | None = None,
          token_blocks: int | None = None) -> dict:
    layout = PageLayout(TokenLayout(d_c, d_r, _format(name)), 64)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):  # the H200's sm_90; no GPU needed
        plan = cuda.decode_plan(layout, rows, torch.bfloat16, torch.device("cuda"), fragments=fragments or None,
                                tokens_m=tokens_m or None,
                                token_blocks=token_blocks)
    if plan is None:
        raise SystemExit(f"{name}: no CUDA plan ({cuda.plan_reason.get(layout)})")
    macros = tuple(sorted({**dict(plan.macros), **(overrides or {})}.items()))
    cubin = compile_cubin(macros, "sm_90a")
    tool = cuobjdump()
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        tag = re.sub(r"[^A-Za-z0-9]+", "_", layout.token.fmt.describe()).strip("_")
        lines = [ln.split(";")[0].strip() for ln in sass.splitlines() if re.match(r"^\s+/\*[0-9a-f]{4,}\*/", ln)]
        (dump / f"{tag}_{rows}{'_fragments' if fragments else ''}{'_tokens_m' if tokens_m else ''}.sass").write_text("\n".join(lines) + "\n")
    ops = [m.group(1) for m in re.finditer(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M)]
    full = [m.group(1) for m in re.finditer(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M)]
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    reg = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    c = Counter(ops)
    return {"format": name, "rows": rows, "plan": plan.describe(), "instructions": len(ops),
            "registers": int(reg.group(1)) if reg else None, "stack_bytes": int(stack.group(1)) if stack else None,
            **{op: c.get(op, 0) for op in BUILD_OPS}, **(scores_phase(full) if tokens_m else {})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("formats", nargs="+", help="named formats (cache.layout.PRESETS)")
    p.add_argument("--rows", type=int, default=16, help="query rows per sequence (heads x query tokens)")
    p.add_argument("--fragments", action="store_true", help="the plan without a built tile")
    p.add_argument("--tokens-m", action="store_true", help="the tokens-as-M kernel, with its scores phase's counts")
    p.add_argument("--token-blocks", type=int, help="the tokens-as-M kernel: 16-token blocks a warp's scores take")
    p.add_argument("--set", nargs="+", default=[], metavar="MACRO=V", help="compile with these macros replaced")
    p.add_argument("--dump", type=Path, help="write each plan's instructions into this folder")
    a = p.parse_args(argv)
    overrides = {}
    for kv in a.set:
        k, _, v = kv.partition("=")
        if not k or not v.lstrip("-").isdigit():
            p.error(f"--set {kv}: give MACRO=INTEGER, e.g. MIN_CTAS=4")
        overrides[k] = int(v)
    for name in a.formats:
        r = count(name, a.rows, fragments=a.fragments, dump=a.dump, tokens_m=a.tokens_m, overrides=overrides,
                  token_blocks=a.token_blocks)
        if overrides:
            r = {**r, "set": " ".join(a.set)}
        print("  ".join(f"{k} {v}" for k, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
