"""What a decode call costs between a layer's absorbed products, against what it costs alone.

The engine's decode step runs, a layer, the query's absorption (``q_nope · W_UK``, a cuBLAS bmm), the decode call
(decode kernel and, where a sequence is split, the combine kernel) and the values' up-projection (``· W_UV``, a bmm),
among the layer's other kernels. This bench captures CUDA graphs of `--layers` such layers, each with a cache of its
own (so no layer's pages are in L2 when it reads them, as in a step), and replays them back to back:

    decode   the decode call of every layer, nothing between
    kernel   the decode kernel alone of every layer (``kernels.launch.launch_decode`` with the call's own arguments
             and partials' workspace; no combine), nothing between
    absorb   the two bmm of every layer, no decode
    layer    bmm, decode call, bmm, a layer

and gives µs a layer: ``layer - absorb`` is what the decode call adds between the products, ``decode - kernel``
what its combine adds. With ``--timeline``, where the call runs the tokens-as-M kernel, each of ``--plans`` (its default
or another tiling) runs alone in a graph of the layers, and a graph of its ``TIMELINE=1`` build (each CTA's
``%globaltimer`` at entry and at its end, written over the unit's partial output: a buffer a layer) replayed once
gives, medians over the layers: the span from a layer's first CTA's entry to its last CTA's end (every
warp's epilogue done), the median CTA's lifetime, the gap from a layer's last CTA's end to the next layer's first
CTA's entry, the spread of the CTAs' entries and ends, and the SMs a layer's CTAs ran on. Medians over 5 groups of
`--reps` replays, CUDA events (``step_overhead.replay_ms``).

    python -m quantmla_lab.bench.kernels.decode_in_graph --out $OUT/kernels/decode_in_graph_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from quantmla.cache.layout import PageLayout, TokenLayout, preset
from quantmla.errors import QuantMLAError
from quantmla.kernels import api, cuda, schedule
from quantmla.kernels.launch import launch_decode
from quantmla.kernels.partials import partial_dtype
from quantmla_lab.bench.common import parse_fresh, record, save
from quantmla_lab.bench.kernels import decode_speed as bench
from quantmla_lab.bench.kernels import timing
from quantmla_lab.bench.kernels.decode_cuda_variants import MARKS
from quantmla_lab.bench.serving.step_overhead import replay_ms

capture = timing.capture_graph  # fn run once on a side stream (its builds and loads), then captured

D_N, D_C, D_R, D_V = 128, 512, 64, 128  # DeepSeek's q_nope, latent, RoPE and value widths


def parse_plan(text: str) -> dict:
    """'' or 'key=int,...' -> keywords: ``cuda.decode_plan``'s tiling keywords (lower case), or build macros of the
    plan (upper case, e.g. WS_REGS=0) under "macros"."""
    keys = ("token_blocks", "specialized", "ctas_per_sm")
    kw: dict = {}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        if not v.isdigit() or not (k in keys or (k.isupper() and k.replace("_", "").isalnum())):
            raise SystemExit(f"--plans {text!r}: write KEY=INT[,...] with KEY one of {', '.join(keys)} or a build "
                             "macro in upper case (e.g. WS_REGS=0), or '' for the default")
        if k.isupper():
            kw.setdefault("macros", {})[k] = int(v)
        else:
            kw[k] = bool(int(v)) if k == "specialized" else int(v)
    return kw


def parse_config(text: str) -> dict:
    """'' or 'key=int,...' -> ``schedule.cuda_config``'s keywords (tokens_m, ctas_per_sm, specialized, token_blocks)."""
    keys = ("tokens_m", "ctas_per_sm", "specialized", "token_blocks")
    kw: dict = {}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        if k not in keys or not v.isdigit():
            raise SystemExit(f"--configs {text!r}: write KEY=INT[,...] with KEY one of {', '.join(keys)}, or '' for "
                             "the API's own choice")
        kw[k] = bool(int(v)) if k in ("tokens_m", "specialized") else int(v)
    return kw


def parse_blocks(text: str) -> tuple[int, int] | None:
    """'' (the API's combine blocks) or 'RxD' -> (rows, channels) a combine program."""
    if not text:
        return None
    r, _, d = text.partition("x")
    if not (r.isdigit() and d.isdigit()) or not all(_pow2(int(x)) for x in (r, d)) or int(d) > D_C:
        raise SystemExit(f"--combine-blocks {text!r}: write ROWSxCHANNELS, powers of two with at most {D_C} channels "
                         "(e.g. 1x64), or '' for the API's")
    return int(r), int(d)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def combine_for(blocks: tuple[int, int] | None, max_splits: int) -> schedule.CombineShape | None:
    """The combine shape of `blocks` (rows, channels) for calls of up to `max_splits` splits, its splits a step as
    the API's rule gives them (``schedule.combine_step_splits``); None: the API's own shape."""
    if blocks is None:
        return None
    s = schedule.combine_step_splits(*blocks, max_splits)
    return schedule.CombineShape(*blocks, s, schedule.combine_one_step(max_splits, s))


def replay_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median µs of one replay over 5 groups of `reps` back-to-back replays."""
    return replay_ms(graph, 5 * reps) * 1e3


def plan_graphs(caches, md, lay, q_lat, q_rope, o_lat, lse, scale, H, dev, reps, **plan_kw) -> dict:
    """The tokens-as-M plan (``plan_kw`` its tiling) over every layer's cache in one graph: its decode kernel's µs a
    layer (no combine; one partials buffer for every layer, as the API's workspace), then its TIMELINE=1 build, each
    layer its own partials buffer for the marks, replayed once after warm-up replays: µs medians over the layers of
    the span (first entry to last end), the median CTA's lifetime, the gap to the next layer's first entry, the
    spread of entries and ends, and the SMs a layer's CTAs ran on."""
    macros = plan_kw.get("macros", {})
    plan = cuda.decode_plan(lay, H, torch.bfloat16, dev, tokens_m=True,
                            **{k: v for k, v in plan_kw.items() if k != "macros"})
    if plan is None:
        return {"plan_kw": plan_kw, "skipped": cuda.plan_reason.get(lay)}
    if macros:
        plan = dataclasses.replace(plan, macros=tuple(sorted({**dict(plan.macros), **macros}.items())))
    L = len(caches)
    po = torch.zeros(L, md.num_units, H, D_C, device=dev, dtype=cuda.partial_kind(plan))  # fp32, or fp16 partials
    plse = torch.empty(L, md.num_units, H, device=dev)

    def run(vp, own: bool):  # own: every layer its own partials buffer (the marks), else one for all (the API's)
        for l, c in enumerate(caches):
            k = l if own else 0
            args = (q_lat[l], q_rope[l], c.pages, None, None, c.block_table, c.seq_lens, md.units, o_lat[l], lse[l],
                    po[k], plse[k], c.block_table.stride(0), H, 1, H, 1, scale * api.LOG2E)
            cuda.launch_decode(vp, (md.num_units, md.head_blocks), args, dev)

    kernel_us = replay_us(capture(lambda: run(plan, False)), reps) / L
    vp = dataclasses.replace(plan, macros=tuple(sorted({**dict(plan.macros), "TIMELINE": 1}.items())))
    g = capture(lambda: run(vp, True))
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    nmark = len(MARKS)  # the kernel's NMARK: (globaltimer, clock64) pairs, entry first and the end last
    w = po.view(L, md.num_units, -1).view(torch.int64)[:, :, :2 * nmark + 2].cpu()  # marks, SM, tiles: 64-bit words
    entry, end = w[:, :, 0].double(), w[:, :, 2 * nmark - 2].double()  # ns
    first, last = entry.min(dim=1).values, end.max(dim=1).values
    med = lambda x: round(float(x.median()) / 1e3, 2)
    named = plan.describe() + "".join(f" {k}={v}" for k, v in macros.items())
    return {"plan_kw": plan_kw, "plan": named, "smem": plan.smem, "kernel_us": round(kernel_us, 2),
            "span_us": med(last - first), "cta_us": med((end - entry).median(dim=1).values),
            "gap_to_next_layer_us": med(first[1:] - last[:-1]) if L > 1 else None,
            "entry_skew_us": med(entry.max(dim=1).values - first), "end_skew_us": med(last - end.median(dim=1).values),
            "sms_median": float(torch.tensor([float(w[l, :, 2 * nmark].unique().numel()) for l in range(L)]).median())}


def time_call(a, caches, md, lay, m, B, n, spec, q_nope, q_rope, q_lat, o_lat, vals, lse, w_uk, w_uv, H, L,
              dev) -> dict:
    """One method, shape and config's row: its graphs of `L` layers replayed (µs a layer), and where the API chose
    the config and the combine blocks (`spec` and ``md.combine`` empty), the --plans timelines over its units."""
    scale = (D_N + D_R) ** -0.5

    def decode(l: int) -> None:
        c = caches[l]
        api.mla_decode_with_kvcache(q_lat[l], q_rope[l], c.pages, c.block_table, c.seq_lens, lay, scale,
                                    metadata=md, out=o_lat[l], lse=lse[l])

    def absorb_in(l: int) -> None:
        torch.bmm(q_nope[l].transpose(0, 1), w_uk[l], out=q_lat[l].transpose(0, 1))

    def absorb_out(l: int) -> None:
        torch.bmm(o_lat[l].transpose(0, 1), w_uv[l], out=vals[l].transpose(0, 1))

    decode(0)
    # the call's partials' workspace, as the API keeps it in the metadata (unsplit calls write none: the API
    # passes each call's own lse in its place)
    split = md.max_splits > 1
    po, plse = md.partials(H, D_C, partial_dtype(lay), caches[0].pages.device) if split else (None, None)

    def kernel(l: int) -> None:
        c = caches[l]
        pages, pc16, pr16 = api.page_views(c.pages, lay)  # the call's own views of the pages
        args = (q_lat[l], q_rope[l], pages, pc16, pr16, c.block_table, c.seq_lens, md.units, o_lat[l],
                lse[l], po if split else lse[l], plse if split else lse[l], c.block_table.stride(0), H, 1, H,
                1, scale * api.LOG2E)
        ran = launch_decode((md.head_blocks, md.num_units), args, lay, md.config)
        if ran != md.variant:
            raise SystemExit(f"{m}: the kernel alone ran {ran}, the call {md.variant}: not the same kernel")

    graphs = {
        "decode": capture(lambda: [decode(l) for l in range(L)]),
        "kernel": capture(lambda: [kernel(l) for l in range(L)]),
        "absorb": capture(lambda: [(absorb_in(l), absorb_out(l)) for l in range(L)]),
        "layer": capture(lambda: [(absorb_in(l), decode(l), absorb_out(l)) for l in range(L)]),
    }
    us = {k: replay_us(gr, a.reps) / L for k, gr in graphs.items()}
    row = {"method": m, "batch": B, "context": n, "config": spec, "units": md.num_units,
           "max_splits": md.max_splits, "variant": md.variant, "plan": md.config.describe(),
           "us_per_layer": {k: round(v, 2) for k, v in us.items()},
           "decode_between_products_us": round(us["layer"] - us["absorb"], 2),
           "combine_us": round(us["decode"] - us["kernel"], 2)}
    if a.timeline and not spec and md.combine is None and "/tm/" in (md.variant or ""):  # the API's own call only
        row["timeline"] = [plan_graphs(caches, md, lay, q_lat, q_rope, o_lat, lse, scale, H, dev, a.reps,
                                       **parse_plan(ps)) for ps in a.plans]
        for t in row["timeline"]:
            print(f"{'':10} timeline: {t}", flush=True)
    comb = f" combine {md.combine.block_r}x{md.combine.block_d}x{md.combine.block_s}" if md.combine else ""
    print(f"{m:10} {B}x{n:<6} {spec or 'api':>8}{comb} units {md.num_units:4}: decode call {us['decode']:6.2f} us "
          f"a layer (its kernel {us['kernel']:6.2f}), bmm pair {us['absorb']:6.2f}, layer {us['layer']:6.2f} "
          f"-> decode between the products {row['decode_between_products_us']:6.2f}", flush=True)
    del graphs
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["bf16", "fp8", "int4/int4", "int2/int4"])
    p.add_argument("--shapes", nargs="+", default=["1x2048", "8x2048"], help="BATCHxCONTEXT")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--reps", type=int, default=20, help="replays a timed group (5 groups, their median)")
    p.add_argument("--timeline", action="store_true", help="also the tokens-as-M kernel's CTA spans and the gaps "
                   "between layers, from its TIMELINE build in a graph of the layers")
    p.add_argument("--plans", nargs="+", default=[""], metavar="KEY=INT,...",
                   help="with --timeline, tokens-as-M plans to time and trace: '' the plan cuda.decode_plan gives "
                        "(for integer codes the warps apart, whatever the units), or its tiling keywords (token_blocks, "
                        "specialized, ctas_per_sm) and build macros in upper case, e.g. specialized=0 or WS_REGS=0")
    p.add_argument("--configs", nargs="+", default=[""], metavar="KEY=INT,...",
                   help="the decode configs each method and shape runs: '' the API's choice (get_mla_metadata's rules "
                        "for the units), or schedule.cuda_config's keywords (tokens_m, ctas_per_sm, specialized, "
                        "token_blocks), e.g. tokens_m=1,ctas_per_sm=2: that config as given, whatever the units")
    p.add_argument("--combine-blocks", nargs="+", default=[""], metavar="RxD",
                   help="the combine programs' blocks each config runs with where its sequences are split: '' the "
                        "API's (schedule.combine_blocks), or ROWSxCHANNELS, e.g. 1x64 (splits a step by the API's "
                        "rule)")
    p.add_argument("--out", default=None)
    a = parse_fresh(p) if argv is None else p.parse_args(argv)
    for spec in a.combine_blocks:
        parse_blocks(spec)
    for spec in a.plans:
        parse_plan(spec)
    for spec in a.configs:
        parse_config(spec)
    try:  # bad shapes and names reported before the device is touched
        shapes = bench.parse_shapes(",".join(a.shapes), "--shapes")
        methods = bench.parse_methods(",".join(a.methods))
    except QuantMLAError as e:
        raise SystemExit(str(e)) from None
    if a.layers < 1 or a.reps < 1:
        raise SystemExit("--layers and --reps must be positive")
    if not torch.cuda.is_available():
        raise SystemExit("decode_in_graph times CUDA graphs: it needs a CUDA device")
    dev, H, L = torch.device("cuda"), a.heads, a.layers
    res = record(heads=H, layers=L, reps=a.reps, groups=5, rows=[])
    g = torch.Generator(device=dev).manual_seed(0)
    w_uk = torch.randn(L, H, D_N, D_C, generator=g, device=dev).mul_(D_N ** -0.5).to(torch.bfloat16)
    w_uv = torch.randn(L, H, D_C, D_V, generator=g, device=dev).mul_(D_C ** -0.5).to(torch.bfloat16)
    for B, n in shapes:
        q_nope = torch.randn(L, B, H, D_N, generator=g, device=dev).to(torch.bfloat16)
        q_rope = torch.randn(L, B, H, D_R, generator=g, device=dev).to(torch.bfloat16)
        q_lat = torch.empty(L, B, H, D_C, device=dev, dtype=torch.bfloat16)
        o_lat = torch.empty(L, B, H, D_C, device=dev, dtype=torch.bfloat16)
        vals = torch.empty(L, B, H, D_V, device=dev, dtype=torch.bfloat16)
        lse = torch.empty(L, B, H, device=dev)
        for m in methods:
            lay = PageLayout(TokenLayout(D_C, D_R, preset(m)), 64)
            caches = [bench.Cache(lay, [n] * B, seed=1000 * l + B + n, device=dev) for l in range(L)]
            for spec in a.configs:
                cfg = schedule.cuda_config(H, lay, dev, **parse_config(spec)) if spec else None
                if spec and cfg is None:
                    why = cuda.plan_reason.get(lay)
                    print(f"{m:10} {B}x{n:<6} {spec}: no such CUDA config here ({why})")
                    res["rows"].append({"method": m, "batch": B, "context": n, "config": spec, "skipped": why})
                    continue
                md = api.get_mla_metadata(caches[0].seq_lens, H, 1, lay, config=cfg)
                for cb in a.combine_blocks if md.max_splits > 1 else [""]:
                    shape = combine_for(parse_blocks(cb), md.max_splits)
                    md = api.get_mla_metadata(caches[0].seq_lens, H, 1, lay, config=cfg, combine=shape)
                    row = time_call(a, caches, md, lay, m, B, n, spec, q_nope, q_rope, q_lat, o_lat, vals, lse, w_uk,
                                    w_uv, H, L, dev)
                    ran = shape or schedule.combine_shape(B, H, D_C, md.max_splits, schedule.num_sms_of(dev))
                    row["combine"] = {"blocks": cb or "api", **dataclasses.asdict(ran)} if md.max_splits > 1 else None
                    res["rows"].append(row)
                    save(res, a.out)
            del caches
            torch.cuda.empty_cache()
    save(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
