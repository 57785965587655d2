"""The serve-bench figure: whole-job throughput and its ratio to BF16 over the KV budgets."""

from __future__ import annotations

import json
import os

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
    return res


def plot_curve(result: dict, path: str) -> str:
    """Write a two-panel PNG (tokens/s per method; ratio to BF16 per method) over the budgets -> path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r.get("tokens_per_s")]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=110)
    for i, m in enumerate(methods):
        rs = sorted((r for r in runs if r["method"] == m), key=lambda r: r["budget_gib"])
        x = [r["budget_gib"] for r in rs]
        ax.plot(x, [r["tokens_per_s"] for r in rs], marker="o", ms=4, color=f"C{i}", label=m)
        if m != "bf16" and all(r.get("ratio_to_bf16") for r in rs):
            bx.plot(x, [r["ratio_to_bf16"] for r in rs], marker="o", ms=4, color=f"C{i}", label=m)
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
