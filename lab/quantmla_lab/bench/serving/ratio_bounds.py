"""What a serve-bench job's ratios to BF16 would be with faster prefill or faster low-bit decode attention.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.ratio_bounds \
        [--job lab/results/serving/long_1.26gib_h200.json] [--grid lab/results/profile/step_grid_warps_apart_h200.json] \
        --out lab/results/serving/ratio_bounds_long_1.26gib.json

A model on measured figures, not a measurement. Each run's wall time is its mixed (prefilling) steps plus its decode
steps plus the rest (wall - mixed - decode). A decode step is R + A: R the step without attention (projections, MLP,
norms, append, sampling), fitted as one line in the batch over every format on the step grid's graph replays (replay
time - attention time at 16K contexts; the integer formats' R is 30 to 47 us above BF16's, mostly their append, so
their A here holds that difference and a free attention slightly overstates their gain); A = the run's mean decode
step - R at the run's mean decode batch.
The grid scales every format's mixed steps by p (a faster prefill) and one format's A by a (a faster decode kernel
for that format, the baseline's kernel unchanged), and gives that format's whole-job ratio to BF16 and to FP8.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import numpy as np

from quantmla_lab.bench.common import parse_fresh, save
from quantmla_lab.bench.serving.throughput_report import representative_runs

PREFILL = (1.0, 0.75, 0.5)
ATTENTION = (1.0, 0.75, 0.5, 0.25, 0.0)


def rest_of_step(grid: dict) -> tuple[float, float]:
    """R(batch) = r0 + r1 * batch in seconds, least squares over the grid's points (replay - attention)."""
    b = np.array([p["batch"] for p in grid["points"]], float)
    r = np.array([(p["replay_us"] - p["parts"]["attention"]["us_per_step"]) * 1e-6 for p in grid["points"]])
    r1, r0 = np.polyfit(b, r, 1)
    return float(r0), float(r1)


def parts(run: dict, output_tokens: int, R: tuple[float, float]) -> dict:
    """A run's wall split: mixed s, decode steps, mean batch, R and A a step, the rest s."""
    dec_s = run["graph_decode_s"] + run["eager_decode_s"]
    steps = run["decode_steps"]
    # decode rows a step, about: each mixed step counted as sampling one token (R moves 3 us a row, so this is enough)
    batch = (output_tokens - (run["steps"] - steps)) / steps
    r = R[0] + R[1] * batch
    return {"mixed_s": run["mixed_s"], "decode_steps": steps, "mean_batch": batch, "R_ms": 1e3 * r,
            "A_ms": 1e3 * (dec_s / steps - r), "other_s": run["wall_s"] - run["mixed_s"] - dec_s}


def wall(x: dict, p: float, a: float) -> float:
    return p * x["mixed_s"] + x["decode_steps"] * 1e-3 * (x["R_ms"] + a * x["A_ms"]) + x["other_s"]


def budget_model(runs: dict, R: tuple[float, float], log=print) -> dict:
    """One budget's runs (method -> run, BF16 among them) -> parts and ratio grids against BF16 and FP8."""
    x = {m: parts(r, r["output_tokens"], R) for m, r in runs.items()}
    for m, v in x.items():
        log(f"{m:>10}: mixed {v['mixed_s']:.1f} s, {v['decode_steps']} decode steps at batch {v['mean_batch']:.1f}: "
            f"R {v['R_ms']:.2f} + A {v['A_ms']:.2f} ms, other {v['other_s']:.2f} s")
    ratios = {}
    for base in ("bf16", "fp8"):
        for m in x:
            if m in ("bf16", base) or base not in x:
                continue
            grid_m = [[wall(x[base], p, 1.0) / wall(x[m], p, att) for att in ATTENTION] for p in PREFILL]
            measured = runs[m]["tokens_per_s"] / runs[base]["tokens_per_s"]
            ratios[f"{m} x {base}"] = {"measured": measured, "model": grid_m}
            log(f"\n{m} x {base.upper()} (measured {measured:.2f}); rows: mixed steps x {PREFILL}, columns: {m}'s "
                f"attention x {ATTENTION}")
            for p, row in zip(PREFILL, grid_m):
                log(f"  {p:4}: " + "  ".join(f"{v:5.2f}" for v in row))
    return {"parts": x, "ratios": ratios}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="lab/results/serving/long_1.26gib_h200.json")
    ap.add_argument("--grid", default="lab/results/profile/step_grid_warps_apart_h200.json")
    ap.add_argument("--out", required=True)
    a = parse_fresh(ap)
    job, grid = json.load(open(a.job)), json.load(open(a.grid))
    R = rest_of_step(grid)
    by_budget: dict[float, dict] = {}
    for r in representative_runs(job["runs"]):  # a result with repeats: each method's median run
        by_budget.setdefault(r["budget_gib"], {})[r["method"]] = r
    if not any("bf16" in runs for runs in by_budget.values()):
        ap.error(f"{a.job} has no BF16 run to compare against")
    print(f"R(batch) = {1e3 * R[0]:.3f} + {1e3 * R[1]:.4f} * batch ms ({a.grid})")
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python3", "-m", "quantmla_lab.bench.serving.ratio_bounds"] + sys.argv[1:]),
           "job": a.job, "job_commit": job.get("commit"), "grid": a.grid, "grid_commit": grid.get("commit"),
           "R_ms": [1e3 * R[0], 1e3 * R[1]], "prefill_scale": PREFILL, "attention_scale": ATTENTION, "budgets": {},
           "note": "a model on measured figures, not a measurement"}
    for b, runs in sorted(by_budget.items()):
        if "bf16" not in runs:
            continue
        print(f"\n== {b:g} GiB ==")
        out["budgets"][f"{b:g}"] = budget_model(runs, R)
    save(out, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
