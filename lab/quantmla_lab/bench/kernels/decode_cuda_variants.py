"""Which build-time knobs of the CUDA decode kernel pay on this GPU? Times one decode call (CUDA-graph
replay, L2 flushed) of the default plan and of variants that change one constant each: build-loop and
score-loop unrolling, cp.async stages, CTAs per SM. Same tokens and queries for every variant.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --out out/decode_cuda_variants.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from quantmla.cache.layout import PageLayout, TokenLayout, preset
from quantmla.kernels import api, cuda, schedule
from quantmla_lab.bench.kernels import decode_speed as bench


def variants(plan: cuda.DecodePlan, layout: PageLayout) -> dict[str, cuda.DecodePlan]:
    m = dict(plan.macros)

    def with_(**kw) -> cuda.DecodePlan:
        mm = {**m, **kw}
        return dataclasses.replace(plan, macros=tuple(sorted(mm.items())))

    out = {"default": plan, "build_unroll_2": with_(BUILD_UNROLL=2), "qk_unroll_full": with_(QK_UNROLL=18),
           "qk_unroll_2": with_(QK_UNROLL=2)}
    for st in (2, 3, 4):
        if st != plan.stages:
            smem = cuda.smem_bytes(layout, plan.block_m, st, m["KSPLIT"])
            if plan.ctas_per_sm * (smem + cuda.SMEM_RESERVED) <= cuda.SMEM_PER_SM:
                out[f"stages_{st}"] = dataclasses.replace(with_(STAGES=st, SMEM_EXPECTED=smem), stages=st, smem=smem)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int4/int4,bf16")
    ap.add_argument("--shapes", default="1x131072,32x16384")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    H, res = a.heads, {"device": torch.cuda.get_device_name(), "commit": bench.source_commit(), "rows": []}
    for name in a.formats.split(","):
        lay = PageLayout(TokenLayout(512, 64, preset(name)), 64)
        cfg = schedule.cuda_config(H, lay, "cuda")
        plan = cuda.decode_plan(lay, H, torch.bfloat16, torch.device("cuda"))
        for shape in a.shapes.split(","):
            B, L = (int(x) for x in shape.split("x"))
            c = bench.Cache(lay, [L] * B, seed=B + L)
            qc = torch.randn(B, 1, H, 512, device="cuda").to(torch.bfloat16)
            qr = torch.randn(B, 1, H, 64, device="cuda").to(torch.bfloat16)
            out = torch.empty_like(qc)
            lse = torch.empty(B, 1, H, device="cuda")
            for vname, vp in variants(plan, lay).items():
                md = api.get_mla_metadata(c.seq_lens, H, 1, lay, config=cfg)
                po = torch.empty(md.num_units, H, 512, device="cuda")
                pl = torch.empty(md.num_units, H, device="cuda")
                args = (qc, qr, c.pages, None, None, c.block_table, c.seq_lens, md.units, out, lse, po, pl,
                        c.block_table.stride(0), H, 1, H, 1, 0.07 * 1.4426950408889634)

                def run(vp=vp, args=args, md=md):
                    cuda.launch_decode(vp, (md.num_units, md.head_blocks), args, torch.device("cuda"))

                t, _ = bench.time_ms(run, 25, 100)
                res["rows"].append({"format": name, "batch": B, "context": L, "variant": vname, "us": t * 1e3,
                                    "stages": vp.stages, "macros": dict(vp.macros)})
                print(f"{name:10s} {B}x{L:<7d} {vname:16s} {t * 1e3:8.1f} us", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
