"""The combine kernel alone: every split read in one step against the two-pass loop, on the splits the API makes.

    python -m quantmla_lab.bench.kernels.combine --out combine_h200.json

Per shape (sequences x splits a sequence, 16 query rows, d_c 512, fp32 partials with random log-sum-exps): the
combine kernel as the API launches it (`schedule.combine_blocks`, one step where every split fits), and the same
blocks with the two-pass loop (`combine_blocks(..., one_step=False)`: COMBINE_TILE splits a step), each replayed
as a CUDA graph with L2 flushed before every call. Both outputs must agree. The shapes are the splits of the decode steps the jobs run:
1 x 264 (a lone long sequence), 8 x 33, 32 x 8, 64 x 4 (16K to 64K contexts at batches 8 to 64) and 8 x 16 (short
contexts). `--partials fp16` or `bf16` stores the partials as the API's 16-bit workspaces do, and
`--blocks RxD ...` times other program blocks (R rows, D channels) beside the API's on the same partials, each read in
one step where every split fits a tile of COMBINE_ONE_STEP_TILE and else in passes of COMBINE_TILE:

    python -m quantmla_lab.bench.kernels.combine --partials fp16 --blocks 1x64 2x32 4x16 --out combine_blocks.json
"""

from __future__ import annotations

import argparse
import time

import torch

from quantmla.kernels import schedule
from quantmla.kernels.decode import _mla_combine_kernel
from quantmla_lab.bench.kernels import decode_speed, timing
from quantmla_lab.bench.common import save

SHAPES = ((1, 264), (1, 128), (8, 33), (8, 16), (32, 8), (64, 4))
PARTIALS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--shapes", default=",".join(f"{b}x{s}" for b, s in SHAPES), help="sequences x splits")
    ap.add_argument("--partials", choices=tuple(PARTIALS), default="fp32", help="the partials' dtype")
    ap.add_argument("--blocks", nargs="*", default=[], metavar="RxD", help="other program blocks: rows x channels")
    ap.add_argument("--out", default="combine.json")
    a = ap.parse_args()
    dev, R, DC = torch.device("cuda"), a.rows, 512
    sms = schedule.num_sms_of(dev)
    res = {"device": torch.cuda.get_device_name(dev), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python -m quantmla_lab.bench.kernels.combine " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
           "commit": decode_speed.source_commit(), "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for spec in a.shapes.split(","):
        B, S = (int(x) for x in spec.split("x"))
        po = torch.randn(B * S, R, DC, device=dev, generator=g).to(PARTIALS[a.partials])
        plse = torch.randn(B * S, R, device=dev, generator=g) * 4
        info = torch.tensor([(b * S, S) for b in range(B)], dtype=torch.int32, device=dev)
        br, bd, bs = schedule.combine_blocks(B, R, DC, S, sms)
        _, _, two_pass_s = schedule.combine_blocks(B, R, DC, S, sms, one_step=False)
        outs = {}
        variants = [("api", br, bd, bs, schedule.combine_one_step(S, bs)), ("two_pass", br, bd, two_pass_s, False)]
        for blk in a.blocks:  # the API's splits a step (combine_step_splits) at other row/channel blocks
            r, d = (int(x) for x in blk.split("x"))
            s1 = schedule.combine_step_splits(r, d, S)
            variants.append((f"r{r}_d{d}", r, d, s1, schedule.combine_one_step(S, s1)))
        for name, br, bd, block_s, one in variants:
            out = torch.full((B, R, DC), float("nan"), device=dev)
            lse = torch.full((B, R), float("nan"), device=dev)

            def run(out=out, lse=lse, br=br, bd=bd, block_s=block_s, one=one):
                _mla_combine_kernel[(B, -(-R // br), DC // bd)](po, plse, info, out, lse, R, D_C=DC, BLOCK_R=br,
                                                                 BLOCK_D=bd, BLOCK_S=block_s, ONE_STEP=one,
                                                                 num_warps=4, num_stages=2)

            ms, graphed = timing.time_ms(run, 25, 200)
            outs[name] = out.clone()
            row = {"batch": B, "splits": S, "variant": name, "us": ms * 1e3, "graph": graphed, "block_r": br,
                   "block_d": bd, "block_s": block_s, "one_step": one, "programs": B * -(-R // br) * (DC // bd),
                   "partial_MB": B * S * R * DC * po.element_size() / 1e6,
                   "partials": a.partials}
            res["rows"].append(row)
            print(f"{B:3d} x {S:<4d} {name:9s} {row['us']:7.2f} us  blocks r{br} d{bd} s{block_s} one_step={one}",
                  flush=True)
        for row, (name, *_) in zip(res["rows"][-len(variants):], variants):
            diff = float((outs[name] - outs["api"]).abs().max() / outs["api"].abs().max())
            row["max_rel_diff_vs_api"] = diff
            assert diff < 1e-5, f"the combines {name} and api disagree by {diff} of their largest value at {B} x {S}"
    save(res, a.out)


if __name__ == "__main__":
    main()
