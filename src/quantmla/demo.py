"""`quantmla demo`: the main job on the shipped default reference model.

1. the dual-path error model of the model (which path hurts, and why),
2. BF16, baselines (RTN, KIVI-style RoPE keys, Hadamard) and QuantMLA at INT4/INT4 and INT2/INT4:
   held-out bits per byte and retrieval accuracy, every attention read through the quantized cache,
3. a report: ``<out>/report.md`` with PNG plots (per-layer error split by path, accuracy against
   bytes per token, paged compression against context length).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def add_arguments(p):
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped default reference model)")
    p.add_argument("--out", default="out/demo", help="report directory (default out/demo)")
    p.add_argument("--quick", action="store_true", help="a smaller run (fewer chunks and samples)")
    p.add_argument("--skip-analysis", action="store_true")


def _sub(module: str, argv: list[str]):
    import importlib

    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser()
    mod.add_arguments(parser)
    args = parser.parse_args(argv)
    return mod.run(args)


def _compression_plot(d_c: int, d_r: int, out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quantmla.cache.layout import CacheFormat, compression
    from quantmla.quant import PathFormat

    ctx = [1024, 4096, 16384, 32768, 65536, 131072]
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=110)
    # the model's own geometry (solid) and DeepSeek-V3's (d_c 512, d_r 64; dashed); groups never exceed a path
    for (dc, dr), ls in [((d_c, d_r), "-"), ((512, 64), "--")]:
        if ls == "--" and (dc, dr) == (d_c, d_r):
            continue
        for bits, (gc, gr) in [((4, 4), (128, 64)), ((4, 4), (64, 32)), ((2, 4), (128, 64)), ((2, 4), (64, 32))]:
            gc, gr = min(gc, dc), min(gr, dr)
            fmt = CacheFormat(PathFormat(bits[0], gc), PathFormat(bits[1], gr))
            ax.plot(ctx, [compression(dc, dr, fmt, n) for n in ctx], marker="o", ms=3, ls=ls,
                    label=f"INT{bits[0]}/INT{bits[1]} g{gc}/g{gr}, d_c {dc} d_r {dr}")
    ax.axhline(3.59, color="gray", ls="--", lw=1, label="paper INT4/INT4 (3.59x)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("BF16 bytes / quantized bytes")
    ax.set_title("paged cache compression (pages of 64 tokens)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    path = os.path.join(out, "compression.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def _accuracy_plot(rows: list[dict], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    markers = {"bf16": "*", "rtn": "o", "kivi": "s", "hadamard": "^", "quantmla": "D"}
    for r in rows:
        ax.scatter(r["bytes_per_token"], r["bits_per_byte"], marker=markers.get(r["method"], "x"), s=40)
        ax.annotate(f"{r['config']} {r['method']}", (r["bytes_per_token"], r["bits_per_byte"]), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per token per layer (codes + scales + zeros)")
    ax.set_ylabel("held-out bits per byte (lower is better)")
    ax.set_title("accuracy against cache bytes")
    fig.tight_layout()
    path = os.path.join(out, "accuracy_vs_bytes.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def run(args) -> int:
    from quantmla.evaluation.datasets import DEFAULT_MODEL, model_path
    from quantmla.model.spec import load_spec

    t0 = time.time()
    model = args.model or str(model_path(DEFAULT_MODEL))
    name = os.path.basename(os.path.normpath(model))
    spec = load_spec(model)
    os.makedirs(args.out, exist_ok=True)
    print(f"QuantMLA demo on {name} ({spec.family}: d_c={spec.d_c}, d_r={spec.d_r}, {spec.num_heads} heads, "
          f"{len(spec.mla_layers)} MLA layers)", flush=True)

    analysis_dir = os.path.join(args.out, "analysis")
    if not args.skip_analysis:
        print("\n== 1. dual-path error model", flush=True)
        _sub("quantmla.analysis.command", [model, "--out", analysis_dir, "--num-seqs", "2", "--seq-len", "512",
                                           "--bits", "2", "3", "4"])

    print("\n== 2. accuracy: BF16, baselines and QuantMLA", flush=True)
    # sized for under 3 minutes on 2 idle CPU cores (README); `quantmla eval --all` computes the full table.
    # Retrieval prompts and QuantMLA's content fits take most of the time: the demo reads retrieval at 1K
    # only (a 2K prompt costs four times a 1K one) and fits 100 Adam steps per layer (calibrate's default: 200).
    sizes = ["--ppl-chunks", "4", "--retrieval-n", "6", "--lengths", "1024", "--calib-n", "8"] if args.quick else \
        ["--ppl-chunks", "16", "--retrieval-n", "16", "--lengths", "1024", "--calib-n", "8", "--calib-steps", "100"]
    _sub("quantmla.evaluation.command", [model, "--config", "BF16", "INT4/INT4", "INT2/INT4",
                                         "--method", "bf16", "rtn", "kivi", "hadamard", "quantmla",
                                         "--out", args.out, "--no-merge", *sizes])
    with open(os.path.join(args.out, "accuracy.json")) as f:
        rows = [r for r in json.load(f)["rows"] if r.get("model") == name]
    with open(os.path.join(args.out, "accuracy.md")) as f:
        table_md = f.read()

    print("\n== 3. report", flush=True)
    plots = [_accuracy_plot(rows, args.out), _compression_plot(spec.d_c, spec.d_r, args.out)]
    if os.path.isdir(analysis_dir):
        plots += sorted(os.path.join(analysis_dir, p) for p in os.listdir(analysis_dir) if p.endswith(".png"))
    lines = [f"# QuantMLA report: {name}", "",
             f"Model: `{model}` ({spec.family}; d_c {spec.d_c}, d_r {spec.d_r}, {spec.num_heads} heads, "
             f"{len(spec.mla_layers)} MLA layers). Every attention read, prefill included, goes through the quantized "
             "cache.", "", "## Accuracy", "", table_md, ""]
    if os.path.exists(os.path.join(analysis_dir, "summary.md")):
        with open(os.path.join(analysis_dir, "summary.md")) as f:
            lines += ["## Dual-path error model", "", f.read().replace("# Dual-path error analysis", "###"), ""]
    lines += ["## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.relpath(p, args.out)})" for p in plots]
    lines += ["", f"Wall time: {time.time() - t0:.0f} s."]
    report = os.path.join(args.out, "report.md")
    with open(report, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(table_md)
    print(f"report: {report} ({len(plots)} plots), {time.time() - t0:.0f} s")
    return 0
