"""``quantmla calibrate --stream``: layer-streamed (and multi-process) calibration from the CLI.

``quantmla calibrate`` (calibration/command.py) adds these options with :func:`add_stream_arguments`
(a "streaming" help group) and hands a run with ``--stream`` to :func:`run_streamed`::

    quantmla calibrate MODEL --out OUT --stream [calibrate's options] [--nproc 2] [--activations disk]

The same run without the ``quantmla`` entry point (here ``--stream`` is implied), also under
torchrun, one process per GPU::

    python -m quantmla.calibration.stream_command MODEL --out OUT [calibrate's options] [--nproc 2]
    torchrun --nproc-per-node 8 -m quantmla.calibration.stream_command MODEL --out OUT --device cuda
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from quantmla import jsonfile
from quantmla.calibration.arguments import add_arguments as calibrate_arguments
from quantmla.calibration.arguments import calibration_ids, preflight


def add_arguments(p) -> None:
    """calibrate's options (which include the streaming group), with --stream implied."""
    calibrate_arguments(p)
    p.set_defaults(stream=True)


def _options(args) -> dict:
    """calibrate_streamed's keyword arguments of the flags (the fit's: calibrate's CalibrationOptions)."""
    import dataclasses

    from quantmla.calibration.options import CalibrationOptions

    fit = CalibrationOptions.from_args(args).check()
    if str(args.device) != "cpu":  # fit where the layers run (several ranks: "cuda", each rank's own GPU)
        ranks = int(os.environ.get("WORLD_SIZE", "1")) > 1 or int(getattr(args, "nproc", 1) or 1) > 1
        fit = dataclasses.replace(fit, device="cuda" if ranks and str(args.device).startswith("cuda") else args.device)
    return dict(method=fit.method, seed=fit.seed, activations=args.activations, checkpoint_every=args.checkpoint_every,
                checksum=args.checksum, overwrite=args.overwrite, fit_kwargs=fit)


def _printer(quiet: bool):
    if quiet:
        return None

    def show(s) -> None:
        gb = 1 << 30
        print(f"layer {s.layer:3d} (rank {s.rank}): load {s.load_s:6.1f}s  forward {s.forward_s:6.1f}s  fit {s.fit_s:7.1f}s  "
              f"write {s.write_s:5.1f}s  weights {s.weight_bytes / gb:7.3f} GiB  RSS {s.rss_bytes / gb:6.2f} GiB",
              flush=True)

    return show


def _distributed_entry(model, out, ids, quant, device, opts, quiet):
    from quantmla.calibration.distributed import calibrate_streamed_distributed

    return calibrate_streamed_distributed(model, out, ids, quant, device=device, progress=_printer(quiet), **opts)


def run_streamed(args) -> int:
    import torch

    from quantmla.calibration.distributed import calibrate_streamed_distributed, launch_local, rank_summary
    from quantmla.calibration.stream import calibrate_streamed
    from quantmla.errors import QuantMLAError

    t0 = time.perf_counter()
    if getattr(args, "dtype", "auto") not in ("auto", None):
        raise QuantMLAError("--stream writes every tensor in the checkpoint's own dtype (calibration runs in fp32); drop --dtype")
    opts = _options(args)
    _, quant = preflight(args, overwrite=True)  # a checkpoint already in --out is judged when the run starts (resume)
    _, ids = calibration_ids(args)
    quiet = getattr(args, "json", False) or getattr(args, "no_progress", False)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = str(args.device).startswith("cuda")
    if world_env > 1:  # torchrun
        import torch.distributed as dist

        backend = "nccl" if cuda else "gloo"
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=4))
        try:
            device = f"cuda:{local}" if cuda else "cpu"
            report = calibrate_streamed_distributed(args.model, args.out, ids, quant, device=device,
                                                    progress=_printer(quiet), **opts)
            is_main = dist.get_rank() == 0
        finally:
            dist.destroy_process_group()
        if not is_main:
            return 0
    elif args.nproc > 1:
        backend = "nccl" if cuda else "gloo"
        if cuda and torch.cuda.device_count() < args.nproc:
            raise QuantMLAError(f"--nproc {args.nproc} with --device cuda needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
        report = launch_local(_distributed_entry, args.nproc, args.model, args.out, ids, quant, None, opts, quiet,
                              backend=backend, threads=max(1, (os.cpu_count() or 1) // args.nproc))
    else:
        report = calibrate_streamed(args.model, args.out, ids, quant, device=args.device, progress=_printer(quiet), **opts)
    if args.stream_report:
        jsonfile.write(args.stream_report, report.to_dict())
    if getattr(args, "json", False):
        d = report.to_dict()
        d["seconds_wall"] = time.perf_counter() - t0
        json.dump(d, sys.stdout, indent=1)
        print()
    else:
        print(rank_summary(report))
        print(f"wrote {args.out} (quantization_config {quant.describe()}, method {args.method}) in {time.perf_counter() - t0:.1f}s")
    return 0


run = run_streamed


def main(argv: list[str] | None = None) -> int:
    from quantmla.errors import QuantMLAError

    p = argparse.ArgumentParser(prog="python -m quantmla.calibration.stream_command",
                                description="Layer-streamed calibration of an MLA checkpoint (see docs/scaling.md)")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_streamed(args)
    except (QuantMLAError, FileNotFoundError) as e:
        print(f"quantmla calibrate --stream: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
