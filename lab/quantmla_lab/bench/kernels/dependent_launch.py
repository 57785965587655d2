"""Do programmatic dependent launches shorten a decode call? Times the API's whole call (its default kernels: decode,
then the combine of split sequences) as a CUDA-graph replay with L2 flushed, in three settings in turn (two rounds
each, same tokens and queries): stream order (`QUANTMLA_DEPENDENT_LAUNCH=none`), the combine a dependent of the
decode kernel (`combine`, the default), and the decode kernel a dependent of the kernel before it (the L2 flush) as
well (`both`);
the outputs of all three compared bit for bit. Needs an sm_90 GPU.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.kernels.dependent_launch --out out/kernels/dependent_launch.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys

import torch

from quantmla.cache.layout import PageLayout, TokenLayout, preset
from quantmla.kernels import api, launch
from quantmla.kernels.partials import partials_setting
from quantmla_lab.bench.common import save
from quantmla_lab.bench.kernels import decode_speed as bench

SHAPES = {16: "1x131072,8x16384,32x16384,128x2048,8x2048", 128: "1x32768,32x8192"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--formats", default="bf16,fp8,int4/int4,int2/int4")
    ap.add_argument("--shapes16", default=SHAPES[16], help="batch x context at 16 heads")
    ap.add_argument("--shapes128", default=SHAPES[128], help="batch x context at 128 heads")
    ap.add_argument("--rounds", type=int, default=2, help="times each setting is timed, in turn")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("dependent_launch needs an sm_90 GPU (programmatic dependent launch)")
    if not launch.combine_pdl(torch.device("cuda")):
        raise SystemExit("this Triton cannot launch the combine as a programmatic dependent (gdc_wait, launch_pdl)")
    dev = torch.device("cuda")
    default = launch.dependent_launch_setting()
    res = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.UTC).isoformat(
        timespec="seconds"), "commit": bench.source_commit(), "command": " ".join(sys.argv), "flush": bench.FLUSH,
        "partials": partials_setting(), "rows": []}
    for H in a.heads:
        for name in a.formats.split(","):
            lay = PageLayout(TokenLayout(512, 64, preset(name)), 64)
            for shape in (a.shapes16 if H == 16 else a.shapes128).split(","):
                B, L = (int(x) for x in shape.split("x"))
                c = bench.Cache(lay, [L] * B, seed=B + L)
                qc = torch.randn(B, 1, H, 512, device=dev).to(torch.bfloat16)
                qr = torch.randn(B, 1, H, 64, device=dev).to(torch.bfloat16)
                out, lse = torch.empty_like(qc), torch.empty(B, 1, H, device=dev)
                md = api.get_mla_metadata(c.seq_lens, H, 1, lay)

                run = functools.partial(api.mla_decode_with_kvcache, qc, qr, c.pages, c.block_table, c.seq_lens, lay,
                                        0.07, metadata=md, out=out, lse=lse)

                times, outs = {k: [] for k in launch.DEPENDENT_LAUNCH}, {}
                for _ in range(a.rounds):
                    for k in launch.DEPENDENT_LAUNCH:
                        os.environ["QUANTMLA_DEPENDENT_LAUNCH"] = k  # read at launch: each capture its own
                        out.fill_(float("nan"))
                        run()
                        torch.cuda.synchronize()
                        outs[k] = out.clone()
                        times[k].append(bench.time_ms(run, 25, 100)[0] * 1e3)
                os.environ["QUANTMLA_DEPENDENT_LAUNCH"] = default
                same = all(torch.equal(outs["none"], o) for o in outs.values())
                us = {k: statistics.median(v) for k, v in times.items()}
                row = {"heads": H, "format": name, "batch": B, "context": L, "splits": md.max_splits,
                       "units": md.num_units, "config": md.config.describe(), "variant": md.variant,
                       "us": us, "rounds_us": times, "outputs_equal": same}
                res["rows"].append(row)
                print(f"{H:3d}h {name:10s} {B}x{L:<7d} splits {md.max_splits:4d}  " + "  ".join(
                    f"{k} {v:7.1f}" for k, v in us.items()) + f" us  same={same}", flush=True)
                save(res, a.out)


if __name__ == "__main__":
    main()
