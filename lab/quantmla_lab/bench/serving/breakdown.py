"""Where a serve-bench ratio comes from: capacity, decode phase, prefill (issue #6 analysis).

    python3 -m quantmla_lab.bench.serving.breakdown [lab/results/serving/budget_curve_h200.json] \
        [--out lab/results/serving/breakdown.json]

Reads a serve-bench result and prints, per KV budget and low-bit method against BF16:

- capacity ratio: tokens the budget holds, low-bit over BF16 (= the bytes-per-token ratio, up to
  whole pages);
- decode-phase ratio: BF16 seconds in pure decode steps over the method's (what the cache format
  changes);
- whole-job ratio: the measured throughput ratio;
- the whole-job ratio if prompt prefill cost nothing, or half as much, in every format;

and, per run, the mean time of a decode step and of a step with prefill chunks.

No GPU needed: everything comes from the JSON's per-run fields (graph_decode_s + eager_decode_s,
mixed_s, wall_s).
"""

from __future__ import annotations

import argparse
import json
import sys

from quantmla_lab.bench.serving.throughput_report import representative_runs
from quantmla_lab.bench.common import save


def breakdown(result: dict) -> list[dict]:
    runs = representative_runs(result["runs"])  # a result with repeats: each method's median run
    base = {r["budget_gib"]: r for r in runs if r["method"] == "bf16"}
    rows = []
    for r in runs:
        b = base.get(r["budget_gib"])
        if r["method"] == "bf16" or b is None:
            continue

        def parts(x):
            dec = x["graph_decode_s"] + x.get("eager_decode_s", 0.0)
            other = x["wall_s"] - dec - x["mixed_s"]  # scheduling, host bookkeeping
            return dec, x["mixed_s"], other

        bd, bm, bo = parts(b)
        qd, qm, qo = parts(r)
        rows.append({
            "budget_gib": r["budget_gib"], "method": r["method"],
            "capacity_ratio": r["tokens_capacity"] / b["tokens_capacity"],
            "peak_batch": [b["peak_batch"], r["peak_batch"]],
            "bf16_preemptions": b["preemptions"], "bf16_recomputed_tokens": b["recomputed_tokens"],
            "decode_s": [round(bd, 3), round(qd, 3)], "prefill_steps_s": [round(bm, 3), round(qm, 3)],
            "decode_ratio": bd / qd,
            "whole_job_ratio": b["wall_s"] / r["wall_s"],
            "ratio_if_prefill_free": (bd + bo) / (qd + qo),
            "ratio_if_prefill_halved": (bd + bm / 2 + bo) / (qd + qm / 2 + qo),
        })
    return rows


def per_step(result: dict) -> list[dict]:
    """Mean seconds of a pure decode step and of a step with prefill chunks, per run (ms)."""
    out = []
    for r in representative_runs(result["runs"]):
        mixed = r["steps"] - r["decode_steps"]
        dec = r["graph_decode_s"] + r.get("eager_decode_s", 0.0)
        out.append({"budget_gib": r["budget_gib"], "method": r["method"],
                    "decode_ms_per_step": 1e3 * dec / max(1, r["decode_steps"]),
                    "prefill_ms_per_step": 1e3 * r["mixed_s"] / max(1, mixed)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", nargs="?", default="lab/results/serving/budget_curve_h200.json")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    result = json.load(open(a.result))
    rows = breakdown(result)
    print(f"{a.result}: {result.get('device')} {result.get('date')} (commit {result.get('commit', '?')})")
    print(f"{'budget':>8} {'method':>10} {'capacity':>9} {'decode':>7} {'whole':>6} {'no prefill':>10} "
          f"{'half prefill':>12}  prefill s (bf16/low)")
    for r in rows:
        print(f"{r['budget_gib']:>7g}G {r['method']:>10} {r['capacity_ratio']:>8.2f}x {r['decode_ratio']:>6.2f}x "
              f"{r['whole_job_ratio']:>5.2f}x {r['ratio_if_prefill_free']:>9.2f}x {r['ratio_if_prefill_halved']:>11.2f}x  "
              f"{r['prefill_steps_s'][0]:.1f}/{r['prefill_steps_s'][1]:.1f}")
    print(f"\n{'budget':>8} {'method':>10} {'decode ms/step':>15} {'prefill-step ms':>16}  (means over the job)")
    steps = per_step(result)
    for r in steps:
        print(f"{r['budget_gib']:>7g}G {r['method']:>10} {r['decode_ms_per_step']:>15.2f} {r['prefill_ms_per_step']:>16.1f}")
    if a.out:
        save({"source": a.result, "source_device": result.get("device"), "source_date": result.get("date"),
              "source_commit": result.get("commit"), "command": " ".join(["python3"] + sys.argv),
              "rows": rows, "per_step": steps}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
