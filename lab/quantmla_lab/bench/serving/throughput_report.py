"""A serve-bench result: ratios to the baselines, medians over repeats, the summary, the table and the figure
(whole-job throughput and its ratio to BF16 over the KV budgets)."""

from __future__ import annotations

import json
import os
import statistics

from quantmla.errors import QuantMLAError

PAPER_RATIO = 5.168  # the paper's whole-job throughput over BF16 under cache pressure


def load_result(path: str) -> dict:
    """A serve-bench result JSON, or a clear error naming what is wrong with the file."""
    try:
        with open(path) as f:
            res = json.load(f)
    except FileNotFoundError:
        raise QuantMLAError(f"{path}: no such file; give the JSON a serve-bench run saved (--out)") from None
    except json.JSONDecodeError as e:
        raise QuantMLAError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(res, dict) or not res.get("runs"):
        raise QuantMLAError(f"{path}: not a serve-bench result with runs (a --check-only file has none)")
    if res.get("partial"):
        raise QuantMLAError(f"{path}: the saved state of a run that did not finish (\"partial\": true); draw a "
                            "finished result")
    return res


def complete(run: dict) -> bool:
    """Whether a run passed its check: every request completed once with all its tokens (runs saved before the
    check existed pass)."""
    return run.get("all_complete_and_unique", True)


def add_ratios(runs: list[dict]) -> None:
    """Each run's ``ratio_to_bf16`` and ``ratio_to_fp8``: its tokens/s over the baseline's at the same budget and
    repeat (None where that baseline did not run, or where either run failed its completion check)."""
    for base in ("bf16", "fp8"):
        ref = {(r["budget_gib"], r.get("repeat", 0)): r["tokens_per_s"] for r in runs if r["method"] == base
               and complete(r)}
        for r in runs:
            t = ref.get((r["budget_gib"], r.get("repeat", 0))) if complete(r) else None
            r[f"ratio_to_{base}"] = round(r["tokens_per_s"] / t, 3) if t else None


def representative_runs(runs: list[dict]) -> list[dict]:
    """The runs of one repeat per budget, in the order they came: the repeat whose wall time summed over its methods
    is the median (the lower middle one of an even count), among the repeats in which every method of that budget ran
    where there are such. One repeat's runs pair as the summary's ratios do; a result of one repeat is returned as it
    is. Tools that model one run of each method (ratio_bounds, prefill_padding, breakdown, projection) read these."""
    by_budget: dict[float, dict[int, list[dict]]] = {}
    for r in runs:
        by_budget.setdefault(r["budget_gib"], {}).setdefault(r.get("repeat", 0), []).append(r)
    keep: set[tuple[float, int]] = set()
    for b, reps in by_budget.items():
        methods = {r["method"] for rs in reps.values() for r in rs}
        whole = {k: rs for k, rs in reps.items() if {r["method"] for r in rs} == methods} or reps
        order = sorted(whole, key=lambda k: (sum(r["wall_s"] for r in whole[k]), k))
        keep.add((b, order[(len(order) - 1) // 2]))
    return [r for r in runs if (r["budget_gib"], r.get("repeat", 0)) in keep]


def _median_ratios(runs: list[dict], m: str, key: str) -> dict:
    """budget -> the median (the lower middle one of an even count) over repeats of method m's paired ratio `key`,
    None where it has none."""
    out: dict = {}
    for b in sorted({r["budget_gib"] for r in runs if r["method"] == m}):
        v = [r[key] for r in runs if r["method"] == m and r["budget_gib"] == b and r.get(key) is not None]
        out[b] = statistics.median_low(v) if v else None
    return out


def summarize(result: dict) -> dict:
    """Ratios by budget (with repeats: the median of the repeats' paired ratios, the lower middle one of an even
    count, so that every figure is one repeat's), median tokens/s likewise, the runs each method has at each budget
    (a time limit can cut a repeat short), and where the gain over BF16 starts. A run that failed its completion check
    counts in none of them (``failed_runs`` names it)."""
    out_failed = [{"method": r["method"], "budget_gib": r["budget_gib"], "repeat": r.get("repeat", 0)}
                  for r in result["runs"] if not complete(r)]
    runs = [r for r in result["runs"] if complete(r)]
    budgets = sorted({r["budget_gib"] for r in runs})
    methods = list(dict.fromkeys(r["method"] for r in runs))
    out = {"pressured_budget_gib": budgets[0] if budgets else None, "ratio_by_budget": {}, "failed_runs": out_failed}

    def of(m, b):
        return [r["tokens_per_s"] for r in runs if r["method"] == m and r["budget_gib"] == b]

    out["runs_per_method"] = {m: {b: len(of(m, b)) for b in budgets if of(m, b)} for m in methods}
    out["median_tokens_per_s"] = {m: {b: statistics.median_low(of(m, b)) for b in budgets if of(m, b)} for m in methods}
    if "fp8" in methods:
        out["ratio_to_fp8_by_budget"] = {m: _median_ratios(runs, m, "ratio_to_fp8") for m in methods
                                         if m not in ("bf16", "fp8")}
    for m in {r["method"] for r in runs} - {"bf16"}:
        curve = _median_ratios(runs, m, "ratio_to_bf16")
        out["ratio_by_budget"][m] = curve
        gains = [b for b in budgets if curve.get(b) is not None and curve[b] >= 1.1]
        # the gain "starts" at the largest budget from which every smaller budget also gains >= 10 %
        start = None
        for b in budgets:
            if curve.get(b) is not None and curve[b] >= 1.1:
                start = b
            else:
                break
        out.setdefault("gain_starts_at_gib", {})[m] = start
        out.setdefault("budgets_with_gain", {})[m] = gains
    return out


def format_table(result: dict) -> str:
    """One line a run: budget, method, repeat, tok/s, ratios to BF16 and FP8, wall s, peak batch, preemptions."""
    fmt = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
    lines = [f"{'budget':>8} {'method':>10} {'rep':>3} {'tok/s':>10} {'x BF16':>7} {'x FP8':>6} {'wall s':>8} {'peak':>5} "
             f"{'preempt':>7} {'out tok':>8}"]
    for r in result["runs"]:
        lines.append(f"{r['budget_gib']:>6g}Gi {r['method']:>10} {r.get('repeat', 0):>3} {r['tokens_per_s']:>10.1f} "
                     f"{fmt(r.get('ratio_to_bf16')):>7} {fmt(r.get('ratio_to_fp8')):>6} {r['wall_s']:>8.2f} "
                     f"{r['peak_batch']:>5} {r['preemptions']:>7} {r['output_tokens']:>8}")
    return "\n".join(lines)


def plot_curve(result: dict, path: str) -> str:
    """Write a two-panel PNG (tokens/s per method; ratio to BF16 per method) over the budgets -> path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r.get("tokens_per_s")]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    summary = summarize({"runs": runs})  # medians over repeats
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=110)
    for i, m in enumerate(methods):
        tps = sorted(summary["median_tokens_per_s"][m].items())
        ax.plot([b for b, _ in tps], [t for _, t in tps], marker="o", ms=4, color=f"C{i}", label=m)
        ratios = sorted(summary["ratio_by_budget"].get(m, {}).items())
        if m != "bf16" and ratios and all(v for _, v in ratios):
            bx.plot([b for b, _ in ratios], [v for _, v in ratios], marker="o", ms=4, color=f"C{i}", label=m)
    bx.axhline(PAPER_RATIO, color="gray", ls="--", lw=1, label=f"paper ({PAPER_RATIO}x)")
    bx.axhline(1.0, color="black", lw=0.5)
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_xlabel("KV budget (GiB, all layers)")
        a.legend(fontsize=7)
    ax.set_ylabel("whole-job output tokens / s")
    bx.set_ylabel("throughput / BF16's")
    st = result.get("settings", {})
    fig.suptitle(f"{result.get('device', '?')}, {result.get('date', '')[:10]}: {st.get('requests', '?')} requests, prompts "
                 f"U[{st.get('prompt_min')}, {st.get('prompt_max')}], outputs U[{st.get('output_min')}, {st.get('output_max')}] "
                 f"(commit {result.get('commit', '?')})", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
