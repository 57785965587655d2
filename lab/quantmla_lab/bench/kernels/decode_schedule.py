"""Which decode tiling and split schedule is fastest, per format, head count and batch x context?

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.kernels.decode_schedule --out $OUT/decode_schedule_h200.json

The split-KV scheduler (``api.get_mla_metadata``) cuts sequences until about ``num_SMs x ctas_per_sm``
programs run. One program works through its tiles one after another, so when a shape gives fewer
tiles than SMs can hold (one long sequence) the number of programs an SM runs at once decides the
latency, while many splits cost partial outputs (fp32, ``rows x d_c`` per split) and a longer combine.
This times one layer's decode step (decode + combine, CUDA-graph replay, ``do_bench`` median with the
L2 flushed) for every candidate tiling of ``kernels.bench.candidates`` (plus 64-row tiles at 128 heads)
at ``ctas_per_sm`` 1 to 4, on the shapes of the Hopper decode issue, and prints the best per shape.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace

import torch

from quantmla.cache.layout import PageLayout, TokenLayout
from quantmla.kernels import api
from quantmla_lab.bench.common import record, save
from quantmla_lab.bench.kernels import decode_speed as bench


def tilings(method: str, heads: int) -> list[api.DecodeConfig]:
    c = bench.candidates(method, heads)
    if heads > 16:  # 64-row tiles (wgmma): one CTA reads each tile for 64 heads (fewer re-reads and re-unpacks)
        kernel = c[0].kernel
        c += [api.DecodeConfig(block_m=64, block_n=32, num_warps=8, num_stages=2, ctas_per_sm=1, kernel=kernel),
              api.DecodeConfig(block_m=64, block_n=64, num_warps=8, num_stages=1, ctas_per_sm=1, kernel=kernel)]
        if kernel != "generic":  # the dequantizing kernel at 64 rows, both tile rebuilds
            c += [api.DecodeConfig(block_m=64, block_n=64, num_warps=8, num_stages=1, ctas_per_sm=1, kernel="generic",
                                   deq=d) for d in ((0, 1) if method != "bf16" else (0,))]
    return c


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["bf16", "fp8", "int4/int4", "int2/int4"])
    p.add_argument("--shapes16", default="1x131072,32x16384", help="batch x context at 16 heads (\"\": none)")
    p.add_argument("--shapes128", default="1x32768,32x8192", help="batch x context at 128 heads (\"\": none)")
    p.add_argument("--ctas", nargs="+", type=int, default=[1, 2, 3, 4])
    p.add_argument("--warmup-ms", type=int, default=10)
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_schedule.py times the kernels on a CUDA device")
    res = record(timing="do_bench median of one CUDA-graph replay of decode + combine, L2 flushed", rows=[], best=[])
    for heads, shapes in ((16, a.shapes16), (128, a.shapes128)):
        if not shapes.strip():  # "": no shapes at this head count
            continue
        for B, L in bench.parse_shapes(shapes, f"--shapes{heads}"):
            for m in a.methods:
                layout = PageLayout(TokenLayout(bench.D_C, bench.D_R, bench.METHODS[m]), bench.PAGE)
                cache = bench.Cache(layout, [L] * B, seed=B)
                # the API's own choice for these lengths (FP8 over short units switches to the built tile there)
                default = api.get_mla_metadata(cache.seq_lens, heads, 1, layout).config
                q = bench.queries(B, 1, heads)
                times = []
                for tiling in tilings(m, heads):
                    for k in a.ctas:
                        cfg = replace(tiling, ctas_per_sm=k)
                        try:
                            md = api.get_mla_metadata(cache.seq_lens, heads, 1, layout, config=cfg)
                            t, _, _ = bench.time_decode(cache, q, cfg, a)
                        except Exception as e:  # noqa: BLE001 - a tiling that does not compile is reported, not fatal
                            print(f"{m:10} H{heads} {B}x{L} {cfg.describe():44} failed: {type(e).__name__}", flush=True)
                            continue
                        row = dict(method=m, heads=heads, batch=B, context=L, config=asdict(cfg),
                                   describe=cfg.describe(), units=md.num_units, splits=md.max_splits,
                                   us=round(t * 1e6, 2), default=cfg == default)
                        res["rows"].append(row)
                        times.append(row)
                        print(f"{m:10} H{heads:3} {B:3}x{L:<6} {cfg.describe():44} units {md.num_units:5} "
                              f"{t * 1e6:8.1f} us", flush=True)
                if times:
                    best = min(times, key=lambda r: r["us"])
                    dflt = next((r["us"] for r in times if r["default"]), None)
                    res["best"].append(dict(method=m, heads=heads, batch=B, context=L, best=best["describe"],
                                            best_us=best["us"], default_us=dflt))
                    print(f"== best {m} H{heads} {B}x{L}: {best['describe']} {best['us']:.1f} us (default {dflt} us)",
                          flush=True)
                save(res, a.out)  # after every shape: a run cut short keeps what it timed
                del cache
                torch.cuda.empty_cache()
    save(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
