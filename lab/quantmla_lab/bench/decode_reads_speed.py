"""How long ``decode_logits`` takes to read a cache as decode steps read it: forwards over expanded keys at several
score budgets (``max_scores``, queries × keys of a forward per sequence and head) beside a forward a token, for the
caches whose reading needs them (a full-precision window, RoPE keys per channel over blocks).

    python -m quantmla_lab.bench.decode_reads_speed models/qmla-ref-deepseek-v3 --rows INT4/INT4:kivi:64/32 \\
        INT4/INT4:quantmla-rope-channel:64/32 INT4/INT4:rtn:64/32 --windows 0 64 --blocks 32 --seq-lens 512 4096 \\
        --max-scores 15 17 19 --out lab/results/eval/decode_reads_speed_budgets_cpu.json

Held-out code chunks of each length, ``--batch`` sequences a call; every time is the median of ``--reps`` calls, each
from a fresh cache (the cache is built outside the clock). ``--steps`` also times a forward a token and records the
largest difference of its logits from the expanded reading's. A row whose cache is not read over expanded keys
(rtn without a window) is skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from quantmla.corpus import datasets as DS
from quantmla.corpus.chunks import token_chunks
from quantmla.evaluation.configs import named_config
from quantmla.evaluation.decode_reads import decode_logits, reads_expanded, score_budget
from quantmla.evaluation.harness import RowSpec
from quantmla.model.load import load_model
from quantmla_lab.bench.common import cache_row, parse_fresh, record, save

METHODS = ("rtn", "kivi", "quantmla-rope-channel")  # rows whose cache needs nothing fused into the weights


def _seconds(run, reps: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """Median wall seconds of ``run()`` over ``reps`` calls (synchronized on a GPU) and the last call's result."""
    times, out = [], None
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--rows", nargs="+", required=True, metavar="CONFIG:METHOD:C/R")
    p.add_argument("--windows", type=int, nargs="+", default=[0, 64])
    p.add_argument("--blocks", type=int, nargs="+", default=[32], help="KIVI blocks and RoPE-channel pages, tokens")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512])
    p.add_argument("--batch", type=int, default=1, help="sequences a call")
    p.add_argument("--max-scores", type=int, nargs="+", default=None, metavar="LOG2",
                   help="score budgets as powers of two (default: the library's, score_budget)")
    p.add_argument("--steps", action="store_true", help="also time a forward a token")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--kind", default="code")
    p.add_argument("--out", default=None)
    args = parse_fresh(p)
    rows = [cache_row(r, METHODS) for r in args.rows]
    device = torch.device(args.device)
    budgets = [1 << b for b in args.max_scores] if args.max_scores else [None]
    model, tok = load_model(args.model, device=args.device)
    texts = DS.load_texts(args.kind)
    data = {n: token_chunks(tok, texts, n, args.batch).to(device) for n in args.seq_lens}
    short = [n for n, ids in data.items() if ids.shape[0] < args.batch]
    if short:
        raise SystemExit(f"held-out {args.kind} text gives fewer than {args.batch} chunks of {short} tokens")
    out = record(model=os.path.basename(os.path.normpath(args.model)), kind=args.kind, batch=args.batch,
                 threads=torch.get_num_threads(), reps=args.reps, runs=[])
    for config, method, c, r in rows:
        for window in args.windows:
            for block in args.blocks:
                spec = RowSpec(named_config(config, c, r), method, kivi_block=block, fp_window=window,
                               rope_page=block)
                make = spec.cache_factory()
                if not reads_expanded(make(model), model):
                    print(f"{config} {method} window {window}: one forward reads this cache as decode steps do; "
                          "skipped")
                    continue
                for n, ids in data.items():
                    run = {"config": config, "method": method, "groups": f"{c}/{r}", "window": window,
                           "block": block, "seq_len": n, "expanded": []}
                    logits = None
                    for budget in (b or score_budget(n, device.type == "cuda") for b in budgets):
                        caches = iter([make(model) for _ in range(args.reps)])
                        s, logits = _seconds(lambda: decode_logits(model, ids, next(caches), max_scores=budget),
                                             args.reps, device)
                        run["expanded"].append({"max_scores": budget, "seconds": s})
                        print(f"{config} {method} {c}/{r} window {window} block {block} T {n}: 2^"
                              f"{budget.bit_length() - 1} scores {s:.3f} s", flush=True)
                    if args.steps:
                        caches = iter([make(model) for _ in range(args.reps)])
                        s, stepped = _seconds(lambda: decode_logits(model, ids, next(caches), expanded=False),
                                              args.reps, device)
                        run["steps"] = {"seconds": s, "max_abs_logit_diff": (stepped - logits).abs().max().item()}
                        diff = run["steps"]["max_abs_logit_diff"]
                        print(f"    a forward a token {s:.3f} s, logits within {diff:.2e}", flush=True)
                    out["runs"].append(run)
    save(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
