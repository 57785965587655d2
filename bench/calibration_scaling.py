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
    from quantmla.calibration.stream import calibrate_streamed, rss_bytes, write_random_checkpoint

    with tempfile.TemporaryDirectory(prefix="qmla-scal-") as tmp:
        info = write_random_checkpoint(_config(p), os.path.join(tmp, "src"), seed=0)
        ids = torch.randint(3, 1024, (p["seqs"], p["seq_len"]), generator=torch.Generator().manual_seed(0))
        base_rss = rss_bytes()
        t0 = time.perf_counter()
        rep = calibrate_streamed(os.path.join(tmp, "src"), os.path.join(tmp, "out"), ids,
                                 QuantCacheConfig.of_bits(2, 4, 64, 32), method="quantmla", seed=0, device=device,
                                 fit_kwargs={"steps": steps})
        wall = time.perf_counter() - t0
        split = []
        for i in (1, 2):
            with open(os.path.join(tmp, "out", ".quantmla_stream", f"layer-{i:05d}.json")) as f:
                split.append(json.load(f)["fit"][str(i)]["seconds"])
    layers = [s for s in rep.layers if s.layer >= 1]  # the MoE layers
    med = lambda k: statistics.median(getattr(s, k) for s in layers)  # noqa: E731
    return {
        "steps": steps, "wall_s": wall, "model_bytes": info["bytes"], "moe_layer_bytes": layers[0].weight_bytes,
        "load_s": med("load_s"), "forward_s": med("forward_s"), "fit_s": med("fit_s"), "write_s": med("write_s"),
        "capture_s": statistics.median(x["capture"] for x in split),
        "content_fit_s": statistics.median(x["content"] for x in split),
        "rope_fit_s": statistics.median(x["rope"] for x in split),
        "joint_eval_s": statistics.median(x["joint"] for x in split),
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
    capture s per capture-MAC, forward s per (token x layer byte)."""
    def stat(vals):
        vals = sorted(vals)
        return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1]}

    r = [(pt, pt["runs"][0]) for pt in points]
    return {
        "content_s_per_step_mac": stat([x["content_fit_s"] / (x["steps"] * step_work(pt)) for pt, x in r]),
        "rope_s_per_key": stat([x["rope_fit_s"] / rope_keys(pt) for pt, x in r]),
        "capture_s_per_mac": stat([x["capture_s"] / capture_work(pt) for pt, x in r]),
        "forward_s_per_token_byte": stat([(x["forward_s"] - x["capture_s"]) / (pt["seqs"] * pt["seq_len"] * x["moe_layer_bytes"])
                                          for pt, x in r]),
        "load_gb_per_s": stat([x["moe_layer_bytes"] / max(x["load_s"], 1e-9) / 1e9 for pt, x in r]),
        "write_gb_per_s": stat([x["moe_layer_bytes"] / max(x["write_s"], 1e-9) / 1e9 for pt, x in r]),
    }


def project(model: dict, seqs: int, seq_len: int, steps: int, fit_speedup: float, fwd_speedup: float,
            load_gbps: float, ranks: int, dtype_bytes: int = 4) -> dict:
    """Projected DeepSeek-V3 wall time. Every layer is loaded (bf16 on disk, computed in fp32) and
    forwarded on the streaming rank, which also captures; fits go round-robin over `ranks`."""
    p = {**DSV3, "seqs": seqs, "seq_len": seq_len}
    m = {k: v["median"] for k, v in model.items()}
    fit = (m["content_s_per_step_mac"] * steps * step_work(p) + m["rope_s_per_key"] * rope_keys(p)) / fit_speedup
    cap = m["capture_s_per_mac"] * capture_work(p) / fwd_speedup
    layer_bytes = [DSV3["dense_layer_bytes_bf16"]] * DSV3["dense_layers"] + \
                  [DSV3["moe_layer_bytes_bf16"]] * (DSV3["layers"] - DSV3["dense_layers"])
    load = sum(b / (load_gbps * 1e9) for b in layer_bytes)
    # forward cost per token x byte measured in fp32 bytes; the checkpoint is bf16 (x2 in fp32)
    fwd = sum(m["forward_s_per_token_byte"] * seqs * seq_len * b * dtype_bytes / 2 for b in layer_bytes) / fwd_speedup
    L = DSV3["layers"]
    stream = load + fwd + L * cap
    if ranks == 1:
        wall = stream + L * fit
    else:  # rank 0 streams and fits its share; the other ranks fit theirs meanwhile
        wall = max(stream + (L / ranks) * fit, (L / ranks) * fit + stream / L)
    return {"fit_s_per_layer": fit, "capture_s_per_layer": cap, "load_s_total": load, "forward_s_total": fwd,
            "wall_s": wall, "wall_h": wall / 3600}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=20, help="content Adam steps per layer (calibrate's default: 200)")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
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
    load_gbps = model["load_gb_per_s"]["median"]
    proj = {}
    for name, (seqs, seq_len) in {"cli_default_16x512": (16, 512), "64x1024": (64, 1024)}.items():
        proj[name] = {"this_machine_1proc": project(model, seqs, seq_len, 200, 1.0, 1.0, load_gbps, 1)}
    res = {"machine": machine, "steps": args.steps, "points": points, "cost_model": model,
           "projection_dsv3": proj, "dsv3_geometry": DSV3}
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
