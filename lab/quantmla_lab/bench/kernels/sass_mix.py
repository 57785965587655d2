"""A decode kernel's instruction mix and warp-stall reasons from an Nsight Compute source page (SASS) of one
profiled call: warp instructions executed per warp and tile by opcode, stall samples by reason, and the
instructions with the most samples.

    ncu --clock-control none -k regex:mla_decode -c 1 -s 2 --section WarpStateStats --section SourceCounters \\
        -o prof python3 -m quantmla_lab.bench.kernels.decode_once int4/int4 128 32 8192
    ncu --import prof.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 -m quantmla_lab.bench.kernels.sass_mix sass.csv --warp-tiles 65536

`--warp-tiles`: warps x tiles of the call (128 heads, 32 x 8192: 4096 tiles x 2 head blocks x 8 warps).
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter

from quantmla_lab.bench.kernels.sass_phases import _num as _float


def _num(x: str) -> int:
    return int(_float(x))


def mix(path: str, warp_tiles: int, top: int = 25) -> str:
    rows = list(csv.reader(open(path, errors="replace")))
    hi = next(i for i, r in enumerate(rows) if "Source" in [c.strip() for c in r])
    head, data = rows[hi], [r for r in rows[hi + 1:] if len(r) > 5]
    src, samp, execd = head.index("Source"), head.index("Warp Stall Sampling (All Samples)"), head.index("Instructions Executed")
    stalls = [(i, c[len("stall_"):]) for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
    ops, reasons = Counter(), Counter()
    for r in data:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip()).split(" ")[0].split(".")[0]
        ops[op] += _num(r[execd])
        for i, name in stalls:
            reasons[name] += _num(r[i])
    total, samples = sum(ops.values()), sum(_num(r[samp]) for r in data) or 1
    out = [f"warp instructions executed: {total} ({total / warp_tiles:.1f} a warp and tile)", "", "by opcode, a warp and tile:"]
    out += [f"  {op:12s} {n / warp_tiles:8.1f}" for op, n in ops.most_common(top)]
    out += ["", f"warp-stall samples: {samples}, by reason:"]
    out += [f"  {name:18s} {n:8d} {n / samples:6.3f}" for name, n in reasons.most_common() if n]
    out += ["", "instructions with the most samples (samples, top reasons):"]
    for r in sorted(data, key=lambda r: -_num(r[samp]))[:top]:
        c = Counter({name: _num(r[i]) for i, name in stalls})
        out.append(f"  {_num(r[samp]):6d}  {r[src].strip()[:56]:56s} " + ", ".join(f"{k} {v}" for k, v in c.most_common(2)))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--warp-tiles", type=int, required=True, help="warps x tiles of the profiled call")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    print(mix(a.csv, a.warp_tiles, a.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
