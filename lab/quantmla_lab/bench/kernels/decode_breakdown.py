"""Where a decode call's time goes: the decode kernel, the combine kernel and what is left (launches, gaps).

    python -m quantmla_lab.bench.kernels.decode_breakdown --formats bf16,int4/int4 \\
        --shapes 1x131072,8x16384,32x16384,264x32,264x512 --out decode_breakdown_h200.json

Per format and shape (16 heads, one query token, 64-token pages in random order): the whole call replayed
as a CUDA graph with L2 flushed (as bench-kernel times it), and each kernel's own GPU time from the
profiler over eager calls, each after an L2 flush. `264x32` gives every work unit one tile and no split:
its time is the fixed cost of a wave (launch, query block, first copy, epilogue). A linear fit of the
decode kernel's time against tokens per unit separates the fixed cost from the cost per token.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantmla.cache.layout import PageLayout, TokenLayout, preset
from quantmla.kernels import api
from quantmla.kernels.partials import partials_setting
from quantmla_lab.bench.kernels import decode_speed, timing
from quantmla_lab.bench.common import save


def kernel_times(fn, calls: int) -> dict[str, float]:
    """Median GPU time (µs) of each kernel name over `calls` eager calls, an L2 flush before each."""
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for ev in prof.events():
        if str(ev.device_type).split(".")[-1] != "CUDA" or "fill" in ev.name or "elementwise" in ev.name:
            continue
        per.setdefault(ev.name, []).append(ev.time_range.elapsed_us())
    return {k: statistics.median(v) for k, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,int4/int4")
    ap.add_argument("--shapes", default="1x131072,8x16384,32x16384,264x32,264x512")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_breakdown needs a CUDA GPU")
    shapes = decode_speed.parse_shapes(a.shapes, "--shapes")
    rows = []
    for fmt in a.formats.split(","):
        lay = PageLayout(TokenLayout(512, 64, preset(fmt)), 64)
        for B, L in shapes:
            c = decode_speed.Cache(lay, [L] * B, seed=1, device="cuda")
            qc = torch.randn(B, a.heads, 512, device="cuda").to(torch.bfloat16)
            qr = torch.randn(B, a.heads, 64, device="cuda").to(torch.bfloat16)
            md = api.get_mla_metadata(c.seq_lens, a.heads, 1, lay)
            out = torch.empty(B, a.heads, 512, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(B, a.heads, device="cuda", dtype=torch.float32)

            def fn():
                api.mla_decode_with_kvcache(qc, qr, c.pages, c.block_table, c.seq_lens, lay, 0.07, metadata=md,
                                            out=out, lse=lse)

            whole, graph = timing.time_ms(fn, 25, 200)
            ks = kernel_times(fn, a.calls)
            dec = sum(v for k, v in ks.items() if "mla_decode" in k and "combine" not in k)
            comb = sum(v for k, v in ks.items() if "combine" in k)
            units = int(md.num_units)
            r = dict(format=fmt, heads=a.heads, batch=B, context=L, units=units, variant=str(md.variant),
                     tokens_per_unit=B * L / units, whole_us=whole * 1e3, graph=graph, decode_us=dec,
                     combine_us=comb, rest_us=whole * 1e3 - dec - comb, kernels=ks)
            rows.append(r)
            print(f"{fmt:10s} {B:4d}x{L:<7d} units {units:4d} ({r['tokens_per_unit']:7.0f} tok)"
                  f" whole {r['whole_us']:7.1f}  decode {dec:7.1f}  combine {comb:6.1f}  rest {r['rest_us']:6.1f} us",
                  flush=True)
            torch.cuda.empty_cache()
    fits = {}
    for fmt in a.formats.split(","):
        pts = [(r["tokens_per_unit"], r["decode_us"]) for r in rows if r["format"] == fmt and r["units"] > 0]
        if len(pts) >= 2:
            n = len(pts)
            mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
            sxx = sum((p[0] - mx) ** 2 for p in pts)
            b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else 0.0
            fits[fmt] = dict(fixed_us=my - b * mx, us_per_token_per_unit=b)
            print(f"{fmt}: decode kernel ~ {fits[fmt]['fixed_us']:.1f} us + {b * 1e3:.2f} ns x tokens per unit")
    res = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               commit=decode_speed.source_commit(), partials=partials_setting(),
               command="python -m quantmla_lab.bench.kernels.decode_breakdown "
               f"--formats {a.formats} --shapes {a.shapes} --heads {a.heads}", rows=rows, fits=fits)
    save(res, a.out)


if __name__ == "__main__":
    main()
