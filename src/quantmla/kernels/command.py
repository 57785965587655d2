"""``quantmla bench-kernel``: benchmark the low-bit MLA decode kernels on the GPU (see kernels/bench.py)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from quantmla.kernels.bench import DEFAULT_SHAPES, METHODS

    p.add_argument("--heads", type=int, nargs="+", default=[16, 128], help="query head counts (default: 16 128)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"batch x context list (default: {DEFAULT_SHAPES})")
    p.add_argument(
        "--methods", default="bf16,int4/int4,int2/int4",
        help=f"cache formats, comma separated, from {', '.join(METHODS)} (bf16 always runs: it is the baseline)",
    )
    p.add_argument("--q-len", type=int, default=1, help="query tokens per sequence (MTP / speculative decode)")
    p.add_argument("--peer", default=None, help="path to an external BF16 MLA decode kernel file (vLLM/SGLang "
                   "decode_attention_fwd, or one defining quantmla_peer_decode); never committed")
    p.add_argument("--sweep-shape", default="32x16384", help="batch x context the config sweep is timed on")
    p.add_argument("--no-sweep", action="store_true", help="use the default config of each method")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--out", default="out/bench-kernel/decode.json", help="where the JSON goes")
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # CPU + TRITON_INTERPRET=1 dry run


def run(args) -> int:
    from quantmla.kernels.bench import run_bench, save

    res = run_bench(args)
    save(res, args.out)
    print("\ngoals:")
    for k, v in res["goals"].items():
        print(f"  {k:45s} {v if v is None else round(v, 3)}")
    print(f"\nsaved {args.out} ({res['wall_s']:.0f} s)")
    return 0
