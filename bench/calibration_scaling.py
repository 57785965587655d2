"""Time and peak memory of layer-streamed calibration per layer, against d_c, heads and
calibration tokens; a cost model fitted to the measurements; projected wall time for
DeepSeek-V3 geometry.

    python bench/calibration_scaling.py                 # CPU sweep -> bench/results/calibration_scaling_cpu.json
    python bench/calibration_scaling.py --device cuda   # same on a GPU -> calibration_scaling_cuda.json
    python bench/calibration_scaling.py --quick         # three points (smoke test)

Each point writes a small synthetic deepseek_v3 checkpoint (3 layers: one dense, two MoE; random
weights) and calibrates it (method quantmla, ``--steps`` content Adam steps) with
``calibrate_streamed`` in a fresh process, so peak RSS is the run's own. Reported per layer (the
MoE layers' median): load, forward (which includes capturing the calibration data), fit (split
into the content fit, the RoPE search and the joint held-out check) and write seconds, peak RSS
above the process's RSS at the start of the run, captured-data bytes. Per-unit costs (seconds per
multiply-add of each part) are fitted across the sweep and projected to DeepSeek-V3 geometry.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

BASE = dict(hidden=1024, heads=16, d_c=256, d_r=64, d_n=128, d_v=128, q_lora=384, seqs=8, seq_len=256)
DSV3 = dict(hidden=7168, heads=128, d_c=512, d_r=64, d_n=128, d_v=128, q_lora=1536, layers=61, dense_layers=3,
            moe_layer_bytes_bf16=11.3e9, dense_layer_bytes_bf16=0.95e9)


def sweep(quick: bool) -> list[dict]:
    pts = []
    for d_c in (128, 256, 512):
        pts.append({**BASE, "d_c": d_c, "axis": "d_c"})
    for h in (8, 32, 64):
        pts.append({**BASE, "heads": h, "axis": "heads"})
    for n, s in ((8, 128), (8, 512), (16, 512)):
        pts.append({**BASE, "seqs": n, "seq_len": s, "axis": "tokens"})
    if quick:
        pts = [pts[0], pts[3], pts[6]]
    return pts


def _config(p: dict):
    from quantmla.model.tiny import tiny_config

    return tiny_config(
        "deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1, hidden_size=p["hidden"], intermediate_size=1024,
        moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=p["heads"],
        num_key_value_heads=p["heads"], kv_lora_rank=p["d_c"], q_lora_rank=p["q_lora"], qk_rope_head_dim=p["d_r"],
        qk_nope_head_dim=p["d_n"], v_head_dim=p["d_v"], vocab_size=1024, max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    )


def run_point(p: dict, steps: int, device: str, threads: int) -> dict:
    """One calibration in this (fresh) process; -> per-layer figures (median over the MoE layers)."""
    torch.set_num_threads(threads)
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.calibration import api
    from quantmla.calibration.stream import calibrate_streamed, rss_bytes, write_random_checkpoint

    # time calibrate's two path fits inside its per-layer fit_layer (benchmark-only instrumentation)
    split: dict[str, list[float]] = {"content": [], "rope": []}

    def timed(fn, key):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                split[key].append(time.perf_counter() - t)
        return wrapper

    api.fit_content, api.fit_rope = timed(api.fit_content, "content"), timed(api.fit_rope, "rope")

    with tempfile.TemporaryDirectory(prefix="qmla-scal-") as tmp:
        info = write_random_checkpoint(_config(p), os.path.join(tmp, "src"), seed=0)
        ids = torch.randint(3, 1024, (p["seqs"], p["seq_len"]), generator=torch.Generator().manual_seed(0))
        base_rss = rss_bytes()
        t0 = time.perf_counter()
        rep = calibrate_streamed(os.path.join(tmp, "src"), os.path.join(tmp, "out"), ids,
                                 QuantCacheConfig.of_bits(2, 4, 64, 32), method="quantmla", seed=0, device=device,
                                 fit_kwargs={"steps": steps})
        wall = time.perf_counter() - t0
        secs = []
        for i in (1, 2):
            with open(os.path.join(tmp, "out", ".quantmla_stream", f"layer-{i:05d}.json")) as f:
                secs.append(json.load(f)["fit"][str(i)]["seconds"])
    layers = [s for s in rep.layers if s.layer >= 1]  # the MoE layers
    med = lambda k: statistics.median(getattr(s, k) for s in layers)  # noqa: E731
    return {
        "steps": steps, "wall_s": wall, "model_bytes": info["bytes"], "moe_layer_bytes": layers[0].weight_bytes,
        "load_s": med("load_s"), "forward_s": med("forward_s"), "fit_s": med("fit_s"), "write_s": med("write_s"),
        "capture_s": statistics.median(x["capture"] for x in secs),
        "content_fit_s": statistics.median(split["content"][1:]),  # the MoE layers (slots 1, 2)
        "rope_fit_s": statistics.median(split["rope"][1:]),
        "joint_eval_s": statistics.median(x["fit"] for x in secs) - statistics.median(split["content"][1:])
                        - statistics.median(split["rope"][1:]),
        "peak_rss_over_start_bytes": max(s.peak_rss_bytes for s in layers) - rep.start_rss_bytes,
        "peak_rss_over_baseline_bytes": max(s.peak_rss_bytes for s in layers) - base_rss,
        "captured_bytes": max(s.captured_bytes for s in layers), "activation_bytes": layers[0].activation_bytes,
        "device_peak_bytes": max(s.device_peak_bytes for s in layers),
        "layers": [{k: getattr(s, k) for k in ("layer", "load_s", "forward_s", "fit_s", "write_s", "peak_rss_bytes",
                                                 "captured_bytes", "weight_bytes")} for s in rep.layers],
    }


# ---- cost model -------------------------------------------------------------------------------
def step_work(p: dict, batch: int = 4, s_q: int = 64) -> float:
    """Multiply-adds of one forward of the content objective (attention output of the sampled
    queries of a 4-sequence minibatch, after o_proj, plus the latent transform)."""
    L, H, dc, dr, h = p["seq_len"], p["heads"], p["d_c"], p["d_r"], p["hidden"]
    return batch * s_q * H * (L * (2 * dc + dr) + dc * h) + batch * L * 2 * dc * dc


def capture_work(p: dict, s_q: int = 64) -> float:
    """Multiply-adds of capturing one layer's calibration data: the attention weighting of the
    sampled queries and the per-token RoPE outer products, over all sequences."""
    L, H, dc, dr = p["seq_len"], p["heads"], p["d_c"], p["d_r"]
    return p["seqs"] * H * (s_q * L * (2 * dc + dr) + L * dr * dr)


def rope_keys(p: dict) -> int:
    return p["seqs"] * min(128, p["seq_len"])


def fit_model(points: list[dict]) -> dict:
    """Per-unit costs, as medians over the sweep (and their spread, which says how well the unit
    predicts the time): content fit s per step-MAC, RoPE search s per kept key (d_r fixed at 64),
    capture s per capture-MAC, forward s per forward-MAC (the forward's time net of the capture)."""
    def stat(vals):
        vals = sorted(vals)
        return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1]}

    r = [(pt, pt["runs"][0]) for pt in points]
    return {
        "content_s_per_step_mac": stat([x["content_fit_s"] / (x["steps"] * step_work(pt)) for pt, x in r]),
        "rope_s_per_key": stat([x["rope_fit_s"] / rope_keys(pt) for pt, x in r]),
        "capture_s_per_mac": stat([x["capture_s"] / capture_work(pt) for pt, x in r]),
        "forward_s_per_mac": stat([(x["forward_s"] - x["capture_s"])
                                   / (pt["seqs"] * pt["seq_len"] * forward_macs_per_token(pt, **SYNTH_MOE)) for pt, x in r]),
        "load_gb_per_s": stat([x["moe_layer_bytes"] / max(x["load_s"], 1e-9) / 1e9 for pt, x in r]),
        "write_gb_per_s": stat([x["moe_layer_bytes"] / max(x["write_s"], 1e-9) / 1e9 for pt, x in r]),
    }


def forward_macs_per_token(p: dict, active_experts: int, moe_inter: int) -> float:
    """Multiply-adds per token of one MoE decoder layer's forward: the MLA projections, causal
    attention over the sequence (heads expanded, as transformers computes it), the active experts
    (routed + shared) and the router."""
    h, H, dc, dr, dn, dv, ql = p["hidden"], p["heads"], p["d_c"], p["d_r"], p["d_n"], p["d_v"], p["q_lora"]
    attn = h * ql + ql * H * (dn + dr) + h * (dc + dr) + dc * H * (dn + dv) + H * dv * h
    scores = p["seq_len"] / 2 * H * (dn + dr + dv)
    return attn + scores + active_experts * 3 * h * moe_inter + p.get("experts", 8) * h


SYNTH_MOE = dict(active_experts=3, moe_inter=256)  # 2 routed + 1 shared of 8, as _config builds
DSV3_MOE = dict(active_experts=9, moe_inter=2048)  # 8 routed + 1 shared of 256

# Rates assumed for the H200 projections (not measured here: the team's GPU budget was spent).
ASSUMED = {
    "gpu_forward_tflops": 30.0,  # effective fp32 (TF32 matmuls, eager attention, grouped-mm MoE) on an H200
    "gpu_fit_tflops": 50.0,  # the content objective's einsums in TF32 with the fit on the GPU (fit_kwargs device="cuda")
    "gpu_rope_search_s": 5.0,  # the RoPE closed-form/grid/Adam search per layer on a GPU (launch-bound)
    "host_cpu_gflops_per_rank": 400.0,  # fp32, 16 cores of the H200 host per rank, for the fit as implemented (CPU)
    "nvme_read_gbps": 3.0,  # reading a layer's bf16 shard
    "nvme_write_gbps": 2.0,  # writing it back
}


def simulate(n_layers: int, ranks: int, stream_s: float, fit_s: float, streamer_fits: bool) -> float:
    """Wall time of the distributed schedule: rank 0 streams every layer; each layer's owner
    (round-robin) fits and writes it; sends block until the owner is free."""
    fitters = list(range(ranks)) if (streamer_fits or ranks == 1) else list(range(1, ranks))
    free = {r: 0.0 for r in range(ranks)}
    t0 = 0.0
    for i in range(n_layers):
        t0 += stream_s
        r = fitters[i % len(fitters)]
        if r == 0:
            t0 += fit_s
        else:
            start = max(t0, free[r])  # rank 0 waits in send until the owner receives
            t0 = start
            free[r] = start + fit_s
    return max([t0] + list(free.values()))


def project(model: dict, seqs: int, seq_len: int, steps: int = 200) -> dict:
    """Projected wall time of calibrating DeepSeek-V3 geometry (61 layers; every layer counted as a
    MoE layer, 11.3 GB in bf16) with `seqs` x `seq_len` calibration tokens and `steps` content steps."""
    p = {**DSV3, "seqs": seqs, "seq_len": seq_len}
    m = {k: v["median"] for k, v in model.items()}
    L = DSV3["layers"]
    tokens = seqs * seq_len
    content_mac = steps * step_work(p)  # forward MACs; the measured unit includes the backward
    fwd_mac = tokens * forward_macs_per_token(p, **DSV3_MOE)
    cap_mac = capture_work(p)
    layer_b = DSV3["moe_layer_bytes_bf16"]
    here_fit_gflops = 2 * 3 / m["content_s_per_step_mac"] / 1e9  # fwd + bwd ≈ 3 forwards, 2 flops per MAC
    scen = {}
    # 1) this machine, measured unit costs (CPU, fp32)
    cpu = {"stream_s": layer_b / (m["load_gb_per_s"] * 1e9) + m["forward_s_per_mac"] * fwd_mac + m["capture_s_per_mac"] * cap_mac,
           "fit_s": m["content_s_per_step_mac"] * content_mac + m["rope_s_per_key"] * rope_keys(p)
                    + layer_b / (m["write_gb_per_s"] * 1e9)}
    scen["this_cpu_measured_rates"] = cpu
    # 2) H200 host, fit on the host CPU (calibrate's default device)
    a = ASSUMED
    gpu_stream = layer_b / (a["nvme_read_gbps"] * 1e9) + (2 * fwd_mac + 2 * cap_mac) / (a["gpu_forward_tflops"] * 1e12)
    cpu_ratio = a["host_cpu_gflops_per_rank"] / here_fit_gflops
    scen["h200_fit_on_host_cpu"] = {
        "stream_s": gpu_stream,
        "fit_s": (m["content_s_per_step_mac"] * content_mac + m["rope_s_per_key"] * rope_keys(p)) / cpu_ratio
                 + layer_b / (a["nvme_write_gbps"] * 1e9)}
    # 3) H200 with the fit on the GPU (calibrate(device="cuda"), fit_kwargs={"device": "cuda"})
    scen["h200_fit_on_gpu"] = {
        "stream_s": gpu_stream,
        "fit_s": 6 * content_mac / (a["gpu_fit_tflops"] * 1e12) + a["gpu_rope_search_s"] + layer_b / (a["nvme_write_gbps"] * 1e9)}
    out = {"content_forward_gmac_per_step": step_work(p) / 1e9, "forward_gmac_per_layer": fwd_mac / 1e9,
           "capture_gmac_per_layer": cap_mac / 1e9, "rope_keys": rope_keys(p), "measured_fit_gflops_here": here_fit_gflops}
    for name, sc in scen.items():
        row = {"stream_s_per_layer": sc["stream_s"], "fit_write_s_per_layer": sc["fit_s"]}
        for g in (1, 8):
            best = min(simulate(L, g, sc["stream_s"], sc["fit_s"], True), simulate(L, g, sc["stream_s"], sc["fit_s"], False))
            row[f"wall_h_{g}"] = best / 3600
        out[name] = row
    return out


def markdown(res: dict) -> str:
    """The sweep as a markdown table (for docs/scaling.md)."""
    mib = 2**20
    rows = ["| axis | d_c | heads | tokens (seqs x len) | load s | forward s (capture) | content fit s | RoPE search s | "
            "write s | peak RSS over start MiB | captured MiB | MoE layer MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for pt in res["points"]:
        r = pt["runs"][0]
        rows.append(f"| {pt['axis']} | {pt['d_c']} | {pt['heads']} | {pt['seqs']}x{pt['seq_len']} | {r['load_s']:.2f} | "
                    f"{r['forward_s']:.1f} ({r['capture_s']:.1f}) | {r['content_fit_s']:.1f} | {r['rope_fit_s']:.1f} | "
                    f"{r['write_s']:.2f} | {r['peak_rss_over_start_bytes'] / mib:.0f} | {r['captured_bytes'] / mib:.1f} | "
                    f"{r['moe_layer_bytes'] / mib:.1f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=20, help="content Adam steps per layer (calibrate's default: 200)")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None, metavar="JSON", help="print the markdown table of a results file and exit")
    ap.add_argument("--reproject", default=None, metavar="JSON", help="refit the cost model / projection of a results file")
    ap.add_argument("--dsv3-point", default=None, metavar="JSON",
                    help="add one point with DeepSeek-V3's attention geometry (hidden 7168, 128 heads, d_c 512, "
                         "q-LoRA 1536; small MoE; 4x128 tokens; --steps content steps) to a results file, with the "
                         "cost model's prediction for it")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(markdown(json.load(f)))
        return 0
    if args.dsv3_point:
        from quantmla.calibration.distributed import spawn_call

        with open(args.dsv3_point) as f:
            res = json.load(f)
        p = {**BASE, "hidden": 7168, "heads": 128, "d_c": 512, "q_lora": 1536, "seqs": 4, "seq_len": 128, "axis": "dsv3_attention"}
        code, r = spawn_call(run_point, p, args.steps, args.device, args.threads)
        if code != 0:
            raise SystemExit(f"DeepSeek-V3 attention point failed with exit code {code}")
        m = {k: v["median"] for k, v in res["cost_model"].items()}
        pred = {"content_fit_s": m["content_s_per_step_mac"] * args.steps * step_work(p),
                "rope_fit_s": m["rope_s_per_key"] * rope_keys(p), "capture_s": m["capture_s_per_mac"] * capture_work(p)}
        res["dsv3_attention_point"] = {**p, "runs": [r], "predicted": pred, "step_mac": step_work(p)}
        with open(args.dsv3_point, "w") as f:
            json.dump(res, f, indent=1)
        print(json.dumps({k: v for k, v in r.items() if k != "layers"}, indent=1), json.dumps(pred, indent=1))
        return 0
    if args.reproject:  # refit the cost model and the projection of an existing results file
        with open(args.reproject) as f:
            res = json.load(f)
        res["cost_model"] = fit_model(res["points"])
        res["projection_dsv3"] = {name: project(res["cost_model"], n, sl)
                                  for name, (n, sl) in {"16x512": (16, 512), "64x1024": (64, 1024)}.items()}
        res["assumed_h200_rates"] = ASSUMED
        with open(args.reproject, "w") as f:
            json.dump(res, f, indent=1)
        print(json.dumps({"cost_model": res["cost_model"], "projection_dsv3": res["projection_dsv3"]}, indent=1))
        return 0
    from quantmla.calibration.distributed import spawn_call

    kind = "cpu" if args.device == "cpu" else "cuda"
    out = args.out or os.path.join(HERE, "results", f"calibration_scaling_{kind}.json")
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
               "torch": torch.__version__, "load_average_start": os.getloadavg(),
               "device_name": torch.cuda.get_device_name(0) if kind == "cuda" else platform.processor()}
    points = []
    for p in sweep(args.quick):
        code, r = spawn_call(run_point, p, args.steps, args.device, args.threads)
        if code != 0:
            raise SystemExit(f"point {p} failed with exit code {code}")
        print(f"{p['axis']:>6} d_c={p['d_c']:4d} H={p['heads']:3d} tokens={p['seqs']}x{p['seq_len']:<4d}: "
              f"load {r['load_s']:.2f}s forward {r['forward_s']:.2f}s (capture {r['capture_s']:.2f}s) "
              f"fit {r['fit_s']:.2f}s (content {r['content_fit_s']:.2f}s, RoPE {r['rope_fit_s']:.2f}s) "
              f"write {r['write_s']:.2f}s peak RSS +{r['peak_rss_over_start_bytes'] / 2**20:.0f} MiB, "
              f"captured {r['captured_bytes'] / 2**20:.1f} MiB", flush=True)
        points.append({**p, "runs": [r], "step_mac": step_work(p), "capture_mac": capture_work(p), "rope_keys": rope_keys(p)})
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out + ".partial", "w") as f:
            json.dump({"machine": machine, "steps": args.steps, "points": points}, f, indent=1)
    machine["load_average_end"] = os.getloadavg()
    model = fit_model(points)
    proj = {name: project(model, n, sl) for name, (n, sl) in {"16x512": (16, 512), "64x1024": (64, 1024)}.items()}
    res = {"machine": machine, "steps": args.steps, "points": points, "cost_model": model,
           "projection_dsv3": proj, "dsv3_geometry": DSV3, "assumed_h200_rates": ASSUMED}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({"cost_model": model, "projection_dsv3": proj}, indent=1))
    if os.path.exists(out + ".partial"):
        os.remove(out + ".partial")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
