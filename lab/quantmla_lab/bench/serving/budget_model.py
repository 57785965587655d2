"""What a serve-bench job would take at other KV budgets: the engine's scheduler replayed on the job with each
format's page count at each budget, every step priced from a measured run of that format.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.budget_model \
        --job lab/results/serving/long_1.26gib_warmup_h200.json --budgets-gib 0.8 1.0 1.26 1.6 2.0 \
        --out lab/results/serving/budget_model_long.json

A model on measured figures, not a measurement. A format's pages at a budget are the budget's bytes over a page's
bytes in every layer (``Engine.set_budget``, with the page bytes the run's engine saved), checked against the run's
own page count. Steps are priced as ``chunk_model.Prices`` prices them: a decode step at the run's
median for its batch, a line through those medians beyond the run's largest batch (counted as ``extrapolated_steps``);
a prefilling step at max(the run's host floor, k x the prefill profile's GPU cost of its tokens, causal pairs and
context read back), k fitted to the run's own prefilling seconds. Preemption by recompute is the scheduler's own, so a
budget that holds fewer requests pays their prompts again. The model leaves out what does not follow the steps: the
job-shaped warm-up and compiles. At the run's own budget it gives the run's step counts; its wall seconds there are
saved beside the measured ones, and ``--compare`` puts runs of the same job at other budgets beside the model's.
``--prefill-scale S`` asks what a prefill S times as long would give (every prefilling step's GPU time times S),
``--decode-scale METHOD=S`` what decode steps S times as long in one format would give (each of its decode steps'
seconds times S: a faster decode kernel or engine step for that format alone; decode rows that ride in prefilling
steps keep their price). With either scale, ``modelled_wall_s_at_own_budget`` is the what-if's wall, not the fit's.
The summary gives each ratio's median and range over the budgets of ``--band``, the budgets at each ``--goal``,
and the compared runs' own ratios (from one process each) at those budgets.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from quantmla_lab.bench.common import parse_fresh, record, save
from quantmla_lab.bench.serving.chunk_model import PROFILE, Prices, job_lengths, replay, step_costs
from quantmla_lab.bench.serving.throughput import rope_pages_method

GIB = 1 << 30


def page_bytes(res: dict, method: str) -> int:
    """Bytes of one page of `method`'s cache over all layers, as the run's engine counted them (``Engine.page_bytes``,
    saved by serve-bench); a run whose budget also held a RoPE stage (``-page`` methods) is refused: the model does
    not count the stage's bytes."""
    if rope_pages_method(method)[1] is not None:
        raise SystemExit(f"{method}: its budget also held a RoPE stage, which the model does not count")
    run = next(r for r in res["runs"] if r["method"] == method)
    pbytes = res["methods"][method]["page_bytes_all_layers"]
    if run["budget_bytes"] // pbytes != run["pages"]:
        raise SystemExit(f"{method}: the run's {run['budget_bytes']} bytes give {run['budget_bytes'] // pbytes} pages "
                         f"of {pbytes} bytes, the run had {run['pages']}: its budget held more than pages (a RoPE "
                         "stage?), which the model does not count")
    return pbytes


def at_budget(pr: Prices, settings: dict, budget_gib: float, pbytes: int, method: str = "") -> dict:
    """One format's modelled job at one budget (`method` names the format in the error of a budget it cannot run)."""
    pages = int(budget_gib * GIB) // pbytes
    stats: dict = {}
    try:
        steps = replay(job_lengths(settings), pages, settings["page_size"], settings["max_num_batched_tokens"],
                       settings["max_num_seqs"], settings["watermark"], stats=stats)
    except ValueError as e:
        raise SystemExit(f"--budgets-gib {budget_gib}" + (f" ({method})" if method else "") + f": {e}") from None
    mixed, decode = pr.price(steps)
    dec = [s["rows"] for s in steps if not s["tokens"]]
    return {"pages": pages, "prefilling_steps": sum(1 for s in steps if s["tokens"]), "decode_steps": len(dec),
            "mean_decode_batch": round(sum(dec) / max(1, len(dec)), 2), "peak_running": stats["peak_running"],
            "preemptions": stats["preemptions"], "recomputed_tokens": stats["recomputed_tokens"],
            "extrapolated_steps": sum(1 for r in dec if r > pr.measured_batches),
            "mixed_s": round(mixed, 3), "decode_s": round(decode, 3), "wall_s": round(mixed + decode, 3)}


KEYS = ("pages", "decode_steps", "preemptions", "peak_running", "wall_s", "mixed_s")
JOB = ("seed", "requests", "prompt_min", "prompt_max", "output_min", "output_max", "page_size",
       "max_num_batched_tokens", "max_num_seqs", "watermark", "content_group", "rope_group", "preset", "model_path")


def compare(out: dict, path: str, source: dict) -> None:
    """Put the measured figures of the serve-bench result at `path` beside the model's (``out["budgets"][b][m]
    ["measured"]``), after checking that it ran the same job on the same model and formats as `source` (the result
    the model comes from) and that each run had the model's pages."""
    with open(path) as f:
        res = json.load(f)
    diff = [k for k in JOB if res["settings"].get(k) != source["settings"].get(k)]
    diff += ["model"] if res["model"] != source["model"] else []
    if diff:
        raise SystemExit(f"{path} ran another job than the model's source ({', '.join(diff)} differ)")
    budgets = {float(b): b for b in out["budgets"]}
    for run in res["runs"]:
        if float(run["budget_gib"]) not in budgets:
            raise SystemExit(f"{path} ran {run['budget_gib']} GiB, which is not among the modelled budgets")
        row = out["budgets"][budgets[float(run["budget_gib"])]].get(run["method"])
        if row is None:  # a method the model leaves out
            continue
        if run["pages"] != row["pages"]:
            raise SystemExit(f"{path}: {run['method']} at {run['budget_gib']} GiB had {run['pages']} pages, the "
                             f"model {row['pages']}")
        got = {k: run[k] for k in KEYS}
        got["prefilling_steps"] = run["steps"] - run["decode_steps"]
        got["decode_s"] = round(run["graph_decode_s"] + run["eager_decode_s"], 3)
        row.setdefault("measured", []).append({"source": path, "commit": res.get("commit"), **got})


def measured_ratios(row: dict, methods: list[str]) -> None:
    """Each compared result's own ratios at this budget (``row["measured_x_bf16"][source][method]``): its runs of the
    base and of the method, from one process."""
    for base in ("bf16", "fp8"):
        by_source: dict = {}
        for m in methods:
            for meas in row.get(m, {}).get("measured", []):
                by_source.setdefault(meas["source"], {})[m] = meas["wall_s"]
        got = {src: {m: round(walls[base] / w, 4) for m, w in walls.items() if m != base}
               for src, walls in by_source.items() if base in walls and len(walls) > 1}
        if got:
            row[f"measured_x_{base}"] = got


def summary(out: dict, band: list[float] | None, goals: dict) -> dict:
    """Median, range and (where a goal is given) the count of budgets at it, of every modelled ratio over the
    budgets in `band`; beside them the measured ratios at those budgets (one a budget: their median over sources, the
    lower middle one of an even count, as serve-bench's medians, so each is one run's ratio)."""
    budgets = [b for b in out["budgets"] if band is None or band[0] <= float(b) <= band[1]]
    res = {"band_gib": [float(budgets[0]), float(budgets[-1])] if budgets else None, "ratios": {}}
    for base in ("bf16", "fp8"):
        names = {m for b in budgets for m in out["budgets"][b].get(f"x_{base}", {})}
        for m in sorted(names):
            xs = [out["budgets"][b][f"x_{base}"][m] for b in budgets if m in out["budgets"][b].get(f"x_{base}", {})]
            v = {"median": float(np.median(xs)), "min": min(xs), "max": max(xs), "budgets": len(xs)}
            if (m, base) in goals:
                v["goal"] = goals[(m, base)]
                v["at_goal"] = sum(x >= v["goal"] for x in xs)
            meas = {b: statistics.median_low([r[m] for r in out["budgets"][b][f"measured_x_{base}"].values() if m in r])
                    for b in budgets if any(m in r for r in out["budgets"][b].get(f"measured_x_{base}", {}).values())}
            if meas:
                v["measured"] = {b: round(x, 4) for b, x in meas.items()}
            res["ratios"][f"{m} over {base}"] = v
    return res


def parse_decode_scale(items: list[str], methods: list[str]) -> dict:
    """``METHOD=S`` items -> {method: S}, refusing a method the job does not model and factors that are not
    positive."""
    out = {}
    for item in items:
        m, _, x = item.rpartition("=")
        try:
            s = float(x)
        except ValueError:
            s = None
        if not m or s is None or not s > 0:
            raise SystemExit(f"--decode-scale {item!r}: write METHOD=S with S > 0, e.g. int4/int4=0.9")
        if m not in methods:
            raise SystemExit(f"--decode-scale {item!r}: {m} is not among the modelled methods ({', '.join(methods)})")
        out[m] = s
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default="lab/results/serving/long_1.26gib_warmup_h200.json",
                   help="a serve-bench result with step logs (one budget)")
    p.add_argument("--methods", nargs="+", default=None, help="default: every method of the result with a step log")
    p.add_argument("--budgets-gib", nargs="+", type=float, required=True)
    p.add_argument("--profile", default=PROFILE, help="a prefill profile (step_profile --phase prefill)")
    p.add_argument("--prefill-scale", type=float, default=1.0, metavar="S",
                   help="a what-if: every prefilling step's GPU time times S (its host floor unchanged), as a prefill "
                        "S times as long would give")
    p.add_argument("--decode-scale", nargs="*", default=[], metavar="METHOD=S",
                   help="a what-if: every decode step of METHOD S times as long (e.g. int4/int4=0.9)")
    p.add_argument("--band", nargs=2, type=float, default=None, metavar=("LO", "HI"),
                   help="the summary's budgets: those from LO to HI GiB (default: all)")
    p.add_argument("--goal", nargs="*", default=[], metavar="METHOD:BASE=X",
                   help="count the summary's budgets where METHOD runs at least X times BASE (e.g. int4/int4:fp8=1.8)")
    p.add_argument("--compare", nargs="*", default=[], metavar="RESULT",
                   help="serve-bench results of the same job at other budgets: their measured steps, preemptions and "
                        "seconds are saved beside the model's at the same budget (which must be among --budgets-gib)")
    p.add_argument("--out", default=None)
    a = parse_fresh(p) if argv is None else p.parse_args(argv)
    with open(a.job) as f:
        res = json.load(f)
    settings, geometry = res["settings"], res["model"]
    if len(settings["budgets_gib"]) != 1:
        raise SystemExit(f"{a.job} ran budgets {settings['budgets_gib']}; give a result of one budget")
    runs = {r["method"]: r for r in res["runs"] if "step_log" in r}
    methods = a.methods or list(runs)
    missing = [m for m in methods if m not in runs]
    if missing:
        raise SystemExit(f"{a.job} has no run with a step log for {', '.join(missing)}; it has "
                         f"{', '.join(r['method'] for r in res['runs'])}")
    decode_scale = parse_decode_scale(a.decode_scale, methods)
    with open(a.profile) as f:
        profile = json.load(f)
    out = record(source=a.job, source_commit=res.get("commit"), profile=a.profile, profile_commit=profile.get("commit"),
                 note="a model on measured figures, not a measurement", prefill_scale=a.prefill_scale,
                 decode_scale=decode_scale, methods={}, budgets={})
    for m in methods:
        pbytes = page_bytes(res, m)
        pr = Prices(runs[m], settings, step_costs(profile, m, geometry))
        pr.k *= a.prefill_scale
        if m in decode_scale:
            pr.dec = lambda rows, dec=pr.dec, s=decode_scale[m]: s * dec(rows)
        out["methods"][m] = {"k": pr.k, "host_floor_ms": 1e3 * pr.host, "page_bytes": pbytes,
                             "measured_batches": pr.measured_batches, "measured_wall_s": runs[m]["wall_s"],
                             "modelled_wall_s_at_own_budget": round(sum(pr.price(pr.own)), 3)}
        for b in a.budgets_gib:
            out["budgets"].setdefault(str(b), {})[m] = at_budget(pr, settings, b, pbytes, m)
    for path in a.compare:
        compare(out, path, res)
    goals = {}
    for g in a.goal:
        try:
            pair, x = g.split("=")
            m, base = pair.rsplit(":", 1)
            goals[(m, base)] = float(x)
        except ValueError:
            raise SystemExit(f"--goal {g!r}: write METHOD:BASE=X, e.g. int4/int4:fp8=1.8") from None
    for b, row in out["budgets"].items():
        for base in ("bf16", "fp8"):
            if base in row:
                row[f"x_{base}"] = {m: round(row[base]["wall_s"] / v["wall_s"], 4) for m, v in row.items()
                                    if m in methods and m != base}
        for m, v in row.items():
            for meas in v.get("measured", []) if m in methods else []:
                print(f"{float(b):6.3f} GiB  {m}: measured {meas['wall_s']:.2f} s, {meas['decode_steps']} decode steps "
                      f"(model {v['wall_s']:.2f} s, {v['decode_steps']}; {meas['source']})")
        print(f"{float(b):6.3f} GiB  " + "  ".join(
            f"{m} {v['wall_s']:7.2f} s (holds {v['peak_running']:2d}, steps {v['decode_steps']})"
            for m, v in row.items() if m in methods))
        for base in ("bf16", "fp8"):
            if f"x_{base}" in row:
                print(f"{'':12s}over {base}: " + "  ".join(f"{m} {x:.3f}" for m, x in row[f"x_{base}"].items()))
        measured_ratios(row, methods)
    out["summary"] = summary(out, a.band, goals)
    for name, v in out["summary"]["ratios"].items():
        print(f"{name}: median {v['median']:.3f} ({v['min']:.3f} to {v['max']:.3f}) over {v['budgets']} budgets"
              + (f", at least {v['goal']} at {v['at_goal']} of them" if "goal" in v else "")
              + (f"; measured {v['measured']}" if "measured" in v else ""))
    save(out, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
