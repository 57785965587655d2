"""`quantmla calibrate MODEL ...`: learn and fuse path-specific transforms, write a quantized checkpoint.

With ``--stream`` the run is layer-streamed from the sharded checkpoint (and optionally spread over
several processes, resumable): calibration/stream_command.py, docs/scaling.md."""

from __future__ import annotations

import json
import os
import sys
import time

DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def add_arguments(p):
    p.add_argument("model", help="MLA checkpoint directory (config.json, safetensors, tokenizer)")
    p.add_argument("--content-bits", type=int, default=4, help="content latent bits (2, 3, 4, 8; 16 = unquantized)")
    p.add_argument("--rope-bits", type=int, default=4, help="RoPE key bits (2, 3, 4, 8; 16 = unquantized)")
    p.add_argument("--content-group", type=int, default=64, help="content channels per scale/zero group")
    p.add_argument("--rope-group", type=int, default=32, help="RoPE channels per scale/zero group")
    p.add_argument("--calib", default="default",
                   help="calibration text: a text file, a .jsonl of {\"text\": ...}, or 'default' (training-split "
                        "Python sources, never the held-out evaluation packages)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a checkpoint already in --out (the new one is written beside it and swapped in whole "
                        "when complete); with --stream, also discard an earlier run's state there")
    p.add_argument("--method", default="quantmla", choices=("quantmla", "hadamard", "rtn"))
    p.add_argument("--paths", default="content,rope", help="paths to transform: content,rope | content | rope")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=200, help="Adam steps per layer (content; also the RoPE Adam search)")
    p.add_argument("--calib-seqs", type=int, default=16, help="calibration rows (a quarter is held out)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration row")
    p.add_argument("--rope-weighting", default="attention", choices=("attention", "uniform"),
                   help="weighting of the positional QK objective (see docs/calibration.md)")
    p.add_argument("--no-rope-center", action="store_true",
                   help="fit without RoPE key offsets, for runtimes that ignore quantization_config's rope_offsets "
                        "(marked \"rope_centring\": false). By default the keys' mean is removed before they are "
                        "quantized: softmax ignores a constant key offset and the quantizer's range shrinks (README: "
                        "which to choose)")
    p.add_argument("--rope-spread", type=float, default=0.0, metavar="F",
                   help="fraction (0..1) of the RoPE objective's keys moved to random positions of the model's "
                        "context before fitting: trades short-context perplexity for long-context robustness "
                        "(docs/calibration.md)")
    p.add_argument("--dtype", default="auto", choices=tuple(DTYPES),
                   help="dtype of the saved weights (auto: the checkpoint's own); calibration always runs in fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print the calibration report as JSON")
    p.add_argument("--no-progress", action="store_true")
    from quantmla.calibration.stream_command import add_stream_arguments

    add_stream_arguments(p)  # --stream and its options (their own help group)


# the streaming options and their defaults: given without --stream they would be ignored silently
_STREAM_ONLY = {"nproc": 1, "activations": "memory", "checkpoint_every": 1, "checksum": False, "stream_report": None}


def cli_cache_config(content_bits: int, rope_bits: int, content_group: int, rope_group: int, spec):
    """The QuantCacheConfig of the command-line flags, checked against the model's dims before any
    weights are read; errors name the flag to change."""
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.errors import UnsupportedFormatError
    from quantmla.quant.format import PathFormat

    fmts = []
    for name, bits, group, dim, dim_name in (("content", content_bits, content_group, spec.d_c, "kv_lora_rank"),
                                             ("rope", rope_bits, rope_group, spec.d_r, "qk_rope_head_dim")):
        flags = f"--{name}-bits {bits} --{name}-group {group}"
        try:
            fmt = PathFormat(bits, group)
            fmt.check_dim(dim, f"the {'content' if name == 'content' else 'RoPE'} path ({dim_name} {dim})")
        except UnsupportedFormatError as e:
            raise UnsupportedFormatError(f"{flags}: {e}") from None
        fmts.append(fmt)
    return QuantCacheConfig(content=fmts[0], rope=fmts[1])


def refuse_calibrated(model_dir) -> None:
    """Refuse a checkpoint `quantmla calibrate` already wrote: new transforms would stack on the fused ones."""
    from quantmla.cache.config import stored_cache_config
    from quantmla.errors import QuantMLAError

    with open(os.path.join(model_dir, "config.json")) as f:
        stored = stored_cache_config(json.load(f))
    if stored is not None:
        raise QuantMLAError(
            f"{model_dir} is already calibrated ({stored.method}, {stored.describe()}); calibrating it again would "
            "stack new transforms on the fused ones. Calibrate the original (uncalibrated) checkpoint instead"
        )


def run(args) -> int:
    if getattr(args, "stream", False):
        from quantmla.calibration.stream_command import run_streamed

        return run_streamed(args)
    from quantmla.errors import QuantMLAError

    stray = [k for k, default in _STREAM_ONLY.items() if getattr(args, k, default) != default]
    if stray:
        flags = ", ".join("--" + k.replace("_", "-") for k in stray)
        raise QuantMLAError(f"{flags}: streaming options; add --stream (or drop them)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from quantmla.calibration.api import calibrate
    from quantmla.calibration.checkpoint import save_quantized
    from quantmla.calibration.data import load_calibration_ids
    from quantmla.calibration.outdir import check_output_dir, fresh_staging, holds_checkpoint, staging_dir, swap_in
    from quantmla.model.spec import load_spec

    t0 = time.perf_counter()
    spec = load_spec(args.model)  # FileNotFoundError / NotMLAError before any weights are read
    spec.require_latent_cache()
    quant = cli_cache_config(args.content_bits, args.rope_bits, args.content_group, args.rope_group, spec)
    refuse_calibrated(args.model)
    check_output_dir(args.out, args.overwrite)  # before the fit, not after it
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    try:
        tok = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError, TypeError) as e:
        raise QuantMLAError(f"{args.model}: no usable tokenizer ({e}); calibration text is tokenized with the checkpoint's own") from None
    ids = load_calibration_ids(tok, args.calib, args.seq_len, args.calib_seqs)
    saved_dtype = DTYPES[args.dtype]
    if saved_dtype is None:
        saved_dtype = getattr(AutoConfig.from_pretrained(args.model), "dtype", None) or "float32"
        saved_dtype = str(saved_dtype).replace("torch.", "")
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    except OSError as e:
        raise QuantMLAError(f"{args.model}: cannot load the weights ({e}); the checkpoint directory must hold them "
                            "(model.safetensors or its shards) next to config.json") from None
    model = model.eval().to(args.device)
    progress = not args.no_progress and not args.json
    report = calibrate(model, ids, quant, method=args.method, paths=paths, seed=args.seed, steps=args.steps,
                       rope_weighting=args.rope_weighting, rope_center=not args.no_rope_center,
                       rope_spread=args.rope_spread, progress=progress,
                       verbose=not args.json)
    if holds_checkpoint(args.out):  # --overwrite: write beside the old checkpoint, then swap it in whole
        save_quantized(model, tok, fresh_staging(args.out), report=report, dtype=getattr(torch, saved_dtype))
        swap_in(staging_dir(args.out), args.out)
        out = args.out
    else:
        out = save_quantized(model, tok, args.out, report=report, dtype=getattr(torch, saved_dtype))
    if args.json:
        d = report.to_dict()
        d["out"] = str(out)
        d["seconds"]["wall"] = time.perf_counter() - t0
        json.dump(d, sys.stdout, indent=1)
        print()
    else:
        print(f"wrote {out} ({saved_dtype} weights, quantization_config {quant.describe()}, method {args.method}) "
              f"in {time.perf_counter() - t0:.1f}s")
    return 0
