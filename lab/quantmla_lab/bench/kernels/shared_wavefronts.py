"""Where a decode call's shared-memory traffic comes from: reads Nsight Compute's SASS source page (CSV, with
the SourceCounters section) of one call and prints, per instruction kind, the shared-memory wavefronts
(one wavefront is one cycle of an SM's shared-memory bandwidth, 128 bytes), the ideal count without bank
conflicts and the excess, in all and per cached token.

    ncu --section SourceCounters -k regex:mla_decode -c 1 -s 2 -o rep \
        python3 -m quantmla_lab.bench.kernels.decode_once int4/int4 16 32 16384
    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 -m quantmla_lab.bench.kernels.shared_wavefronts rep.csv --tokens 524288
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict


def opcode(sass: str) -> str:
    """The instruction's opcode without its predicate and modifiers ("@P0 LDS.64 R4, [R2]" -> "LDS")."""
    parts = sass.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else ""


def tally(path: str) -> dict[str, tuple[float, float, float, float]]:
    """opcode -> (wavefronts, ideal wavefronts, excess wavefronts, warp instructions executed)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f)]
    head = next(i for i, r in enumerate(rows) if "Source" in r and "L1 Wavefronts Shared" in r)
    ix = {h: i for i, h in enumerate(rows[head])}

    def num(r, k):
        try:
            return float(r[ix[k]])
        except (ValueError, IndexError):
            return 0.0

    out = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for r in rows[head + 1:]:
        w = num(r, "L1 Wavefronts Shared")
        if w:
            t = out[opcode(r[ix["Source"]])]
            t[0] += w
            t[1] += num(r, "L1 Wavefronts Shared Ideal")
            t[2] += num(r, "L1 Wavefronts Shared Excessive")
            t[3] += num(r, "Instructions Executed")
    return {k: tuple(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--tokens", type=int, required=True, help="cached tokens the call read (batch x context)")
    a = ap.parse_args()
    t = tally(a.csv)
    total = [sum(v[i] for v in t.values()) for i in range(4)]
    print(f"shared-memory wavefronts per token: {total[0] / a.tokens:.2f} (ideal {total[1] / a.tokens:.2f}, "
          f"excess {total[2] / total[0]:.1%})\n")
    print("| instruction | wavefronts per token | ideal | excess | warp instructions per token |")
    print("|---|---:|---:|---:|---:|")
    for op, (w, i, e, n) in sorted(t.items(), key=lambda kv: -kv[1][0]):
        print(f"| {op} | {w / a.tokens:.2f} | {i / a.tokens:.2f} | {e / a.tokens:.2f} | {n / a.tokens:.2f} |")


if __name__ == "__main__":
    main()
