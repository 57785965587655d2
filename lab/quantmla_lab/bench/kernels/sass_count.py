"""Static SASS of the CUDA decode kernel's default plans, without a GPU: instructions, registers, stack, and
the build step's opcodes (LOP3, PRMT, HADD2, HFMA2). The plan is made for sm_90 (as on the H200), compiled
by nvcc into the build cache, and read back with cuobjdump (from PATH or Triton's bundled copy).

    python -m quantmla_lab.bench.kernels.sass_count int4/int4 int2/int4 --rows 16

`--tokens-m` takes the tokens-as-M kernel's 4-warp plan (`--specialized`: the plan with the scores' and the output's
warps apart, the API's default for integer codes at 16 rows on sm_90, whose loop it does not split into phases) and
counts one tile's scores phase: the instructions from its copy wait (`SYNCS.PHASECHK`) to the vote's barrier (`BAR.RED`), by opcode
(`scores_*`; with two token blocks a warp that span holds both halves' code paths), and the tile loop's phases
along the path a warp takes where the loop has one barrier a tile (`loop_*`, `loop_phases`).

`--set MACRO=V` compiles the plan with a macro replaced or added (e.g. `--set MIN_CTAS=4`: registers capped for
four CTAs an SM; `stack_bytes` then shows what spills).

`--warpgroup` takes the heads-as-M kernel's plan (with `--rows` 64 or more). `--dump DIR`
writes each plan's instructions (`DIR/<format>_<rows>[_tokens_m|_warpgroup].sass`, without their encodings), so
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


def _branch(text: str) -> tuple[bool, int] | None:
    """(predicated, target address) of a `BRA` line (cuobjdump text without its address), else None."""
    m = re.match(r"(@!?U?P\w+\s+)?BRA(?:\.\S+)*\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
    return None if m is None else (m.group(1) is not None, int(m.group(2), 16))


def loop_phases(lines: list[tuple[int, str]]) -> dict:
    """The tokens-as-M kernel's one-barrier tile loop, instructions per warp and tile along its usual path (scores done, no
    reference moved), from `lines` = (address, instruction) of its SASS: the scores from the loop's top to the vote
    (`BAR.RED`) along each of the two code paths the warps' channel halves take; the vote and the next stage's copy
    issue (`vote` for the warps that skip the issue, `vote_issuing` for the one that issues); the output products
    (the block the first tile skips); P (after the skipped move of the reference, to the loop's back edge). {} where
    the SASS does not have that shape. The zeroing of a partial tile's metadata right after the copy wait is a block
    that full tiles skip: it is not counted."""
    at = {a: i for i, (a, _) in enumerate(lines)}
    ops = [t.split()[1] if t.startswith("@") else t.split()[0] for _, t in lines]
    wait = next((i for i, op in enumerate(ops) if op.startswith("SYNCS.PHASECHK")), None)
    vote = None if wait is None else next((i for i in range(wait, len(ops)) if ops[i].startswith("BAR.RED")), None)
    if vote is None:
        return {}
    back = next((i for i in range(vote, len(lines)) if (b := _branch(lines[i][1])) and not b[0]
                 and b[1] < lines[wait][0] and b[1] in at), None)
    if back is None:
        return {}
    top = at[_branch(lines[back][1])[1]]

    def forward(lo: int, hi: int) -> list[tuple[int, int]]:  # (branch, target) of predicated branches within [lo, hi]
        out = []
        for i in range(lo, hi):
            b = _branch(lines[i][1])
            if b and b[0] and b[1] in at and i < at[b[1]] <= hi:
                out.append((i, at[b[1]]))
        return out

    def paths(lo: int, hi: int, first: int) -> list[int]:
        """Instructions from `first` to `hi` (inclusive) along each path: one, or two where an if/else splits them
        (a predicated jump k -> t over the first branch, which ends with a jump to the join)."""
        for k, t in forward(lo, hi):
            jb = _branch(lines[t - 1][1])
            if jb is not None and not jb[0] and jb[1] in at and t <= at[jb[1]] <= hi:
                join = at[jb[1]]
                return sorted([(k + 1 - first) + (t - k - 1) + (hi + 1 - join), (k + 1 - first) + (join - t) + (hi + 1 - join)])
        return [hi + 1 - first]

    # the first block after the copy wait that a predicated jump skips (no else): the zeroing of a unit's last,
    # partial tile, which full tiles jump over (not on their path)
    zero = next(((k, t) for k, t in forward(wait, vote) if k - wait <= 8 and not (
        (jb := _branch(lines[t - 1][1])) is not None and not jb[0])), None)
    scores = paths(zero[1] if zero else wait, vote, top)  # two paths where the channel halves' code splits
    if zero:
        scores = [n - (zero[1] - zero[0] - 1) for n in scores]
    after = forward(vote, back)
    if not after:
        return {}
    skip_at, issue_end = after[0]  # the warps that do not issue jump over the copy issue
    rest = forward(issue_end, back)  # the output's skip (first tile), then the move's skip (the loop's exit jumps out)
    if len(rest) < 2:
        return {}
    (o_br, o_end), (_, p_start) = rest[0], rest[1]
    return {"loop_scores": scores, "loop_vote": skip_at + 1 - vote, "loop_vote_issuing": issue_end - vote,
            "loop_output": o_end - o_br - 1, "loop_p": paths(p_start, back, p_start)}


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


def count(name: str, rows: int, d_c: int = 512, d_r: int = 64,
          dump: Path | None = None, tokens_m: bool = False, overrides: dict | None = None,
          token_blocks: int | None = None, specialized: bool = False, warpgroup: bool = False) -> dict:
    layout = PageLayout(TokenLayout(d_c, d_r, _format(name)), 64)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):  # the H200's sm_90; no GPU needed
        plan = cuda.decode_plan(layout, rows, torch.bfloat16, torch.device("cuda"), tokens_m=tokens_m or None,
                                warpgroup=warpgroup, token_blocks=token_blocks,
                                specialized=specialized if tokens_m else None)
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
        kind = "_tokens_m" if tokens_m else "_warpgroup" if warpgroup else ""
        (dump / f"{tag}_{rows}{kind}.sass").write_text("\n".join(lines) + "\n")
    lines = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass, re.M)]
    ops = [m.group(1) for m in re.finditer(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M)]
    full = [m.group(1) for m in re.finditer(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M)]
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    reg = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    c = Counter(ops)
    return {"format": name, "rows": rows, "plan": plan.describe(), "instructions": len(ops),
            "registers": int(reg.group(1)) if reg else None, "stack_bytes": int(stack.group(1)) if stack else None,
            **{op: c.get(op, 0) for op in BUILD_OPS}, **(scores_phase(full) if tokens_m else {}),
            **(loop_phases(lines) if tokens_m and dict(macros).get("ONE_BARRIER") and not dict(macros).get("WS") else {})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("formats", nargs="+", help="named formats (cache.layout.PRESETS)")
    p.add_argument("--rows", type=int, default=16, help="query rows per sequence (heads x query tokens)")
    p.add_argument("--tokens-m", action="store_true", help="the tokens-as-M kernel, with its scores phase's counts")
    p.add_argument("--token-blocks", type=int, help="the tokens-as-M kernel: 16-token blocks a warp's scores take")
    p.add_argument("--specialized", action="store_true", help="the tokens-as-M kernel with its warps apart")
    p.add_argument("--warpgroup", action="store_true", help="the heads-as-M kernel (64 rows or more)")
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
        r = count(name, a.rows, dump=a.dump, tokens_m=a.tokens_m, overrides=overrides,
                  token_blocks=a.token_blocks, specialized=a.specialized, warpgroup=a.warpgroup)
        if overrides:
            r = {**r, "set": " ".join(a.set)}
        print("  ".join(f"{k} {v}" for k, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
