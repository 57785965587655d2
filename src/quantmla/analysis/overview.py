"""Cross-model overview of analysis results: <root>/README.md from every <root>/<model>/analysis.json."""

from __future__ import annotations

import json
import os


def _load(root: str) -> list[dict]:
    out = []
    for name in sorted(os.listdir(root)):
        p = os.path.join(root, name, "analysis.json")
        if os.path.isfile(p):
            with open(p) as f:
                r = json.load(f)
            r.setdefault("model", name)
            r["_dir"] = name
            out.append(r)
    return out


TITLE = "# Dual-path error analysis: all models"


def _groups(results: list[dict]) -> str:
    """The per-token groups of the results: one pair where all share it, else "per model, in its summary.md"."""
    got = {(r["settings"].get("content_group"), r["settings"].get("rope_group")) for r in results}
    if len(got) == 1:
        c, g = next(iter(got))
        return f"content {c}, RoPE {g} channels"
    return "each model's own, in its summary.md"


def overview_markdown(results: list[dict]) -> str:
    lines = [TITLE, "",
             "Per model (geometric mean over layers): the attention-output distortion of RoPE-only over content-only "
             f"quantization at equal bits (per-token groups: {_groups(results)}), the RoPE amplification "
             "(distortion per unit of relative cache error, RoPE over content), the same ratio already present in the "
             "RMS logit error, and how many layers the RoPE path hurts more. Definitions: each model's analysis.json "
             "(`definitions`); per-layer figures and plots: each model's summary.md and PNGs.", "",
             "| model | bits | content-only | RoPE-only | RoPE/content | amplification | in logits | layers RoPE worse | "
             "first-order rel. err |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        L = r["layers"]
        for b in map(str, r["settings"]["bits"]):
            s = r["summary"]["by_bits"][b]
            c = sum(x["runs"]["content"][b]["distortion"] for x in L) / len(L)
            ro = sum(x["runs"]["rope"][b]["distortion"] for x in L) / len(L)
            lines.append(f"| [{r['model']}]({r['_dir']}/summary.md) | {b} | {c:.4g} | {ro:.4g} | "
                         f"{s['distortion_ratio_gmean']:.3g} | {s['rope_amplification_gmean']:.3g} | "
                         f"{s.get('rope_logit_amplification_gmean', float('nan')):.3g} | {s['layers_rope_worse']}/{len(L)} | "
                         f"{s['first_order_rel_err_max']:.2g} |")
    lines += ["", "Top RoPE-key frequency pair per layer (pair index j, higher j = lower frequency; RMS against the median "
              "pair's RMS):", ""]
    for r in results:
        cells = []
        for x in r["layers"]:
            k = x["pairs"]["k_rope_rms"]
            j = max(range(len(k)), key=lambda i: k[i])
            cells.append(f"layer {x['layer']}: j={j} ({k[j]:.2f} vs {sorted(k)[len(k) // 2]:.2f})")
        lines.append(f"- {r['model']}: " + "; ".join(cells))
    return "\n".join(lines) + "\n"


def write_overview(root: str) -> tuple[str | None, str | None]:
    """<root>/README.md from every <root>/<model>/analysis.json -> (its path, None), or (None, why not): a root
    that is the current directory, or whose README.md is not such an overview, is left alone."""
    if not root or os.path.abspath(root) == os.getcwd():
        return None, "the output's parent is the current directory, which is no analysis root"
    path = os.path.join(root, "README.md")
    if os.path.exists(path):
        with open(path) as f:
            if f.readline().rstrip("\n") != TITLE:
                return None, f"{path} is not an analysis overview; it is left as it is"
    results = _load(root)
    if not results:
        return None, "no analysis.json beside it"
    text = overview_markdown(results)  # whole before the file is opened: a failure leaves the old one as it was
    with open(path, "w") as f:
        f.write(text)
    return path, None
