"""``quantmla train-reference``: train the small MLA reference models on real text.

Stages: ``prepare`` (corpus, split, tokenizer, held-out sets), ``train`` (one family),
``all`` (prepare, then every family in parallel processes on the one device, then a table
and a JSON log). ``lab/scripts/train_reference.sh`` runs ``all`` with the shipped settings.

CPU smoke run (what CI does, seconds)::

    quantmla train-reference --size tiny --device cpu --max-steps 3 --jobs 0 \\
        --packages json,email,logging,http --vocab-size 400 --work /tmp/qm --out /tmp/qm/models
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from quantmla.errors import QuantMLAError
from quantmla_lab.training.families import FAMILIES, SIZES, model_name


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage", choices=["all", "prepare", "train"], default="all",
                   help="prepare: corpus, tokenizer, held-out sets; train: one --family; all: both, every family")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (stage all)")
    p.add_argument("--family", choices=FAMILIES, help="the family to train (stage train)")
    p.add_argument("--work", default="runs/train-reference", help="scratch directory (corpus, stream, logs)")
    p.add_argument("--out", default="models", help="where model directories and heldout/ are written")
    p.add_argument("--results", default=None, help="JSON run log to write (stage all)")
    p.add_argument("--size", choices=list(SIZES), default="ref",
                   help="model size preset (tiny: CI smoke runs; deepseek-geometry: d_c 512, d_r 64, 16 heads, "
                        "deepseek_v2 only, written as <name>-deepseek-geometry)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--jobs", type=int, default=None, help="parallel training processes; 0 = in this process")
    p.add_argument("--reuse-data", action="store_true", help="keep an existing prepared --work")
    g = p.add_argument_group("data")
    g.add_argument("--vocab-size", type=int, default=3072, help="BPE tokenizer vocabulary")
    g.add_argument("--max-train-bytes", type=float, default=400e6, help="training text kept, in bytes")
    g.add_argument("--tokenizer-bytes", type=float, default=24e6, help="training text the tokenizer is fitted on, in bytes")
    g.add_argument("--heldout-fraction", type=float, default=0.06,
                   help="fraction of packages held out of training (the evaluation sets)")
    g.add_argument("--n-retrieval", type=int, default=100, help="held-out retrieval samples per length")
    g.add_argument("--retrieval-lengths", default="1024,2048,4096", help="comma-separated retrieval lengths (tokens)")
    g.add_argument("--packages", default=None, help="restrict the corpus to these top-level packages (tests)")
    g.add_argument("--stdlib-only", action="store_true", help="corpus from the standard library only")
    g.add_argument("--tokenizer-from", default=None, metavar="DIR",
                   help="use the tokenizer.json of this directory (a shipped model's) instead of fitting one")
    g.add_argument("--heldout-from", default=None, metavar="DIR",
                   help="use this held-out set (models/heldout) instead of building one: its packages are held out "
                        "of training, and the run log says whether the training files equal its run's")
    g = p.add_argument_group("training")
    g.add_argument("--time-budget", type=float, default=400.0, help="seconds of training per model")
    g.add_argument("--max-steps", type=int, default=100_000, help="optimizer steps at most (--time-budget may stop it first)")
    g.add_argument("--batch-tokens", type=int, default=32768, help="tokens per optimizer step")
    g.add_argument("--short-len", type=int, default=1024, help="sequence length of the first (short) phase")
    g.add_argument("--long-len", type=int, default=4096, help="sequence length of the second (long) phase")
    g.add_argument("--short-frac", type=float, default=0.3, help="fraction of training spent in the short phase")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-steps", type=int, default=250, help="linear learning-rate warmup steps")
    g.add_argument("--p-retrieval", type=float, default=0.5, help="fraction of training rows that are retrieval tasks")
    g.add_argument("--answer-weight", type=float, default=3.0, help="loss weight of retrieval answer tokens")
    g.add_argument("--seed", type=int, default=0, help="random seed (data order, initialization)")
    g.add_argument("--log-every", type=int, default=50, help="steps between log lines")
    g.add_argument("--eval-seq-len", type=int, default=2048, help="chunk length (tokens) of the final held-out evaluation")
    g.add_argument("--eval-retrieval-n", type=int, default=100, help="retrieval samples per length in the final evaluation")


def _device(args) -> str:
    if args.device:
        return args.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _prepare(args) -> dict:
    from quantmla_lab.training import data as D
    from quantmla_lab.training.options import PrepareOptions
    from quantmla_lab.training.train import prepare

    lengths = tuple(int(x) for x in args.retrieval_lengths.split(","))
    opts = PrepareOptions(
        vocab_size=args.vocab_size,
        max_train_bytes=int(args.max_train_bytes),
        tokenizer_bytes=int(args.tokenizer_bytes),
        heldout_fraction=args.heldout_fraction,
        n_retrieval=args.n_retrieval,
        retrieval_lengths=lengths,
        seed=args.seed,
        workers=min(16, os.cpu_count() or 1),
        tokenizer_from=args.tokenizer_from,
        heldout_from=args.heldout_from,
    )
    if args.size == "tiny":
        opts.heldout_code_bytes, opts.heldout_prose_bytes, opts.retrieval_pool_bytes = 6_000, 4_000, 60_000
    roots = None
    if args.stdlib_only:
        roots = [r for r in D.default_roots() if r[0] == "stdlib"]
    packages = args.packages.split(",") if args.packages else None
    return prepare(args.work, opts, roots=roots, packages=packages)


def _train_options(args):
    from quantmla_lab.training.options import TrainOptions

    return TrainOptions(
        size=args.size,
        device=_device(args),
        time_budget_s=args.time_budget,
        max_steps=args.max_steps,
        batch_tokens=args.batch_tokens,
        short_len=args.short_len,
        long_len=args.long_len,
        short_frac=args.short_frac,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        p_retrieval=args.p_retrieval,
        answer_weight=args.answer_weight,
        seed=args.seed,
        log_every=args.log_every,
        eval_seq_len=args.eval_seq_len,
        eval_retrieval_n=args.eval_retrieval_n,
    )


def _train(args, family: str) -> dict:
    from quantmla_lab.training.train import train_model

    return train_model(family, args.work, Path(args.out) / model_name(family, args.size), _train_options(args))


def _child_argv(args, family: str) -> list[str]:
    argv = [sys.executable, "-m", "quantmla.cli", "train-reference", "--stage", "train", "--family", family]
    skip = {"stage", "families", "family", "results", "jobs", "reuse_data", "packages", "stdlib_only", "tokenizer_from",
            "heldout_from"}
    for k, v in vars(args).items():
        if k.startswith("_") or k in skip or k == "command" or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    return argv


def table(cards: list[dict]) -> str:
    lengths = list(cards[0]["eval"]["retrieval"]) if cards else []
    head = f"{'model':26s} {'params':>8s} {'MiB':>5s} {'tokens':>8s} {'train s':>7s} {'bpb code':>8s} {'prose':>6s} "
    rows = [head + " ".join(f"{'r@' + k:>6s}" for k in lengths) + " " + " ".join(f"{'pk@' + k:>7s}" for k in lengths)]
    for c in cards:
        e, r = c["eval"], c["eval"]["retrieval"]
        rows.append(
            f"{c['name']:26s} {c['params'] / 1e6:7.2f}M {c['safetensors_bytes'] / 2**20:5.2f} "
            f"{c['training']['tokens'] / 1e6:7.1f}M {c['training']['wall_time_s']:7.0f} {e['bpb_code']:8.3f} "
            f"{e['bpb_prose']:6.3f} " + " ".join(f"{r[k]['accuracy']:6.2f}" for k in lengths) + " "
            + " ".join(f"{e['passkey'][k]['accuracy']:7.2f}" for k in lengths)
        )
    return "\n".join(rows)


def run(args) -> int:
    from quantmla.checks import check_output_dir, check_output_file
    from quantmla_lab.training.families import SIZE_FAMILIES

    fams = [args.family] if args.stage == "train" and args.family else [f for f in args.families.split(",") if f]
    allowed = SIZE_FAMILIES.get(args.size, FAMILIES)
    if args.stage != "prepare" and any(f not in allowed for f in fams):
        raise QuantMLAError(f"--size {args.size} fits the families {', '.join(allowed)}; pass --families {','.join(allowed)}")
    check_output_dir(args.work, "--work")  # unwritable paths fail now, not after hours of training
    if args.stage != "prepare":
        check_output_dir(args.out)
    check_output_file(args.results, "--results")
    if args.stage == "prepare":
        _prepare(args)
        return 0
    if args.stage == "train":
        if not args.family:
            raise SystemExit("--stage train needs --family")
        _train(args, args.family)
        return 0

    t0 = time.time()
    work, out = Path(args.work), Path(args.out)
    if not (args.reuse_data and (work / "manifest.json").exists()):
        _prepare(args)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "heldout").exists():
        shutil.rmtree(out / "heldout")
    shutil.copytree(work / "heldout", out / "heldout")
    families = [f for f in args.families.split(",") if f]
    jobs = args.jobs if args.jobs is not None else (len(families) if _device(args) == "cuda" else 0)
    failed = []
    if jobs == 0:
        for f in families:
            _train(args, f)
    else:
        (work / "logs").mkdir(exist_ok=True)
        procs = {}
        pending = list(families)
        while pending or procs:
            while pending and len(procs) < jobs:
                f = pending.pop(0)
                log = open(work / "logs" / f"{f}.log", "w")
                procs[f] = (subprocess.Popen(_child_argv(args, f), stdout=log, stderr=subprocess.STDOUT), log)
            time.sleep(2)
            for f, (p, log) in list(procs.items()):
                if p.poll() is not None:
                    log.close()
                    del procs[f]
                    if p.returncode != 0:
                        failed.append(f)
                        print(f"== {f} failed (exit {p.returncode}); last lines of its log:", flush=True)
                        print("".join(open(work / "logs" / f"{f}.log").readlines()[-30:]), flush=True)
    cards = []
    for f in families:
        cp = out / model_name(f, args.size) / "card.json"
        if cp.exists() and f not in failed:
            cards.append(json.loads(cp.read_text()))
    manifest = json.loads((work / "manifest.json").read_text())
    if args.results:
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps({
            "what": "quantmla train-reference: all families trained in parallel on one device",
            "command": getattr(args, "command_line", " ".join(sys.argv)),
            "total_seconds": round(time.time() - t0, 1),
            "prepare": manifest,
            "failed": failed,
            "models": cards,
        }, indent=1))
    print(table(cards), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    _p = argparse.ArgumentParser()
    add_arguments(_p)
    sys.exit(run(_p.parse_args()))
