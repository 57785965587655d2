"""`quantmla demo`: the main job on the shipped default reference model.

1. the dual-path error model of the model (which path hurts, and why),
2. BF16, baselines (RTN, KIVI-style RoPE keys, Hadamard) and QuantMLA (per-token groups, and with RoPE keys per
   channel per 32-token block: the KIVI-style baseline's bytes at the default groups) at INT4/INT4 and INT2/INT4:
   held-out bits per byte and retrieval accuracy, every attention read through the quantized cache,
3. a report: ``<out>/report.md`` with PNG plots (per-layer error split by path, accuracy against
   bytes per token, paged compression against context length).
"""

from __future__ import annotations

import argparse
import os
import time


def add_arguments(p):
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped default reference model)")
    p.add_argument("--out", default="out/demo", help="report directory (default out/demo)")
    p.add_argument("--quick", action="store_true", help="a smaller run (fewer chunks and samples)")
    p.add_argument("--skip-analysis", action="store_true", help="skip the per-layer error analysis step")


MARK = ".quantmla-demo"  # the file that says a directory holds the demo's own output


def claim_out(out: str) -> None:
    """Make `out` the demo's directory: new, empty, or an earlier demo's (marked, or holding a demo's report.md); one
    that holds an accuracy table or a report the demo did not write is refused (the demo replaces them), before any
    work."""
    from quantmla.errors import QuantMLAError

    report = os.path.join(out, "report.md")
    if os.path.isfile(report):  # a demo's report from before the mark: the demo's own directory
        with open(report) as f:
            if f.readline().startswith("# QuantMLA report: "):
                open(os.path.join(out, MARK), "a").close()
    if os.path.isdir(out) and not os.path.exists(os.path.join(out, MARK)):
        theirs = [f for f in ("accuracy.json", "accuracy.md", "report.md") if os.path.exists(os.path.join(out, f))]
        if theirs:
            raise QuantMLAError(f"--out {out} holds {', '.join(theirs)} that quantmla demo did not write, and the demo "
                                "replaces them: give another --out (the default is out/demo)")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, MARK), "w") as f:
        f.write("written by quantmla demo: its next run may replace what is here\n")


def _sub(module: str, argv: list[str]):
    import importlib

    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser()
    mod.add_arguments(parser)
    args = parser.parse_args(argv)
    return mod.run(args)


def run(args) -> int:
    from quantmla.corpus.datasets import DEFAULT_MODEL, model_path
    from quantmla.model.spec import load_spec

    t0 = time.time()
    model = args.model or str(model_path(DEFAULT_MODEL))
    name = os.path.basename(os.path.normpath(model))
    spec = load_spec(model)
    claim_out(args.out)
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
                                         "quantmla-rope-channel", "--rope-block", "32",
                                         "--out", args.out, "--no-merge", *sizes])
    from quantmla.evaluation import table

    rows = [r for r in table.load(args.out) if r.get("model") == name]
    with open(os.path.join(args.out, "accuracy.md")) as f:
        table_md = f.read()

    print("\n== 3. report", flush=True)
    from quantmla.evaluation.report import accuracy_plot, compression_plot, report_markdown

    plots = [accuracy_plot(rows, args.out), compression_plot(spec.d_c, spec.d_r, args.out)]
    if not args.skip_analysis:  # this run's analysis only, never one an earlier run left there
        plots += sorted(os.path.join(analysis_dir, p) for p in os.listdir(analysis_dir) if p.endswith(".png"))
    analysis_md = None
    if not args.skip_analysis:
        with open(os.path.join(analysis_dir, "summary.md")) as f:
            analysis_md = f.read()
    header = (f"Model: `{model}` ({spec.family}; d_c {spec.d_c}, d_r {spec.d_r}, {spec.num_heads} heads, "
              f"{len(spec.mla_layers)} MLA layers). Every attention read, prefill included, goes through the quantized "
              "cache.")
    text = report_markdown(name, header, table_md, analysis_md, plots, args.out, time.time() - t0)
    report = os.path.join(args.out, "report.md")
    with open(report, "w") as f:
        f.write(text)
    print(table_md)
    print(f"report: {report} ({len(plots)} plots), {time.time() - t0:.0f} s")
    return 0
