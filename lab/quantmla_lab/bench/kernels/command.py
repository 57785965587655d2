"""``quantmla bench-kernel``: benchmark the low-bit MLA decode kernels on the GPU (see decode_speed.py)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from quantmla_lab.bench.kernels.decode_speed import DEFAULT_SHAPES, METHODS

    p.add_argument("--heads", type=int, nargs="+", default=[16, 128], help="query head counts (default: 16 128)")
    p.add_argument("--shapes", default=None, help="batch x context list for every head count, comma separated "
                   f"(default per head count: {DEFAULT_SHAPES})")
    p.add_argument(
        "--methods", default="bf16,fp8,int4/int4,int2/int4",
        help=f"cache formats, comma separated, from {', '.join(METHODS)} (bf16 always runs: it is the baseline)",
    )
    p.add_argument("--q-len", type=int, default=1, help="query tokens per sequence (MTP / speculative decode)")
    p.add_argument("--peer", default=None, help="path to an external BF16 MLA decode kernel file (vLLM/SGLang "
                   "decode_attention_fwd, or one defining quantmla_peer_decode); never committed")
    p.add_argument("--sweep-shape", default="32x16384", help="batch x context the config sweep is timed on")
    p.add_argument("--no-sweep", action="store_true", help="use the default config of each method")
    p.add_argument("--flush", choices=("write", "read"), default="write",
                   help="how L2 is emptied before each timed call: 'write' zeroes a 256 MB buffer (triton's do_bench; "
                        "its dirty lines are written back during the call), 'read' reads one (no write-back)")
    p.add_argument("--warmup-ms", type=int, default=25, help="warmup time per measurement (ms)")
    p.add_argument("--rep-ms", type=int, default=100, help="timed repetitions per measurement (ms)")
    p.add_argument("--out", default="out/bench-kernel/decode.json", help="where the JSON (and the PNG beside it) go")
    p.add_argument("--overwrite", action="store_true", help="replace an existing result file")
    p.add_argument("--smoke", action="store_true", help="a tiny dry run on CPU under TRITON_INTERPRET=1 (tests)")


def run(args) -> int:
    from pathlib import Path

    from quantmla.checks import check_output_file
    from quantmla.errors import QuantMLAError
    from quantmla_lab.bench.kernels.decode_speed import run_bench
    from quantmla_lab.bench.common import save
    from quantmla_lab.bench.kernels.decode_speed_report import goals, plot

    if Path(args.out).exists() and not args.overwrite:
        raise QuantMLAError(f"--out {args.out} already exists; pass --overwrite to replace it, or choose another path")
    check_output_file(args.out)  # an unwritable --out fails now, not after the benchmark
    res = run_bench(args)
    res["goals"] = goals(res)
    save(res, args.out, default=str)
    print(f"figure {plot(res, args.out)}")
    print("\ngoals:")
    for k, v in res["goals"].items():
        print(f"  {k:45s} {v if v is None else round(v, 3)}")
    print(f"\nsaved {args.out} ({res['wall_s']:.0f} s)")
    return 0
