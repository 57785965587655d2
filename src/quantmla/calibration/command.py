"""`quantmla calibrate MODEL ...`: learn and fuse path-specific transforms, write a quantized checkpoint.

With ``--stream`` the run is layer-streamed from the sharded checkpoint (and optionally spread over
several processes, resumable): calibration/stream_command.py, docs/scaling.md."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from quantmla.calibration.arguments import _STREAM_ONLY, DTYPES, add_arguments, calibration_ids, preflight

__all__ = ["add_arguments", "run"]

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
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantmla.calibration.api import calibrate
    from quantmla.calibration.checkpoint import save_quantized
    from quantmla.calibration.options import CalibrationOptions

    t0 = time.perf_counter()
    opts = CalibrationOptions.from_args(args).check()
    if str(args.device) != "cpu":  # the captured activations and the fits live where the model runs
        opts = dataclasses.replace(opts, device=str(args.device))
    _, quant = preflight(args, overwrite=args.overwrite)  # before the fit, not after it
    tok, ids = calibration_ids(args)
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
    report = calibrate(model, ids, quant, opts, progress=progress, verbose=not args.json)
    # (--overwrite: written beside the old checkpoint, then swapped in whole; preflight refused it otherwise)
    out = save_quantized(model, tok, args.out, report=report, dtype=getattr(torch, saved_dtype),
                         overwrite=args.overwrite)
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
