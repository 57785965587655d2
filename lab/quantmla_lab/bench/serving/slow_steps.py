"""Which prefilling steps of one serve-bench run took much longer than the same steps of another run of the same job.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.slow_steps lab/results/serving/long_1.26gib_h200.json \
        lab/results/serving/long_1.26gib_graph_units_rows_h200.json --out lab/results/serving/slow_steps_long_1.26gib.json

The two results must schedule the same job (the same prompt tokens, step by step, in each method's step log). A step
counts as slow where it took more than ``--ratio`` times the reference's same step and more than ``--min-ms``. For
each method in both, the slow steps (index, prompt tokens, chunks, decode rows, ms, launch ms, the reference's ms),
their excess over the reference, and the run's tokens/s with that excess taken out: a subtraction, not a
measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from quantmla_lab.bench.common import parse_fresh, save
from quantmla_lab.bench.serving.throughput_report import representative_runs


def slow_steps(run: dict, ref: dict, ratio: float = 1.5, min_ms: float = 300.0) -> dict:
    """The slow prefilling steps of `run` against `ref` (two runs of one method on the same job)."""
    a, b = run["step_log"]["prefill_steps"], ref["step_log"]["prefill_steps"]
    if [s["prompt_tokens"] for s in a] != [s["prompt_tokens"] for s in b]:
        raise ValueError(f"{run['method']}: the two runs prefill different steps; compare runs of the same job")
    slow = [{"step": i, "prompt_tokens": x["prompt_tokens"], "chunks": x["chunks"], "decode_rows": x["decode_rows"],
             "ms": x["total_ms"], "launch_ms": x["launch_ms"], "reference_ms": y["total_ms"]}
            for i, (x, y) in enumerate(zip(a, b)) if x["total_ms"] > max(ratio * y["total_ms"], min_ms)]
    excess = sum(s["ms"] - s["reference_ms"] for s in slow) / 1e3
    return {"method": run["method"], "budget_gib": run["budget_gib"], "slow_steps": slow, "excess_s": round(excess, 3),
            "wall_s": run["wall_s"], "tokens_per_s": run["tokens_per_s"],
            "tokens_per_s_without_excess": round(run["output_tokens"] / (run["wall_s"] - excess), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="serve-bench result JSON")
    ap.add_argument("reference", help="serve-bench result JSON of the same job")
    ap.add_argument("--ratio", type=float, default=1.5)
    ap.add_argument("--min-ms", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    a = parse_fresh(ap)
    run, ref = json.load(open(a.run)), json.load(open(a.reference))
    refs = {(r["budget_gib"], r["method"]): r for r in representative_runs(ref["runs"])}
    rows = []
    for r in representative_runs(run["runs"]):
        other = refs.get((r["budget_gib"], r["method"]))
        if other is None:
            continue
        row = slow_steps(r, other, a.ratio, a.min_ms)
        rows.append(row)
        steps = ", ".join(f"{s['step']} ({s['prompt_tokens']} tokens, {s['decode_rows']} rows): {s['ms']:.0f} ms, "
                          f"launch {s['launch_ms']:.0f}, reference {s['reference_ms']:.0f}" for s in row["slow_steps"])
        print(f"{row['method']:>10} {row['budget_gib']:g} GiB: {row['excess_s']:.2f} s over the reference in "
              f"{len(row['slow_steps'])} steps [{steps}]; {row['tokens_per_s']} tok/s, "
              f"{row['tokens_per_s_without_excess']} without them")
    if a.out:
        save({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python3", "-m", "quantmla_lab.bench.serving.slow_steps"] + sys.argv[1:]),
              "run": a.run, "run_commit": run.get("commit"), "reference": a.reference,
              "reference_commit": ref.get("commit"), "ratio": a.ratio, "min_ms": a.min_ms,
              "note": "a subtraction, not a measurement", "methods": rows}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
