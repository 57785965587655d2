"""Project serve-bench ratios to other jobs: the engine's own scheduler, step times fitted on the H200.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.projection [lab/results/serving/budget_curve_h200.json] \
        [--out lab/results/serving/projection.json]

1. Replays every run of a serve-bench result through ``serving.scheduler.Scheduler`` (same job, pages,
   token budget, watermark) without a model. The scheduler is deterministic, so the replay must give
   the measured step, decode-step, preemption and recompute counts exactly; the script checks that.
2. Fits, per cache format, a step-time model on the measured times of those runs:
   decode step (CUDA graph) = a + b·(sequences), prefill-carrying step = c + d·(prompt tokens) + b·(decode rows)
   (c >= 0: when the fit gives a negative constant, c = 0 and d alone is fitted).
3. Predicts whole-job throughput ratios for other job shapes and budgets from the same model, and prints
   how well it reproduces the measured ratios.

A projection, not a measurement: decode-step times were measured at contexts up to ~2.4K tokens, where
attention is a small part of a step, so the model does not cover long-context jobs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import numpy as np

from quantmla.serving.scheduler import Scheduler, Sequence
from quantmla_lab.bench.serving.throughput import BenchSettings, make_job
from quantmla_lab.bench.serving.throughput_report import representative_runs
from quantmla_lab.bench.common import save

GIB = 1 << 30


def job_scheduler(job, pages: int, s: BenchSettings) -> Scheduler:
    """The engine's scheduler with serve-bench's settings and every request of the job waiting."""
    sched = Scheduler(pages, s.page_size, s.max_num_seqs, s.max_num_batched_tokens, s.watermark)
    for i, r in enumerate(job):
        sched.add(Sequence(r, i, set()))
    return sched


def plans(sched: Scheduler):
    """Each step's plan until the job is done, committed after the caller has seen it (a token for every sampling
    row; no model). The scheduler is deterministic, so this is the measured run's sequence of steps."""
    while sched.has_unfinished():
        plan = sched.schedule()
        if not plan.items:
            raise RuntimeError("the scheduler made no progress")
        yield plan
        sched.commit(plan, [1 if it.sample else None for it in plan.items])


def replay(job, pages: int, s: BenchSettings) -> dict:
    """Run the scheduler over the job; per-step compositions and the counters serve-bench reports."""
    sched = job_scheduler(job, pages, s)
    dec_b, mix_tokens, mix_rows = [], [], []
    for plan in plans(sched):
        if plan.is_decode:
            dec_b.append(len(plan.items))
        else:
            mix_tokens.append(sum(it.n for it in plan.items if it.n > 1 or not it.sample))
            mix_rows.append(sum(1 for it in plan.items if it.n == 1 and it.sample))
    st = sched.stats
    return {"steps": st.steps, "decode_steps": st.decode_steps, "preemptions": st.preemptions,
            "recomputed_tokens": st.recomputed_tokens, "output_tokens": st.output_tokens,
            "dec_b": np.array(dec_b, float), "mix_tokens": np.array(mix_tokens, float), "mix_rows": np.array(mix_rows, float)}


def fit(runs: list[tuple[dict, dict]]) -> dict:
    """Least squares on one format's runs: decode a, b from (steps, Σ batch); mixed c, d given b."""
    A = np.array([[len(r["dec_b"]), r["dec_b"].sum()] for r, _ in runs])
    y = np.array([m["graph_decode_s"] + m["eager_decode_s"] for _, m in runs])
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    A2 = np.array([[len(r["mix_tokens"]), r["mix_tokens"].sum()] for r, _ in runs])
    y2 = np.array([m["mixed_s"] - b * r["mix_rows"].sum() for r, m in runs])
    (c, d), *_ = np.linalg.lstsq(A2, y2, rcond=None)
    if c < 0:  # the per-step constant is poorly determined next to the per-token cost: drop it
        c, d = 0.0, float(y2 @ A2[:, 1] / (A2[:, 1] @ A2[:, 1]))
    return {"decode_s": float(a), "decode_s_per_seq": float(b), "mixed_s": float(c), "mixed_s_per_token": float(d)}


def wall(r: dict, f: dict) -> float:
    return (len(r["dec_b"]) * f["decode_s"] + f["decode_s_per_seq"] * (r["dec_b"].sum() + r["mix_rows"].sum())
            + len(r["mix_tokens"]) * f["mixed_s"] + f["mixed_s_per_token"] * r["mix_tokens"].sum())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", nargs="?", default="lab/results/serving/budget_curve_h200.json")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    res = json.load(open(a.result))
    st = res["settings"]
    base = BenchSettings(**{k: st[k] for k in ("requests", "prompt_min", "prompt_max", "output_min", "output_max", "seed",
                                                "page_size", "max_num_seqs", "max_num_batched_tokens", "watermark")})
    job = make_job(base, vocab=100)
    bpt = {m: v["page_bytes_all_layers"] for m, v in res["methods"].items()}
    per_method: dict[str, list] = {}
    mismatches = []
    for run in representative_runs(res["runs"]):  # a result with repeats: one repeat per budget
        r = replay(job, run["pages"], base)
        for k in ("steps", "decode_steps", "preemptions", "recomputed_tokens", "output_tokens"):
            if r[k] != run[k]:
                mismatches.append(f"{run['method']} {run['budget_gib']} GiB {k}: replay {r[k]}, measured {run[k]}")
        per_method.setdefault(run["method"], []).append((r, run))
    replayed = sum(len(v) for v in per_method.values())
    print(f"replay of {replayed} measured runs: " + ("identical counters" if not mismatches else f"{len(mismatches)} differences"))
    for m in mismatches[:10]:
        print("  " + m)
    model = {m: fit(v) for m, v in per_method.items()}
    for m, f in model.items():
        print(f"{m:>10}: decode step {1e3 * f['decode_s']:.2f} ms + {1e3 * f['decode_s_per_seq']:.3f} ms/seq; "
              f"prefill step {1e3 * f['mixed_s']:.1f} ms + {1e6 * f['mixed_s_per_token']:.2f} us/token")
    print("\nreproduction of the measured ratios:")
    print(f"{'budget':>8} {'method':>10} {'measured':>9} {'model':>7}")
    repro = []
    for (r, run) in [x for v in per_method.values() for x in v]:
        if run["method"] == "bf16":
            continue
        rb, mb = next((rr, mm) for rr, mm in per_method["bf16"] if mm["budget_gib"] == run["budget_gib"])
        mod = wall(rb, model["bf16"]) / wall(r, model[run["method"]])
        repro.append({"budget_gib": run["budget_gib"], "method": run["method"], "measured": run["ratio_to_bf16"], "model": round(mod, 3)})
        print(f"{run['budget_gib']:>7g}G {run['method']:>10} {run['ratio_to_bf16']:>8.2f}x {mod:>6.2f}x")

    # other jobs: (prompt range, output range) x budgets, 64 requests each
    shapes = [((1024, 2048), (256, 384)), ((1024, 2048), (768, 1024)), ((1024, 2048), (1536, 2048)),
              ((256, 512), (256, 384)), ((3072, 4096), (256, 384)), ((128, 256), (1024, 2048))]
    proj = []
    print("\nprojected whole-job ratios vs BF16 (INT4/INT4, INT2/INT4); budget in units of the longest request's BF16 pages")
    for (pl, ol) in shapes:
        s = BenchSettings(**{**base.__dict__, "prompt_min": pl[0], "prompt_max": pl[1], "output_min": ol[0], "output_max": ol[1]})
        jb = make_job(s, vocab=100)
        longest = max(len(r.prompt) + r.params.max_new_tokens for r in jb)
        row = {"prompt": pl, "output": ol, "points": []}
        for mult in (1.05, 1.4, 2, 4, 8):
            budget = mult * -(-longest // s.page_size) * bpt["bf16"]
            walls = {}
            for m in model:
                pages = int(budget // bpt[m])
                walls[m] = wall(replay(jb, pages, s), model[m])
            pt = {"bf16_longest_multiple": mult, "budget_gib": round(budget / GIB, 4),
                  **{m: round(walls["bf16"] / walls[m], 3) for m in model if m != "bf16"}}
            row["points"].append(pt)
        proj.append(row)
        print(f"  prompts U{list(pl)}, outputs U{list(ol)}: " + "  ".join(
            f"{pt['bf16_longest_multiple']}x: {pt.get('int4/int4', 0):.2f}/{pt.get('int2/int4', 0):.2f}" for pt in row["points"]))
    if a.out:
        out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join(["python3"] + sys.argv), "source": a.result, "source_commit": res.get("commit"),
               "source_device": res.get("device"), "replay_mismatches": mismatches, "step_model": model,
               "reproduction": repro, "projections": proj,
               "note": "projection from a step-time model fitted on the source's measured runs; not a measurement"}
        save(out, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
