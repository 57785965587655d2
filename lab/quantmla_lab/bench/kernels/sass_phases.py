"""Where the CUDA decode kernel's issue slots and stalls go, phase by phase, from an Nsight Compute
source page (SASS) of one profiled call.

    ncu --clock-control none -k regex:mla_decode -c 1 -s 2 --section WarpStateStats --section SourceCounters \\
        -o prof python3 -m quantmla_lab.bench.kernels.decode_once int4/int4 16 32 16384
    ncu --import prof.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 -m quantmla_lab.bench.kernels.sass_phases sass.csv --tokens 524288

The kernel's tile loop has a barrier after each phase (the stage has landed; the tile is built; the
scores are in shared memory; P is in shared memory), so the barriers executed once per warp and tile
split the SASS into phases: everything up to the copy wait, the build (and the next tile's copy), QK,
softmax, PV (and the epilogue). Per phase:
the share of warp-stall samples, warp instructions executed per token and the top stall reasons.
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def phases(path: str, tokens: int) -> str:
    rows = list(csv.reader(open(path, errors="replace")))
    hi = next(i for i, r in enumerate(rows) if "Source" in [c.strip() for c in r])
    head, data = rows[hi], [r for r in rows[hi + 1:] if len(r) > 5]
    src, samp, execd = head.index("Source"), head.index("Warp Stall Sampling (All Samples)"), head.index("Instructions Executed")
    stalls = [(i, c[len("stall_"):]) for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(_num(r[samp]) for r in data) or 1.0
    bars = [i for i, r in enumerate(data) if r[src].strip().startswith("BAR.SYNC")]
    per_tile = max((_num(data[i][execd]) for i in bars), default=0)
    loop_bars = [i for i in bars if _num(data[i][execd]) == per_tile]
    names = ["up to the copy wait", "build + next copy", "QK", "softmax", "PV + after the loop"]
    cuts = [0] + [b + 1 for b in loop_bars] + [len(data)]
    lines = [f"{sum(_num(r[execd]) for r in data) / tokens:.1f} warp instructions per token, "
             f"{len(loop_bars)} barriers per tile", "",
             "| phase | stall samples | warp instr / token | top stalls |", "|---|---:|---:|---|"]
    for k in range(len(cuts) - 1):
        seg = data[cuts[k]:cuts[k + 1]]
        st = Counter({name: sum(_num(r[i]) for r in seg) for i, name in stalls})
        top = ", ".join(f"{n} {v / total * 100:.1f} %" for n, v in st.most_common(3))
        name = names[k] if len(loop_bars) == 4 and k < len(names) else f"segment {k}"
        lines.append(f"| {name} | {sum(_num(r[samp]) for r in seg) / total * 100:.1f} % | "
                     f"{sum(_num(r[execd]) for r in seg) / tokens:.1f} | {top} |")
    ops = Counter()
    for r in data:
        words = r[src].split()
        if words:
            ops[(words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]] += _num(r[execd])
    lines += ["", "warp instructions per token by opcode: " + ", ".join(f"{o} {v / tokens:.1f}" for o, v in ops.most_common(14))]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--tokens", type=int, required=True, help="tokens the profiled call read (batch x context)")
    a = ap.parse_args()
    print(phases(a.csv, a.tokens))


if __name__ == "__main__":
    main()
