"""Decode kernel latency at small batches against the shortest split (H200, issue #6).

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.kernels.decode_splits --out $OUT/decode_splits_h200.json

Under cache pressure the engine decodes 1–16 sequences of about 2K tokens. The split-KV schedule
cuts a sequence into splits of at least ``DecodeConfig.min_chunk`` tokens: with 256, a lone
1900-token sequence got 8 programs on a 132-SM GPU. This times one layer's decode step (decode +
combine kernels, one CUDA-graph replay, ``do_bench`` median with the L2 flushed) for each format,
batch and tiling, with min_chunk 256, 128 (the API default) and 64.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace

import torch

from quantmla.cache.layout import PageLayout, TokenLayout
from quantmla.kernels import api
from quantmla_lab.bench.common import record, save
from quantmla_lab.bench.kernels import decode_speed as bench


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["bf16", "int4/int4", "int2/int4"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--context", type=int, default=1900)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--min-chunks", nargs="+", type=int, default=[256, 128, 64])
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_splits.py times the kernels on a CUDA device")
    rows = []
    for m in a.methods:
        layout = PageLayout(TokenLayout(bench.D_C, bench.D_R, bench.METHODS[m]), bench.PAGE)
        base = api.default_config(a.heads, layout, "cuda")
        tilings = [base] + [c for c in bench.candidates(m, a.heads)[1:3] if c.kernel == "fused" and c.orient == "heads"]
        for B in a.batches:
            cache = bench.Cache(layout, [a.context] * B, seed=B)
            q = bench.queries(B, 1, a.heads)
            for tiling in tilings:
                for k in a.min_chunks:
                    cfg = replace(tiling, min_chunk=k)
                    md = api.get_mla_metadata(cache.seq_lens, a.heads, 1, layout, config=cfg)
                    t, _, _ = bench.time_decode(cache, q, cfg, a)
                    rows.append(dict(method=m, batch=B, context=a.context, config=cfg.describe(), min_chunk=k,
                                     splits=md.max_splits, programs=md.num_units, us=round(t * 1e6, 2),
                                     default=(tiling == base and k == base.min_chunk)))
                    print(f"{m:10} B{B:3} {cfg.describe():44} splits {md.max_splits:3} units {md.num_units:4}  "
                          f"{t * 1e6:7.2f} us", flush=True)
            del cache
            torch.cuda.empty_cache()
    best = {}
    for r in rows:
        key = (r["method"], r["batch"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print("\nmethod     batch  default us   best us  best config")
    for (m, B), r in best.items():
        d = next(x for x in rows if x["method"] == m and x["batch"] == B and x["default"])
        print(f"{m:10} {B:5} {d['us']:11.2f} {r['us']:9.2f}  {r['config']}")
    res = record(heads=a.heads, context=a.context,
               timing="do_bench median of one CUDA-graph replay of decode + combine, L2 flushed", rows=rows,
               default_configs={m: asdict(api.default_config(a.heads, PageLayout(TokenLayout(bench.D_C, bench.D_R, bench.METHODS[m]), bench.PAGE), "cuda"))
                                for m in a.methods})
    save(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
