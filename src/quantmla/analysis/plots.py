"""PNG figures of an analysis result (matplotlib, Agg backend; small files)."""

from __future__ import annotations

import os

DPI = 72


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_all(result: dict, out_dir: str, title: str = "") -> list[str]:
    """Write distortion.png, split.png, pairs.png, first_order.png; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    return [f(result, out_dir, title) for f in (plot_distortion, plot_split, plot_pairs, plot_first_order)]


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _plt().close(fig)
    return path


def plot_distortion(result: dict, out_dir: str, title: str = "") -> str:
    """(a) attention-output distortion vs bits, content-only vs RoPE-only, one line per layer;
    (b) RoPE amplification factor per layer and bit width."""
    plt = _plt()
    layers = result["layers"]
    bits = [str(b) for b in result["settings"]["bits"]]
    xb = [int(b) for b in bits]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    for path, color in (("content", "tab:blue"), ("rope", "tab:red"), ("both", "0.4")):
        for i, L in enumerate(layers):
            ys = [L["runs"][path][k]["distortion"] for k in bits]
            lab = {"content": "content only", "rope": "RoPE only", "both": "both"}[path] if i == 0 else None
            a.plot(xb, ys, marker="o", color=color, alpha=0.35 if len(layers) > 1 else 1, ms=3, lw=1,
                   ls="--" if path == "both" else "-", label=lab)
    a.set_yscale("log")
    a.set_xlabel("bits (both paths at equal bits)")
    a.set_ylabel("rel. attention-output distortion")
    a.set_xticks(xb)
    a.legend(fontsize=7)
    a.set_title("per layer, after o_proj", fontsize=9)
    n = len(bits)
    w = 0.8 / n
    for j, k in enumerate(bits):
        ys = [L["rope_amplification"][k] for L in layers]
        b.bar([i + j * w for i in range(len(layers))], ys, w, label=f"{k} bits")
    b.axhline(1.0, color="k", lw=0.8)
    b.set_yscale("log")
    b.set_xticks([i + 0.4 - w / 2 for i in range(len(layers))], [str(L["layer"]) for L in layers], fontsize=7)
    b.set_xlabel("layer")
    b.set_ylabel("RoPE amplification")
    b.set_title("sensitivity(RoPE) / sensitivity(content)", fontsize=9)
    b.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, os.path.join(out_dir, "distortion.png"))


def plot_split(result: dict, out_dir: str, title: str = "") -> str:
    """Matching vs aggregation (exact) per layer, content-only and RoPE-only, at each bit width's
    lowest two settings: squared norms relative to ‖o‖²."""
    plt = _plt()
    layers = result["layers"]
    bits = [str(b) for b in result["settings"]["bits"]]
    show = [b for b in ("4", "2") if b in bits] or bits[:1]
    fig, axes = plt.subplots(1, len(show), figsize=(4.5 * len(show), 3.2), squeeze=False)
    x = list(range(len(layers)))
    for ax, k in zip(axes[0], show):
        cm = [L["runs"]["content"][k]["matching"] ** 2 for L in layers]
        ca = [L["runs"]["content"][k]["aggregation"] ** 2 for L in layers]
        rm = [L["runs"]["rope"][k]["matching"] ** 2 for L in layers]
        ax.bar([i - 0.27 for i in x], ca, 0.27, color="tab:cyan", label="content-only: aggregation")
        ax.bar(x, cm, 0.27, color="tab:blue", label="content-only: matching")
        ax.bar([i + 0.27 for i in x], rm, 0.27, color="tab:red", label="RoPE-only: matching (only term)")
        ax.set_yscale("log")
        ax.set_xticks(x, [str(L["layer"]) for L in layers], fontsize=7)
        ax.set_xlabel("layer")
        ax.set_ylabel("‖term‖² / ‖o‖²")
        ax.set_title(f"INT{k}: exact error split", fontsize=9)
    h, lab = axes[0][0].get_legend_handles_labels()
    fig.legend(h, lab, loc="lower center", ncol=3, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(os.path.join(out_dir, "split.png"), dpi=DPI)
    _plt().close(fig)
    return os.path.join(out_dir, "split.png")


def plot_pairs(result: dict, out_dir: str, title: str = "") -> str:
    """Per-frequency-pair RMS of k_R and q^R (and the per-pair logit error at INT4), per layer."""
    plt = _plt()
    layers = result["layers"]
    n = len(layers)
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(2.6 * cols, 6), max(2.2 * rows, 3)), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, L in zip(axes.flat, layers):
        P = L["pairs"]
        j = list(range(len(P["k_rope_rms"])))
        ax.plot(j, P["k_rope_rms"], "-", color="tab:red", lw=1.2, label="k_R")
        ax.plot(j, P["q_rope_rms"], "-", color="tab:purple", lw=1.2, label="q^R")
        err_key = next(k for k in P if k.startswith("logit_err"))
        ax2 = ax.twinx()
        ax2.bar(j, P[err_key], color="0.7", alpha=0.6, width=0.8)
        ax2.tick_params(labelsize=6)
        ax.set_zorder(ax2.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.set_title(f"layer {L['layer']}", fontsize=8)
        ax.tick_params(labelsize=6)
        ax.set_xlabel("pair j (higher j: lower frequency)", fontsize=6)
        if L is layers[0]:
            ax.legend(fontsize=6, title=f"RMS; bars: {err_key.split('_')[-1].upper()} logit err", title_fontsize=6)
    if title:
        fig.suptitle(title + " — RoPE pair energies", fontsize=9)
    return _save(fig, os.path.join(out_dir, "pairs.png"))


def plot_first_order(result: dict, out_dir: str, title: str = "") -> str:
    """Exact vs first-order distortion for every (layer, path, bits): the model's validity range."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4, 3.4))
    markers = {"2": "v", "3": "s", "4": "o", "8": "^"}
    for path, color in (("content", "tab:blue"), ("rope", "tab:red"), ("both", "0.4")):
        for k in map(str, result["settings"]["bits"]):
            xs = [L["runs"][path][k]["distortion"] for L in result["layers"]]
            ys = [L["runs"][path][k]["distortion_first_order"] for L in result["layers"]]
            ax.scatter(xs, ys, s=12, color=color, marker=markers.get(k, "o"),
                       label=f"{path} INT{k}" if path != "both" else None)
    lo = min(min(L["runs"][p][k]["distortion"] for L in result["layers"] for p in ("content", "rope"))
             for k in map(str, result["settings"]["bits"]))
    hi = max(L["runs"]["both"][str(min(result["settings"]["bits"]))]["distortion"] for L in result["layers"])
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("exact ‖Δo‖/‖o‖")
    ax.set_ylabel("first-order ‖Δo¹‖/‖o‖")
    fo = result["summary"]["first_order_check"]
    ax.set_title(f"first order vs exact (INT{fo['bits']}: max rel. diff {fo['max_rel_err']:.1e})", fontsize=8)
    ax.legend(fontsize=5, ncol=2)
    return _save(fig, os.path.join(out_dir, "first_order.png"))
