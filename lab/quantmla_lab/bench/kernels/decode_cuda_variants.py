"""Which build-time knobs of the CUDA decode kernel pay on this GPU? Times one decode call (CUDA-graph
replay, L2 flushed) of the default plan and of variants that change one constant each: build-loop and
score-loop unrolling, cp.async stages, CTAs per SM, and the tiling (warps per CTA, tokens per tile,
warps sharing a score tile's channels). `--phases` times the default plan without its tile build, score
products or output products (results wrong, times only). Same tokens and queries for every variant.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --out out/decode_cuda_variants.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys

import torch

from quantmla.cache.layout import PageLayout, TokenLayout, preset
from quantmla.errors import QuantMLAError
from quantmla.kernels import api, cuda, schedule
from quantmla.kernels.partials import partials_setting
from quantmla_lab.bench.kernels import decode_speed as bench
from quantmla_lab.bench.kernels import timing
from quantmla_lab.bench.common import save


TILINGS = ((8, 32), (16, 32), (16, 64), (8, 64))  # (warps per CTA, tokens per tile); the first is the default


def knob_variants(plan: cuda.DecodePlan, layout: PageLayout, phases: bool = False) -> dict[str, cuda.DecodePlan]:
    """The default plan with one build-time knob changed: score-loop unrolling or cp.async stages; with
    `phases`, instead the plan with the tile build, the score products or the output products left out."""
    m = dict(plan.macros)

    def with_(**kw) -> cuda.DecodePlan:
        return dataclasses.replace(plan, macros=tuple(sorted({**m, **kw}.items())))

    out = {"qk_unroll_6": with_(QK_UNROLL=6), "qk_unroll_2": with_(QK_UNROLL=2)}
    if phases:  # timing only (wrong results): a phase's share of a call is the default's time less these
        return {"no_build": with_(SKIP_BUILD=1),
                "no_scores": with_(SKIP_QK=1), "no_output": with_(SKIP_PV=1),
                "no_build_scores_output": with_(SKIP_BUILD=1, SKIP_QK=1, SKIP_PV=1)}
    for st in (2, 3, 4):
        if st != plan.stages:
            smem = cuda.smem_bytes(layout, plan.block_m, st, m["KSPLIT"], plan.block_n)
            if plan.ctas_per_sm * (smem + cuda.SMEM_RESERVED) <= cuda.SMEM_PER_SM:
                out[f"stages_{st}"] = dataclasses.replace(with_(STAGES=st, SMEM_EXPECTED=smem), stages=st, smem=smem)
    return out


OCCUPANCY = (  # (name, tokens per tile, CTAs per SM, stages, query fragments in registers)
    ("bn32_c2_qsmem", 32, 2, 4, False), ("bn16_c2", 16, 2, 4, True), ("bn16_c3_qsmem", 16, 3, 3, False),
    ("bn16_c3_s2_qsmem", 16, 3, 2, False), ("bn16_c4_qsmem", 16, 4, 2, False))


def occupancy_variants(plan: cuda.DecodePlan, layout: PageLayout) -> dict[str, tuple[cuda.DecodePlan, int, int]]:
    """The default 16-row plan at other tile sizes and CTAs per SM (more warps per SM to hide latency, where
    registers and shared memory allow: the query fragments read from shared memory every tile instead of
    kept in registers): name -> (plan, tokens per tile, CTAs per SM). Timing experiments (the API does not
    take them): each runs over work units scheduled for its own tile and CTAs per SM."""
    m = dict(plan.macros)
    out = {}
    for name, bn, ctas, stages, qreg in OCCUPANCY:
        smem = cuda.smem_bytes(layout, plan.block_m, stages, m["KSPLIT"], bn)
        if ctas * (smem + cuda.SMEM_RESERVED) > cuda.SMEM_PER_SM:
            continue
        mac = {**m, "BN": bn, "MIN_CTAS": ctas, "STAGES": stages, "SMEM_EXPECTED": smem}
        if not qreg:
            mac["QREG_MAX"] = 0
        out[name] = (dataclasses.replace(plan, macros=tuple(sorted(mac.items())), stages=stages, ctas_per_sm=ctas,
                                         smem=smem), bn, ctas)
    return out


# the tokens-as-M kernel's TIMELINE marks (mla_decode_tm.cu): each figure is the time from the mark before (in the
# earlier prologue, QUERY_WARP_ROWS=0 at 56f03e6, the second and third marks are its first barrier and the query
# pieces summed)
MARKS = ("entry", "query_loads", "first_copies", "query_block", "first_tile", "tiles", "epilogue")
# its PHASES of the tile loop (thread 0's clocks summed over the tiles): the copy's wait, the scores, the vote, the
# copy issue and the output products, P
PHASES = ("copy_wait", "scores", "vote", "output", "probabilities")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int4/int4,bf16")
    ap.add_argument("--shapes", default="1x131072,32x16384")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tilings", default=",".join(f"{w}x{n}" for w, n in TILINGS), help="warps x tokens per tile")
    ap.add_argument("--knobs", action="store_true", help="also the unrolling and stage variants of the default plan")
    ap.add_argument("--phases", action="store_true",
                    help="also the default plan without its build, score or output products (timing only)")
    ap.add_argument("--occupancy", action="store_true",
                    help="also the default plan at 16-token tiles and 3 or 4 CTAs per SM (decode kernel alone)")
    ap.add_argument("--tokens-m", action="store_true",
                    help="also the tokens-as-M kernel (mla_decode_tm.cu): the whole call and its decode kernel alone")
    ap.add_argument("--warpgroup", action="store_true",
                    help="first the API's default kernel, then the heads-as-M kernel on warpgroup MMAs (BF16, 64+ rows)")
    ap.add_argument("--timeline", action="store_true",
                    help="with --tokens-m: each CTA's clocks through one call (prologue, first tile, tiles, epilogue)")
    ap.add_argument("--flush", choices=("write", "read"), default="write",
                    help="L2 emptied before each timed call by zeroing (do_bench) or by reading a 256 MB buffer")
    ap.add_argument("--variants", nargs="*", default=[], metavar="MACRO=V[,MACRO=V]",
                    help="with --tokens-m or --warpgroup: other builds of its plan (e.g. TPW=1, S_CHAINS=2), timed beside "
                         "it, their outputs compared with its")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    H, dev = a.heads, torch.device("cuda")
    timing.FLUSH = a.flush
    res = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": bench.source_commit(), "partials": partials_setting(),
        "command": " ".join(sys.argv), "flush": a.flush, "rows": []}
    tilings = [tuple(int(x) for x in t.split("x")) for t in a.tilings.split(",") if t]  # ("": none)
    scale = 0.07
    for name in a.formats.split(","):
        lay = PageLayout(TokenLayout(512, 64, bench.METHODS[name] if name in bench.METHODS else preset(name)), 64)
        for shape in a.shapes.split(","):
            B, L = (int(x) for x in shape.split("x"))
            c = bench.Cache(lay, [L] * B, seed=B + L)
            qc = torch.randn(B, 1, H, 512, device=dev).to(torch.bfloat16)
            qr = torch.randn(B, 1, H, 64, device=dev).to(torch.bfloat16)
            out = torch.empty_like(qc)
            lse = torch.empty(B, 1, H, device=dev)
            ref = None

            def row(vname, us, plan, **kw):
                res["rows"].append({"format": name, "batch": B, "context": L, "variant": vname, "us": us,
                                    "plan": plan.describe() if plan else None,
                                    "macros": dict(plan.macros) if plan else None, **kw})
                print(f"{name:10s} {B}x{L:<7d} {vname:22s} {us or float('nan'):8.1f} us  {kw}", flush=True)
                save(res, a.out)  # every row as it comes: a later failure keeps the rows before it

            def time_call(md) -> tuple[float, float]:
                """One decode call through the public API (schedule, decode and combine) over md's units, into a
                NaN-poisoned output: (µs, largest difference from the first config's output)."""
                nonlocal ref

                def run():
                    api.mla_decode_with_kvcache(qc, qr, c.pages, c.block_table, c.seq_lens, lay, scale, metadata=md,
                                                out=out, lse=lse)

                out.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                if ref is None:
                    ref = out.float().clone()
                diff = float((out.float() - ref).abs().max())
                return timing.time_ms(run, 25, 100)[0] * 1e3, diff

            def time_decode(vp: cuda.DecodePlan, vmd, outputs: list | None = None) -> float:
                """The decode kernel of plan vp alone (no combine) over vmd's units, µs; with `outputs`, what one
                run writes (the unsplit rows' output and the split units' partials, both zeroed first) is appended."""
                po = torch.zeros(vmd.num_units, H, 512, device=dev, dtype=cuda.partial_kind(vp))
                pl = torch.empty(vmd.num_units, H, device=dev)
                args = (qc, qr, c.pages, None, None, c.block_table, c.seq_lens, vmd.units, out, lse, po, pl,
                        c.block_table.stride(0), H, 1, H, 1, scale * 1.4426950408889634)
                launch = lambda: cuda.launch_decode(vp, (vmd.num_units, vmd.head_blocks), args, dev)  # noqa: E731
                if outputs is not None:
                    out.zero_()
                    launch()
                    torch.cuda.synchronize()
                    outputs.append((out.float().clone(), po.clone()))
                t, _ = timing.time_ms(launch, 25, 100)
                return t * 1e3

            def timeline(plan: cuda.DecodePlan, vmd, phases: bool = False) -> dict:
                """One call of the plan built with TIMELINE=1 (each CTA's clocks at the kernel's NMARK marks, MARKS):
                medians and extremes, µs (clock64 at the SM clock that globaltimer gives over the whole CTA). With
                `phases` (PHASES=1), also thread 0's clocks summed over the tile loop's PHASES, median over CTAs."""
                extra = {"TIMELINE": 1, **({"PHASES": 1} if phases else {})}
                vp = dataclasses.replace(plan, macros=tuple(sorted({**dict(plan.macros), **extra}.items())))
                po = torch.zeros(vmd.num_units, H, 512, device=dev, dtype=cuda.partial_kind(vp))
                pl = torch.empty(vmd.num_units, H, device=dev)
                args = (qc, qr, c.pages, None, None, c.block_table, c.seq_lens, vmd.units, out, lse, po, pl,
                        c.block_table.stride(0), H, 1, H, 1, scale * 1.4426950408889634)
                for _ in range(3):
                    timing.flush_l2()
                    cuda.launch_decode(vp, (vmd.num_units, vmd.head_blocks), args, dev)
                torch.cuda.synchronize()
                n = len(MARKS)
                words = po.view(vmd.num_units, -1).view(torch.int64)  # 64-bit words, whatever the partials' dtype
                w = words[:, :2 * n + 2].cpu()
                gt, ck = w[:, 0:2 * n:2].double(), w[:, 1:2 * n:2].double()
                ghz = float(((ck[:, -1] - ck[:, 0]) / (gt[:, -1] - gt[:, 0]).clamp(min=1)).median())  # cycles per ns
                us = lambda x: x / ghz / 1e3  # noqa: E731
                med = lambda x: float(x.median())  # noqa: E731
                start = (gt[:, 0] - gt[:, 0].min()) / 1e3
                end = (gt[:, -1] - gt[:, 0].min()) / 1e3
                res = {"clock_GHz": ghz, "ctas": vmd.num_units, "sms": int(w[:, 2 * n].unique().numel()),
                       "tiles_per_unit_median": med(w[:, 2 * n + 1].double()),
                       "start_us_median": med(start), "start_us_max": float(start.max()),
                       "end_us_median": med(end), "end_us_max": float(end.max())}
                for i in range(1, n):
                    res[f"{MARKS[i]}_us_median"] = us(med(ck[:, i] - ck[:, i - 1]))
                res["cta_us_median"] = us(med(ck[:, -1] - ck[:, 0]))
                res["cta_us_max"] = us(float((ck[:, -1] - ck[:, 0]).max()))
                if phases:
                    pw = words[:, 2 * n + 2:2 * n + 2 + len(PHASES)]
                    for i, name in enumerate(PHASES):
                        res[f"loop_{name}_us_median"] = us(med(pw[:, i].cpu().double()))
                return res

            if a.warpgroup:  # the API's default (the reference for the differences), then heads as the wgmma's M
                tflop = schedule.decode_flops([L] * B, H, 1, 512, 64) / 1e12
                dcfg = api.default_config(H, lay, dev)
                md = api.get_mla_metadata(c.seq_lens, H, 1, lay, config=dcfg)
                us, diff = time_call(md)
                row("api_default", us, None, config=dcfg.describe(), variant_ran=md.variant, units=md.num_units,
                    tflops=tflop / us * 1e6)
                cfg = schedule.cuda_config(H, lay, dev, warpgroup=True)
                if cfg is None:
                    row("warpgroup", None, None, skipped=cuda.plan_reason.get(lay))
                else:
                    plan = cuda.decode_plan(lay, H, torch.bfloat16, dev, warpgroup=True)
                    md = api.get_mla_metadata(c.seq_lens, H, 1, lay, config=cfg)
                    us, diff = time_call(md)
                    row("warpgroup", us, plan, units=md.num_units, max_abs_diff_vs_first=diff, variant_ran=md.variant,
                        tflops=tflop / us * 1e6)
                    base: list = []
                    us = time_decode(plan, md, base)
                    row("warpgroup_decode", us, plan, decode_only=True, units=md.num_units, tflops=tflop / us * 1e6)
                    for spec in a.variants:  # other builds of the plan (e.g. S_CHAINS=2, SKIP_QK=1): decode time, outputs
                        kw = {k: int(v) for k, v in (x.split("=") for x in spec.split(","))}
                        vp = dataclasses.replace(plan, macros=tuple(sorted({**dict(plan.macros), **kw}.items())))
                        got: list = []
                        try:
                            us = time_decode(vp, md, got)
                        except QuantMLAError as e:  # a build this layout does not take (its source rejects the macro)
                            row(f"warpgroup_{spec}_decode", None, vp, skipped=str(e).splitlines()[-1][:200])
                            continue
                        rel = max(float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp(min=1e-30))
                                  for x, y in zip(got[0], base[0]))  # fp32: the partials may be fp16
                        row(f"warpgroup_{spec}_decode", us, vp, decode_only=True, units=md.num_units,
                            max_rel_diff_vs_default=rel, tflops=tflop / us * 1e6)
            for nw, bn in tilings:
                cfg = schedule.cuda_config(H, lay, dev, num_warps=nw, block_n=bn)
                if cfg is None:
                    row(f"w{nw}_n{bn}", None, None, skipped=cuda.plan_reason.get(lay))
                    continue
                plan = cuda.decode_plan(lay, H, torch.bfloat16, dev, num_warps=nw, block_n=bn)
                md = api.get_mla_metadata(c.seq_lens, H, 1, lay, config=cfg)
                us, diff = time_call(md)
                row(f"w{nw}_n{bn}", us, plan, units=md.num_units, max_abs_diff_vs_first=diff)
                if (a.knobs or a.phases) and (nw, bn) == tilings[0]:
                    for vname, vp in knob_variants(plan, lay, phases=a.phases).items():
                        row(vname, time_decode(vp, md), vp, decode_only=True)
                if a.occupancy and (nw, bn) == tilings[0]:
                    for vname, (vp, vbn, vctas) in occupancy_variants(plan, lay).items():
                        vmd = api.get_mla_metadata(c.seq_lens, H, 1, lay, config=dataclasses.replace(
                            cfg, block_n=vbn, ctas_per_sm=vctas))
                        row(vname, time_decode(vp, vmd), vp, decode_only=True, units=vmd.num_units)
            if a.tokens_m:  # tokens as the MMA's M dimension: the whole call, then its decode kernel alone
                cfg = schedule.cuda_config(H, lay, dev, tokens_m=True)
                if cfg is None:
                    row("tokens_m", None, None, skipped=cuda.plan_reason.get(lay))
                    continue
                plan = cuda.decode_plan(lay, H, torch.bfloat16, dev, tokens_m=True)
                md = api.get_mla_metadata(c.seq_lens, H, 1, lay, config=cfg)
                us, diff = time_call(md)
                row("tokens_m", us, plan, units=md.num_units, max_abs_diff_vs_first=diff, variant_ran=md.variant)
                base: list = []
                row("tokens_m_decode", time_decode(plan, md, base), plan, decode_only=True, units=md.num_units)
                for spec in a.variants:  # other builds of the plan: decode time, and how far their outputs are
                    kw = {k: int(v) for k, v in (x.split("=") for x in spec.split(","))}
                    vp, vmd = plan, md  # TPW=1 or 2, WS=1, CTAS=1 or 2: that plan (its own shared-memory map and
                    if {"TPW", "WS", "CTAS"} & kw.keys():  # units), then the other macros
                        vp = cuda.tokens_m_plan(lay, H, torch.bfloat16, ctas_per_sm=kw.pop("CTAS", 2),
                                                blocks_per_warp=kw.pop("TPW", 1 if kw.get("WS") else
                                                                       dict(plan.macros).get("TPW", 1)),
                                                specialized=bool(kw.pop("WS", 0)))
                        assert not isinstance(vp, str), vp
                        if vp.ctas_per_sm != plan.ctas_per_sm or dict(vp.macros).get("WS"):  # the whole call too
                            vcfg = dataclasses.replace(cfg, ctas_per_sm=vp.ctas_per_sm,
                                                       specialized=bool(dict(vp.macros).get("WS")),
                                                       token_blocks=dict(vp.macros).get("TPW", 1))
                            vmd = api.get_mla_metadata(c.seq_lens, H, 1, lay, config=vcfg)
                            us_c, diff_c = time_call(vmd)
                            row(f"tokens_m_{spec}", us_c, vp, units=vmd.num_units, max_abs_diff_vs_first=diff_c,
                                variant_ran=vmd.variant)
                    vp = dataclasses.replace(vp, macros=tuple(sorted({**dict(vp.macros), **kw}.items())))
                    got: list = []
                    us_v = time_decode(vp, vmd, got)
                    rel = max(float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp(min=1e-30))
                              for x, y in zip(got[0], base[0])) if vmd is md else None  # fp32: partials may be fp16
                    row(f"tokens_m_{spec}_decode", us_v, vp, decode_only=True, units=vmd.num_units,
                        max_rel_diff_vs_default=rel)
                    if a.timeline:
                        row(f"tokens_m_{spec}_timeline", None, vp, **timeline(vp, md))
                        if dict(vp.macros)["ONE_BARRIER"] and not dict(vp.macros).get("WS"):  # (thread 0's loop)
                            row(f"tokens_m_{spec}_phases", None, vp, **timeline(vp, md, phases=True))
                if not a.timeline:  # the phase, stage and occupancy variants
                    m = dict(plan.macros)
                    for vname, kw in (("tokens_m_no_scores", dict(SKIP_QK=1)), ("tokens_m_no_output", dict(SKIP_PV=1)),
                                      ("tokens_m_no_products", dict(SKIP_QK=1, SKIP_PV=1))):  # times only: results wrong
                        vp = dataclasses.replace(plan, macros=tuple(sorted({**m, **kw}.items())))
                        row(vname, time_decode(vp, md), vp, decode_only=True, units=md.num_units)
                    pb = cuda.TM_P_BUFFERS if m["ONE_BARRIER"] else 1
                    # every other stage count that fits: does the copy pipeline wait on DRAM, or on the stages?
                    for st in range(cuda.TM_MIN_STAGES if pb == 2 else 2, cuda.TM_MAX_STAGES + 1):
                        smem = cuda.smem_bytes_tm(lay, st, pb, m.get("TPW", 1), specialized=bool(m.get("WS")))
                        if st == plan.stages or plan.ctas_per_sm * (smem + cuda.SMEM_RESERVED) > cuda.SMEM_PER_SM:
                            continue
                        vp = dataclasses.replace(plan, macros=tuple(sorted({**m, "STAGES": st, "SMEM_EXPECTED": smem}.items())),
                                                 stages=st, smem=smem)
                        row(f"tokens_m_stages_{st}", time_decode(vp, md), vp, decode_only=True, units=md.num_units)
                        vp = dataclasses.replace(vp, macros=tuple(sorted({**dict(vp.macros), "SKIP_QK": 1, "SKIP_PV": 1}.items())))
                        row(f"tokens_m_stages_{st}_no_products", time_decode(vp, md), vp, decode_only=True, units=md.num_units)
                if a.timeline:
                    row("tokens_m_timeline", None, plan, **timeline(plan, md))
                    if dict(plan.macros)["ONE_BARRIER"] and not dict(plan.macros).get("WS"):  # thread 0's tile loop
                        row("tokens_m_phases", None, plan, **timeline(plan, md, phases=True))
                        vp = dataclasses.replace(plan, macros=tuple(sorted({**dict(plan.macros), "SKIP_QK": 1,
                                                                            "SKIP_PV": 1}.items())))
                        row("tokens_m_no_products_phases", None, vp, **timeline(vp, md, phases=True))
                    # the loop with a second barrier after P (one P buffer), at the most stages that fit (where
                    # the plan has one barrier a tile, and such stages fit two CTAs an SM)
                    tpw = dict(plan.macros).get("TPW", 1)
                    st = max((s for s in range(cuda.TM_MIN_STAGES, cuda.TM_MAX_STAGES + 1)
                              if 2 * (cuda.smem_bytes_tm(lay, s, 1, tpw) + cuda.SMEM_RESERVED) <= cuda.SMEM_PER_SM),
                             default=None)
                    if not dict(plan.macros)["ONE_BARRIER"] or dict(plan.macros).get("WS") or st is None:
                        continue
                    smem = cuda.smem_bytes_tm(lay, st, 1, tpw)
                    vp = dataclasses.replace(plan, macros=tuple(sorted({**dict(plan.macros), "ONE_BARRIER": 0, "STAGES": st,
                                                                        "SMEM_EXPECTED": smem}.items())), stages=st, smem=smem)
                    row("tokens_m_two_barriers_decode", time_decode(vp, md), vp, decode_only=True, units=md.num_units)
                    row("tokens_m_two_barriers_timeline", None, vp, **timeline(vp, md))
                p3 = cuda.tokens_m_plan(lay, H, torch.bfloat16, ctas_per_sm=3, specialized=False)
                if not a.timeline and not isinstance(p3, str):  # three CTAs per SM (registers capped at 168, fewer stages)
                    md3 = api.get_mla_metadata(c.seq_lens, H, 1, lay, config=dataclasses.replace(cfg, ctas_per_sm=3,
                                                                                                  num_stages=p3.stages))
                    row("tokens_m_c3_decode", time_decode(p3, md3), p3, decode_only=True, units=md3.num_units)
    save(res, a.out)


if __name__ == "__main__":
    main()
