"""The demo's report: report.md (the accuracy table and the error analysis, headings nested under
the report's own) and two figures, accuracy against cache bytes and cache compression per format.

Figures are PNGs (matplotlib, Agg backend) sized to be read at 100 % zoom: every series in a
legend, no label drawn over another.
"""

from __future__ import annotations

import os
import re

METHOD_STYLE = {  # method -> (label, colour, marker)
    "bf16": ("BF16", "black", "*"),
    "rtn": ("RTN", "tab:gray", "o"),
    "kivi": ("KIVI-style", "tab:orange", "s"),
    "hadamard": ("Hadamard", "tab:green", "^"),
    "quantmla-content": ("QuantMLA, content path only", "tab:cyan", "v"),
    "quantmla-rope": ("QuantMLA, RoPE path only", "tab:purple", "<"),
    "quantmla": ("QuantMLA", "tab:red", "D"),
    "quantmla-content-rope-channel": ("QuantMLA content + RoPE per channel per page", "tab:olive", ">"),
    "quantmla-rope-channel-pagefit": ("QuantMLA (RoPE fitted per page), RoPE per channel per page", "tab:pink", "X"),
    "quantmla-rope-channel": ("QuantMLA, RoPE per channel per page", "tab:brown", "P"),
}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def accuracy_plot(rows: list[dict], out: str) -> str:
    """<out>/accuracy_vs_bytes.png: Δ bits per byte against BF16 (%) per cache format, formats ordered by
    bytes per token per layer (one column each, labelled with its bytes), one colour and marker per
    method side by side within a column; returns its path. `rows`: table rows of one model (rows with no
    BF16 row to compare with are left out)."""
    plt = _plt()
    from matplotlib.ticker import FuncFormatter

    from quantmla.evaluation.table import relative

    rows = [r for r in relative([dict(r) for r in rows]) if r["method"] != "bf16" and r.get("bpb_increase_pct") is not None]
    methods = [m for m in METHOD_STYLE if any(r["method"] == m for r in rows)]
    cols = sorted({(r["bytes_per_token"], r["config"]) for r in rows}, key=lambda c: (c[0], c[1]))
    fig, ax = plt.subplots(figsize=(max(6.5, 1.1 * len(cols) + 4.0), 4.2), dpi=100)
    step = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        label, colour, marker = METHOD_STYLE[m]
        pts = [(i + (j - (len(methods) - 1) / 2) * step, r["bpb_increase_pct"])
               for i, c in enumerate(cols) for r in rows if r["method"] == m and (r["bytes_per_token"], r["config"]) == c]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, s=45, color=colour, label=label, zorder=3)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+g}" if v else "0"))
    ax.set_xticks(range(len(cols)), [f"{cfg}\n{b:g} B" for b, cfg in cols], fontsize=8)
    ax.set_xlim(-0.6, len(cols) - 0.4)
    for i in range(1, len(cols)):
        ax.axvline(i - 0.5, color="0.85", lw=0.8)
    ax.set_xlabel("cache format and bytes per token per layer\n(codes + scales + zero points; fewest bytes first)", fontsize=9)
    ax.set_ylabel("Δ held-out bits per byte vs BF16 (%)")
    bf16 = [r for r in rows if r.get("bf16_bytes_per_token")]
    ref = f" (BF16: {bf16[0]['bf16_bytes_per_token']:g} B, Δ = 0)" if bf16 else ""
    ax.set_title(f"Δ bits per byte per cache format{ref}\nlower is better", fontsize=10)
    vals = [r["bpb_increase_pct"] for r in rows] or [1.0]
    ax.set_ylim(min(vals) * 1.5 if min(vals) < 0 else -0.3, max(vals) * 1.6 if max(vals) > 0 else 1.0)
    ticks = [t for t in (-10, -5, -2, -1, -0.5, 0, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500) if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
    ax.set_yticks(ticks)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # outside: covers no point
    fig.tight_layout()
    path = os.path.join(out, "accuracy_vs_bytes.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def compression_plot(d_c: int, d_r: int, out: str, tokens: int = 131072) -> str:
    """<out>/compression.png: BF16 bytes over quantized bytes of a paged cache holding `tokens` tokens,
    per format, for this model's geometry (d_c, d_r) and DeepSeek-V3's (512, 64); returns its path.
    (Pages of 64 tokens: the ratio is the same at every context length to within 0.1 %.)"""
    plt = _plt()
    from quantmla.cache.layout import CacheFormat, compression
    from quantmla.quant import PathFormat

    geoms = [(d_c, d_r)] + ([(512, 64)] if (d_c, d_r) != (512, 64) else [])
    formats = [((4, 4), (128, 64)), ((4, 4), (64, 32)), ((2, 4), (128, 64)), ((2, 4), (64, 32))]
    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=100)
    width = 0.8 / len(geoms)
    for g, ((dc, dr), colour) in enumerate(zip(geoms, ("tab:blue", "tab:gray"))):
        vals = []
        for bits, (gc, gr) in formats:
            fmt = CacheFormat(PathFormat(bits[0], min(gc, dc)), PathFormat(bits[1], min(gr, dr)))
            vals.append(compression(dc, dr, fmt, tokens))
        xs = [i + (g - (len(geoms) - 1) / 2) * width for i in range(len(formats))]
        label = f"d_c {dc}, d_r {dr}" + (" (this model)" if g == 0 else " (DeepSeek-V2/V3)")
        bars = ax.bar(xs, vals, width * 0.95, color=colour, label=label)
        ax.bar_label(bars, [f"{v:.2f}×" for v in vals], fontsize=8, padding=2)
    ax.set_xticks(range(len(formats)), [f"INT{b[0]}/INT{b[1]}\ngroups {gc}/{gr}" for b, (gc, gr) in formats], fontsize=8)
    ax.set_ylabel("BF16 bytes / quantized bytes")
    ax.set_title(f"cache compression at {tokens // 1024}K tokens (pages of 64 tokens; groups capped at the path's width)",
                 fontsize=9)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = os.path.join(out, "compression.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def nest(markdown: str, level: int = 2) -> str:
    """A Markdown document placed under a heading of `level`: its title line (a first `# ` heading) is
    dropped and every other heading moves down so that its top level becomes `level` + 1."""
    lines = markdown.strip("\n").splitlines()
    if lines and re.match(r"# \S", lines[0]):
        lines = lines[1:]
    out = []
    for line in lines:
        m = re.match(r"(#+) (.*)", line)
        out.append(f"{'#' * min(6, len(m.group(1)) + level - 1)} {m.group(2)}" if m else line)
    return "\n".join(out).strip("\n")


def report_markdown(name: str, header: str, table_md: str, analysis_md: str | None, plots: list[str], out: str,
                    seconds: float) -> str:
    """report.md: a title, `header` (model and evaluation mode), the accuracy table, the error analysis
    and the plots, each document's headings nested under the report's sections."""
    lines = [f"# QuantMLA report: {name}", "", header, "", "## Accuracy", "", nest(table_md), ""]
    if analysis_md:
        lines += ["## Dual-path error model", "", nest(analysis_md), ""]
    lines += ["## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.relpath(p, out)})" for p in plots]
    lines += ["", f"Wall time: {seconds:.0f} s."]
    return "\n".join(lines) + "\n"
