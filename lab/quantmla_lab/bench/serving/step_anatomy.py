"""Host vs GPU time of serving steps, and prefill-attention variants (H200 diagnosis for issue #6).

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.step_anatomy --out $OUT/step_anatomy_h200.json

Part 1: runs a small cache-pressured job (v2-lite geometry, random weights) per method and, for every
step, records (through an engine observer) the host seconds until its GPU work was all launched (model
forward returned or graph replayed) and until the sampled tokens reached the host, split by step kind
(CUDA-graph decode / mixed). A step whose launch time is close to its total is host-bound.
Part 2: one prefill chunk's attention (n queries over T cached tokens, 16 heads, d_c 512, d_r 64) as
per-head values, timed with CUDA events and checked against an fp64 reference, by: the absorbed form
in plain matmuls (the engine's prefill path before the prefill kernel), the engine's prefill kernel
(``mla_prefill_attention`` after the ``kv_b_proj`` up-projection, per tiling config) and SDPA on the
up-projected K/V with a lower-right causal mask.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import dataclasses

from quantmla.kernels.api import PrefillConfig, default_prefill_config, mla_prefill_attention
from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.graphs import EngineObserver
from quantmla.serving.scheduler import Request, SamplingParams
from quantmla_lab.bench.common import launch_ms, record, save
from quantmla_lab.bench.serving.throughput import build_bench_model, method_config


def anatomy(model, method, a):
    q = method_config(method, 128, 64)
    e = Engine(model, EngineConfig(quant=q, kv_budget_bytes=int(a.budget_gib * (1 << 30)), max_num_batched_tokens=8192,
                                   max_model_len=a.prompt + a.new + 8))
    g = torch.Generator().manual_seed(0)
    warm = [Request(f"w{i}", torch.randint(3, 1000, (300,), generator=g).tolist(), SamplingParams(max_new_tokens=4, ignore_eos=True))
            for i in range(3)]
    e.generate(warm)
    e.capture_graphs()
    reqs = [Request(i, torch.randint(3, 100000, (a.prompt,), generator=g).tolist(),
                    SamplingParams(max_new_tokens=a.new, ignore_eos=True)) for i in range(a.requests)]
    rec = {"mixed": [], "decode": []}

    class Steps(EngineObserver):
        def step_end(self, timing):
            plan = timing.plan
            kind = "decode" if plan.is_decode else "mixed"
            rec[kind].append({"total": timing.total_s, "launch": timing.launch_s, "tokens": sum(it.n for it in plan.items),
                              "rows": len(plan.items)})

    e.observers.append(Steps())
    t = time.perf_counter()
    e.generate(reqs)
    wall = time.perf_counter() - t
    e.close()
    res = {"method": method, "format": q.describe(), "wall_s": wall, "pages": e.num_pages}
    for k, rows in rec.items():
        if not rows:
            continue
        res[k] = {"steps": len(rows), "total_ms_median": 1e3 * statistics.median(r["total"] for r in rows),
                  "total_ms_sum": 1e3 * sum(r["total"] for r in rows),
                  "tokens_median": statistics.median(r["tokens"] for r in rows)}
        la = [r["launch"] for r in rows if r["launch"] is not None]
        if la:
            res[k]["launch_ms_median"] = 1e3 * statistics.median(la)
    return res


def absorbed_matmul(q_lat, q_rope, latent, k_rope, scale):
    """The absorbed form in plain matmuls (scores materialized, masked, softmaxed): o_latent [n, H, d_c]."""
    n, H, dc = q_lat.shape
    T = latent.shape[0]
    kc, kr = latent.to(q_lat.dtype), k_rope.to(q_lat.dtype)
    sc = torch.addmm(kc.new_empty(()), q_lat.reshape(-1, dc), kc.T, beta=0, alpha=scale)
    sc.addmm_(q_rope.reshape(-1, kr.shape[-1]), kr.T, alpha=scale)
    causal = torch.ones(n, n, dtype=torch.bool, device=sc.device).triu_(1)
    sc.view(n, H, T)[:, :, T - n:].masked_fill_(causal[:, None, :], float("-inf"))
    return (torch.softmax(sc, dim=-1) @ kc).view(n, H, dc)


def nonabsorbed(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale):
    """n queries (the last n of T positions) over T tokens, as per-head values [n, H, d_v]."""
    from torch.nn.attention.bias import causal_lower_right

    n, H, dn = q_nope.shape
    T = latent.shape[0]
    dt = q_nope.dtype
    k_nope = torch.einsum("tc,hnc->htn", latent.to(dt), w_uk)
    v = torch.einsum("tc,hvc->htv", latent.to(dt), w_uv)
    k = torch.cat([k_nope, k_rope.to(dt)[None].expand(H, T, -1)], -1)
    q = torch.cat([q_nope, q_rope], -1).transpose(0, 1)
    dq, dv = q.shape[-1], v.shape[-1]
    if dv < dq:
        v = torch.nn.functional.pad(v, (0, dq - dv))
    o = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal_lower_right(n, T),
                                                         scale=scale)
    return o[0, :, :, :dv].transpose(0, 1)


PREFILL_CONFIGS = [PrefillConfig(), PrefillConfig(128, 32, 8, 2), PrefillConfig(64, 64, 4, 2), PrefillConfig(128, 64, 8, 3),
                   PrefillConfig(64, 32, 4, 3), PrefillConfig(128, 128, 8, 2)]


def prefill_variants(a):
    dev = "cuda"
    H, dc, dr, dn, dvv = 16, 512, 64, 128, 128
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    w_uk = (torch.randn(H, dn, dc, device=dev, generator=g) / dc ** 0.5).bfloat16()
    w_uv = (torch.randn(H, dvv, dc, device=dev, generator=g) / dc ** 0.5).bfloat16()
    scale = (dn + dr) ** -0.5
    for n, T in a.prefill_shapes:
        q_nope = torch.randn(n, H, dn, device=dev, generator=g).bfloat16()
        q_rope = torch.randn(n, H, dr, device=dev, generator=g).bfloat16()
        lat = torch.randn(T, dc, device=dev, generator=g)
        kr = torch.randn(T, dr, device=dev, generator=g)
        q_lat = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)
        # fp64 reference values
        qd, qrd, ld, krd = q_lat.double(), q_rope.double(), lat.bfloat16().double(), kr.bfloat16().double()
        ref = []
        for s in range(0, n, 256):
            e_ = min(n, s + 256)
            sc = (torch.einsum("nhc,tc->nht", qd[s:e_], ld) + torch.einsum("nhr,tr->nht", qrd[s:e_], krd)) * scale
            pos = torch.arange(T - n + s, T - n + e_, device=dev)
            sc.masked_fill_(torch.arange(T, device=dev)[None, None, :] > pos[:, None, None], float("-inf"))
            o = torch.einsum("nht,tc->nhc", torch.softmax(sc, -1), ld)
            ref.append(torch.einsum("nhc,hvc->nhv", o, w_uv.double()))
        ref = torch.cat(ref)
        w_kv = torch.cat([w_uk, w_uv], 1).reshape(H * (dn + dvv), dc)  # kv_b_proj's weight
        fa = lambda: torch.einsum("nhc,hvc->nhv", absorbed_matmul(q_lat, q_rope, lat.bfloat16(), kr, scale), w_uv)
        fb = lambda: nonabsorbed(q_nope, q_rope, lat, kr, w_uk, w_uv, scale)

        def kernel(cfg):
            kv = (lat.bfloat16() @ w_kv.T).view(T, H, dn + dvv)
            return mla_prefill_attention(q_nope, q_rope, kv, kr.bfloat16(), scale, config=cfg)

        variants = [] if a.kernel_only else [("absorbed_matmul", fa), ("nonabsorbed_sdpa", fb)]
        base = default_prefill_config(n, T)  # the default tiling, with and without its unmasked key blocks apart
        configs = [base, dataclasses.replace(base, split_diagonal=False)] + (
            [] if a.kernel_only else [c for c in PREFILL_CONFIGS if c != base])
        if a.prefill_configs:  # the default tiling, then the ones asked for
            configs = [base] + [PrefillConfig.parse(c) for c in a.prefill_configs]
        variants += [(f"prefill_kernel {c.describe()}", lambda c=c: kernel(c)) for c in configs]
        row = {"n": n, "T": T, "flops": 2 * H * (dn + dr + dvv) * sum(min(T, T - n + i + 1) for i in range(n))}
        for name, f in variants:
            try:
                out = f()
                torch.cuda.synchronize()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                ms = launch_ms(f, 10, warmup=2)
                row[name] = {"ms": ms, "TFLOPs": row["flops"] / ms / 1e9, "rel_err": err}
            except Exception as err:
                row[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["bf16", "int4/int4", "int2/int4"])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prompt", type=int, default=1536)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--budget-gib", type=float, default=0.125)
    p.add_argument("--skip-anatomy", action="store_true")
    p.add_argument("--prefill-shapes", nargs="+", type=lambda x: tuple(int(v) for v in x.split("x")),
                   default=[(1536, 1536), (2048, 2048), (512, 2048), (8192, 8192)],
                   help="prefill chunks as NxT (n queries, the last of T context tokens)")
    p.add_argument("--prefill-configs", nargs="+", default=None,
                   help="prefill tilings to time beside the default, e.g. 'M128 N128 w8 s2' 'M64 N64 w4 s3'")
    p.add_argument("--kernel-only", action="store_true",
                   help="only the prefill kernel's default tiling, with and without its unmasked key blocks apart")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    res = record(settings=vars(a))
    res["prefill_attention"] = prefill_variants(a)
    if not a.skip_anatomy:
        model = build_bench_model("v2-lite", "cuda", torch.bfloat16, 0)
        res["anatomy"] = []
        for m in a.methods:
            r = anatomy(model, m, a)
            res["anatomy"].append(r)
            print(json.dumps(r), flush=True)
    save(res, a.out)


if __name__ == "__main__":
    main()
