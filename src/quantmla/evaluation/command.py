"""`quantmla eval`: held-out bits per byte and retrieval accuracy at 1K/2K/4K under a quantized
cache, for any (model directory, cache config, method); writes results/accuracy.json and the
Markdown table results/accuracy.md (rows merge with those already there).

    quantmla eval --all                       every shipped reference model, the whole grid
    quantmla eval --all --quick               CI-sized: few chunks and samples, a subset of rows (results/quick/)
    quantmla eval models/qmla-ref-deepseek-v3 --config INT4/INT4 --method rtn quantmla
"""

from __future__ import annotations

import os
import sys
import time

QUICK = dict(seq_len=256, ppl_chunks=4, retrieval_n=4, lengths=[1024], calib_n=4)
FULL = dict(seq_len=512, ppl_chunks=64, retrieval_n=50, lengths=[1024, 2048, 4096], calib_n=16)


def add_arguments(p):
    p.add_argument("models", nargs="*", help="checkpoint directories, or names of reference models under models/")
    p.add_argument("--all", action="store_true", help="every reference model present under models/, the full grid")
    p.add_argument("--quick", action="store_true", help="CI-sized run (writes to results/quick unless --out is given)")
    p.add_argument("--config", nargs="+", default=None,
                   help="cache configs: BF16, FP8, CONTENT/ROPE like INT4/INT4, INT2/INT4, INT4/BF16 (default: the grid)")
    p.add_argument("--method", nargs="+", default=None,
                   help="methods: bf16 rtn kivi hadamard quantmla quantmla-content quantmla-rope (default: the grid)")
    p.add_argument("--out", default=None, help="output directory (default results, or results/quick with --quick)")
    p.add_argument("--heldout", default=None, help="held-out set directory (default models/heldout)")
    p.add_argument("--seq-len", type=int, default=None, help="perplexity chunk length in tokens")
    p.add_argument("--ppl-chunks", type=int, default=None, help="held-out chunks for bits per byte")
    p.add_argument("--retrieval-n", type=int, default=None, help="retrieval samples per length")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="retrieval lengths (tokens)")
    p.add_argument("--calib-n", type=int, default=None, help="calibration rows (of --seq-len tokens, training text)")
    p.add_argument("--calib-steps", type=int, default=None, help="optimizer steps per layer of the learned transforms")
    p.add_argument("--content-group", type=int, default=64)
    p.add_argument("--rope-group", type=int, default=32)
    p.add_argument("--kivi-block", type=int, default=None, help="KIVI token block (default: the RoPE group size, equal bytes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--resume", action="store_true", help="skip rows already in the output with the same data settings")
    p.add_argument("--no-merge", action="store_true", help="overwrite the output instead of merging rows into it")


def resolve_model(name: str) -> str:
    if os.path.isdir(name) or os.sep in name or name.startswith("."):
        return name
    from quantmla.evaluation.datasets import models_root

    return str(models_root() / name)


def _log(msg: str) -> None:
    print(f"[eval {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rows_for(args):
    from quantmla.errors import QuantMLAError
    from quantmla.evaluation.harness import RowSpec, default_rows, named_config

    block = args.kivi_block or args.rope_group
    if args.config is None and args.method is None:
        rows = default_rows(args.content_group, args.rope_group, quick=args.quick)
        return [RowSpec(r.config, r.method, block) for r in rows]
    configs = args.config or ["INT4/INT4"]
    methods = args.method or ["rtn"]
    rows = []
    for c in configs:
        try:
            cfg = named_config(c, args.content_group, args.rope_group)
        except QuantMLAError as e:
            raise type(e)(f"--config {c}: {e}") from None
        for m in methods:
            if (m == "bf16") != (not cfg.quantized) or (m == "kivi" and (cfg.rope.mode == "fp8" or not cfg.rope.quantized)):
                continue  # bf16 pairs only with the BF16 config; KIVI needs integer RoPE codes
            rows.append(RowSpec(cfg, m, block))
    if not rows:
        raise QuantMLAError(f"no valid (config, method) pair in {configs} x {methods}: BF16 goes with method bf16, "
                            "quantized configs with the other methods")
    return rows


def _config_flags(q) -> str:
    """The --config / group flags that select the cache formats of `q` (a QuantCacheConfig)."""
    name = lambda f: "BF16" if not f.quantized else ("FP8" if f.mode == "fp8" else f"INT{f.bits}")  # noqa: E731
    flags = f"--config {name(q.content)}/{name(q.rope)}"
    if q.content.quantized:
        flags += f" --content-group {q.content.group_size}"
    if q.rope.quantized:
        flags += f" --rope-group {q.rope.group_size}"
    return flags


def check_rows(path: str, spec, rows, args) -> None:
    """Each row's formats fit the model's dims, and a checkpoint written by `quantmla calibrate` is
    evaluated only at the formats it was calibrated for, without calibrating it a second time."""
    import json

    from quantmla.cache.config import QuantCacheConfig, check_matches, stored_cache_config
    from quantmla.errors import QuantMLAError
    from quantmla.evaluation.harness import CALIBRATED

    for r in rows:
        if r.config.content.quantized:
            r.config.content.check_dim(spec.d_c, f"{r.config.name}: the content path (--content-group, kv_lora_rank {spec.d_c})")
        if r.config.rope.quantized and r.method != "kivi":
            r.config.rope.check_dim(spec.d_r, f"{r.config.name}: the RoPE path (--rope-group, qk_rope_head_dim {spec.d_r})")
    with open(os.path.join(path, "config.json")) as f:
        stored = stored_cache_config(json.load(f))
    if stored is None:
        return
    for r in rows:
        if r.method == "bf16":
            continue  # the unquantized reference reads no quantized format
        requested = QuantCacheConfig(content=r.config.content, rope=r.config.rope, method=r.method)
        c, rp = r.config.content, r.config.rope
        recalibrate = (f"quantmla calibrate ORIGINAL --content-bits {c.bits} --rope-bits {rp.bits} "
                       f"--content-group {c.group_size} --rope-group {rp.group_size} --out DIR")
        check_matches(stored, requested, fix=(
            f"Evaluate {path} with {_config_flags(stored)}, or calibrate the original checkpoint for {r.config.name} "
            f"({recalibrate}) and evaluate that"))
        if r.method in CALIBRATED:
            raise QuantMLAError(
                f"{path} is already calibrated ({stored.method}, {stored.describe()}); method {r.method} would "
                "calibrate it again on top of the fused transforms. Evaluate it with --method rtn (its cache read at "
                "the calibrated formats), or give the original checkpoint to compare methods"
            )


def run(args) -> int:
    from quantmla.cli import CLIError
    from quantmla.evaluation import table
    from quantmla.evaluation.datasets import REFERENCE_MODELS, models_root
    from quantmla.evaluation.harness import check_model_dir, evaluate_row, load_eval_data, load_model

    preset = dict(QUICK if args.quick else FULL)
    for k in ("seq_len", "ppl_chunks", "retrieval_n", "lengths", "calib_n"):
        if getattr(args, k) is not None:
            preset[k] = getattr(args, k)
    models = [resolve_model(m) for m in args.models]
    if args.all:
        found = [str(models_root() / n) for n in REFERENCE_MODELS if (models_root() / n / "config.json").exists()]
        if not found:
            raise CLIError(f"--all: no reference model under {models_root()} (expected {', '.join(REFERENCE_MODELS)})")
        models += [m for m in found if m not in models]
    if not models:
        raise CLIError("give a model directory (or a reference model name), or --all")
    specs = {m: check_model_dir(m) for m in models}  # fail early on a bad path or a non-MLA model
    rows = rows_for(args)
    for m, spec in specs.items():  # and on formats a model cannot take, before any weights are read
        check_rows(m, spec, rows, args)
    out = args.out or ("results/quick" if args.quick else "results")
    settings = {"seq_len": preset["seq_len"], "ppl_chunks": preset["ppl_chunks"], "retrieval_n": preset["retrieval_n"],
                "retrieval_lengths": list(preset["lengths"]), "calib_rows": preset["calib_n"],
                "content_group": args.content_group, "rope_group": args.rope_group, "seed": args.seed,
                "quick": bool(args.quick), "device": args.device}
    calib_kwargs = {"progress": True, "verbose": False}  # a progress bar while a row calibrates, no report table
    if args.calib_steps is not None:
        calib_kwargs["steps"] = args.calib_steps
    elif args.quick:
        calib_kwargs["steps"] = 20
    settings["calib_steps"] = calib_kwargs.get("steps", "default")
    done = set()
    if args.resume and os.path.exists(os.path.join(out, "accuracy.json")):
        import json

        with open(os.path.join(out, "accuracy.json")) as f:
            for r in json.load(f).get("rows", []):
                if r.get("data") == _data_key(settings):
                    done.add((r["model"], r["config"], r["method"]))
    new_rows: list[dict] = []
    for mdir in models:
        name = os.path.basename(os.path.normpath(mdir))
        todo = [r for r in rows if (name, r.config.name, r.method) not in done]
        if not todo:
            _log(f"{name}: all rows done")
            continue
        model, tok = load_model(mdir, device=args.device)
        need_calib = any(r.method in ("hadamard", "quantmla", "quantmla-content", "quantmla-rope") for r in todo)
        data = load_eval_data(tok, heldout_root=args.heldout, seq_len=preset["seq_len"], ppl_chunks=preset["ppl_chunks"],
                              retrieval_n=preset["retrieval_n"], lengths=preset["lengths"],
                              calib_n=preset["calib_n"] if need_calib else 0)
        _log(f"{name}: {len(todo)} rows; ppl {tuple(data.ppl.shape)} tokens, retrieval "
             + ", ".join(f"{L}:{len(s)}" for L, s in data.retrieval.items()))
        for r in todo:
            t0 = time.time()
            row = evaluate_row(model, tok, r, data, spec=specs[mdir], seed=args.seed, progress=_log,
                               calib_kwargs=calib_kwargs)
            row["model"] = name
            row["data"] = _data_key(settings)
            row["device"] = _device_name(args.device)
            new_rows.append(row)
            _log(f"{name} {r.config.name} {r.method}: bpb {row['bits_per_byte']:.4f} retrieval "
                 + " ".join(f"{L}:{v['accuracy']:.2f}" for L, v in row["retrieval"].items())
                 + f" ({row['bytes_per_token']:.1f} B/token, {time.time() - t0:.0f}s)")
            table.write([row], out, settings, merge=not args.no_merge or len(new_rows) > 1)
    if new_rows or not os.path.exists(os.path.join(out, "accuracy.json")):
        jpath, mpath = table.write(new_rows, out, settings, merge=not args.no_merge)
    else:
        jpath, mpath = os.path.join(out, "accuracy.json"), os.path.join(out, "accuracy.md")
    print(f"wrote {jpath} and {mpath}")
    return 0


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def _data_key(settings: dict) -> dict:
    return {k: settings[k] for k in ("seq_len", "ppl_chunks", "retrieval_n", "retrieval_lengths", "calib_rows",
                                     "calib_steps", "content_group", "rope_group", "seed")}
