"""The cost model of layer-streamed calibration (:mod:`quantmla_lab.bench.calibration.scaling`): the
geometry of DeepSeek-V3 and of the synthetic sweep layers, multiply-adds per part of a layer's work,
per-unit costs fitted across a sweep, and projected wall time and GPU memory for DeepSeek-V3 on 1
and 8 GPUs; the sweep as a markdown table."""

from __future__ import annotations

import statistics

# DeepSeek-V3's geometry (every layer after the first three a MoE layer)
DSV3 = {"hidden": 7168, "heads": 128, "d_c": 512, "d_r": 64, "d_n": 128, "d_v": 128, "q_lora": 1536, "layers": 61,
        "dense_layers": 3, "experts": 256, "routed": 8, "shared": 1, "moe_inter": 2048, "dense_inter": 18432}


def attention_params(p: dict) -> int:
    h, H, dc, dr, dn, dv, ql = p["hidden"], p["heads"], p["d_c"], p["d_r"], p["d_n"], p["d_v"], p["q_lora"]
    return h * ql + ql + ql * H * (dn + dr) + h * (dc + dr) + dc + dc * H * (dn + dv) + H * dv * h


def moe_layer_params(p: dict) -> int:
    """Parameters of one MoE decoder layer: attention, routed + shared experts, router, norms."""
    return attention_params(p) + (p["experts"] + p["shared"]) * 3 * p["hidden"] * p["moe_inter"] \
        + p["experts"] * p["hidden"] + 2 * p["hidden"]


# DeepSeek-V3: 11.5 G parameters per MoE layer, i.e. 23 GB in bf16 (11.5 GB in the FP8 release)
DSV3["moe_layer_bytes_bf16"] = 2 * moe_layer_params(DSV3)
DSV3["attention_bytes_bf16"] = 2 * attention_params(DSV3)


def moe_of(p: dict) -> dict:
    """Active experts and their width (for the forward's multiply-adds); old result files lack the keys."""
    return {"active_experts": p.get("routed", 2) + p.get("shared", 1), "moe_inter": p.get("moe_inter", 256)}


def step_work(p: dict, batch: int = 4, s_q: int = 64) -> float:
    """Multiply-adds of one forward of the content objective (attention output of the sampled
    queries of a 4-sequence minibatch, after o_proj, plus the latent transform)."""
    L, H, dc, dr, h = p["seq_len"], p["heads"], p["d_c"], p["d_r"], p["hidden"]
    s_q = min(s_q, L)
    return batch * s_q * H * (L * (2 * dc + dr) + dc * h) + batch * L * 2 * dc * dc


def capture_work(p: dict, s_q: int = 64) -> float:
    """Multiply-adds of capturing one layer's calibration data: the attention weighting of the
    sampled queries and the per-token RoPE outer products, over all sequences."""
    L, H, dc, dr = p["seq_len"], p["heads"], p["d_c"], p["d_r"]
    s_q = min(s_q, L)
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
        "forward_s_per_mac": stat([max(x["forward_s"] - x["capture_s"], 0.0)
                                   / (pt["seqs"] * pt["seq_len"] * forward_macs_per_token(pt, **moe_of(pt))) for pt, x in r]),
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


DSV3_MOE = moe_of(DSV3)  # 8 routed + 1 shared of 256, 2048 wide

# Rates assumed for the H200 projections (the cost-model projection; the measured projection uses
# only the NVMe rates).
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
    MoE layer, 23 GB in bf16) with `seqs` x `seq_len` calibration tokens and `steps` content steps,
    from the cost model's unit costs and the assumed rates."""
    p = {**DSV3, "seqs": seqs, "seq_len": seq_len}
    m = {k: v["median"] for k, v in model.items()}
    L = DSV3["layers"]
    content_mac = steps * step_work(p)  # forward MACs; the measured unit includes the backward
    fwd_mac = seqs * seq_len * forward_macs_per_token(p, **DSV3_MOE)
    cap_mac = capture_work(p)
    layer_b = DSV3["moe_layer_bytes_bf16"]
    here_fit_gflops = 2 * 3 / m["content_s_per_step_mac"] / 1e9  # fwd + bwd ≈ 3 forwards, 2 flops per MAC
    scen = {}
    # 1) this machine, measured unit costs
    here = {"stream_s": layer_b / (m["load_gb_per_s"] * 1e9) + m["forward_s_per_mac"] * fwd_mac + m["capture_s_per_mac"] * cap_mac,
            "fit_s": m["content_s_per_step_mac"] * content_mac + m["rope_s_per_key"] * rope_keys(p)
                     + layer_b / (m["write_gb_per_s"] * 1e9)}
    scen["this_machine_measured_rates"] = here
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


def project_measured(pt: dict, rates: dict | None = None) -> dict:
    """61 DeepSeek-V3 layers on 1 and 8 GPUs from the measured DeepSeek-V3-geometry layer `pt`:
    its compute (forward with capture, content fit, RoPE search, joint check) as measured (same
    attention geometry, tokens and steps; DeepSeek-V3's active MoE compute per token), the real
    layer's bytes (23 GB bf16) read and written at the assumed NVMe rates (the measured read and
    write were of a page-cached 1.9 GB shard: reported, not used), every layer counted as a MoE
    layer. GPU memory: the measured peak with the real layer's fp32 weights in place of the
    synthetic layer's."""
    a = {**ASSUMED, **(rates or {})}
    r = pt["runs"][0]
    L = DSV3["layers"]
    real_b = DSV3["moe_layer_bytes_bf16"]
    read_s, write_s = real_b / (a["nvme_read_gbps"] * 1e9), real_b / (a["nvme_write_gbps"] * 1e9)
    compute_fit = r["content_fit_s"] + r["rope_fit_s"] + r["joint_eval_s"]
    stream_s = read_s + r["forward_s"]  # the forward includes the capture
    fit_s = compute_fit + write_s
    io_floor = L * (read_s + write_s)  # one NVMe array shared by all ranks: reads and writes of every layer
    out = {"settings": {"tokens": f"{pt['seqs']}x{pt['seq_len']}", "content_steps": r["steps"], "fit_device": r.get("fit_device")},
           "per_layer_s": {"read_23GB": read_s, "forward_with_capture": r["forward_s"], "capture": r["capture_s"],
                           "content_fit": r["content_fit_s"], "rope_search": r["rope_fit_s"], "joint_check": r["joint_eval_s"],
                           "write_23GB": write_s, "stream": stream_s, "fit_and_write": fit_s},
           "measured_io_page_cache_gb_per_s": {"read": r["moe_layer_file_bytes"] / max(r["load_s"], 1e-9) / 1e9,
                                               "write": r["moe_layer_file_bytes"] / max(r["write_s"], 1e-9) / 1e9},
           "assumed": {k: a[k] for k in ("nvme_read_gbps", "nvme_write_gbps")}, "io_floor_h": io_floor / 3600}
    for g in (1, 8):
        sim = min(simulate(L, g, stream_s, fit_s, True), simulate(L, g, stream_s, fit_s, False))
        out[f"wall_h_{g}"] = max(sim, io_floor) / 3600
        out[f"wall_h_{g}_compute_only"] = min(simulate(L, g, r["forward_s"], compute_fit, True),
                                             simulate(L, g, r["forward_s"], compute_fit, False)) / 3600
    if "device_peak_bytes" in r and r.get("device_name"):
        synth_fp32 = r["moe_layer_bytes"]  # the synthetic layer as loaded (fp32)
        real_fp32, attn_fp32 = 2 * real_b, 2 * DSV3["attention_bytes_bf16"]
        out["gpu_memory_gb"] = {
            "measured_layer_peak": r["device_peak_bytes"] / 1e9, "measured_fit_peak": r["device_fit_peak_bytes"] / 1e9,
            "measured_fit_temporaries": r["device_fit_temporaries_bytes"] / 1e9,
            # rank 0 (streams, and fits its share) holds the whole fp32 layer
            "streaming_rank_peak": (r["device_peak_bytes"] - synth_fp32 + real_fp32) / 1e9,
            # a fitting-only rank holds the layer's attention weights, the captured data and the fit's temporaries
            "fitting_rank_peak": (r["device_fit_temporaries_bytes"] + r["captured_bytes"] + attn_fp32) / 1e9,
            "gpu_total": r["device_total_bytes"] / 1e9,
        }
    return out


def markdown(res: dict) -> str:
    """The sweep as a markdown table (for docs/scaling.md)."""
    mib = 2**20
    pts = list(res["points"]) + ([res["dsv3_point"]] if res.get("dsv3_point") else [])
    gpu = any("device_fit_peak_bytes" in pt["runs"][0] for pt in pts)
    head = ("| axis | d_c | heads | tokens (seqs x len) | load s | forward s (capture) | content fit s | RoPE search s | "
            "write s | peak RSS over start MiB | captured MiB | MoE layer MiB |")
    rows = [head + (" GPU peak MiB | GPU fit peak MiB |" if gpu else ""), "|---" * (14 if gpu else 12) + "|"]
    for pt in pts:
        r = pt["runs"][0]
        row = (f"| {pt['axis']} | {pt['d_c']} | {pt['heads']} | {pt['seqs']}x{pt['seq_len']} | {r['load_s']:.2f} | "
               f"{r['forward_s']:.2f} ({r['capture_s']:.2f}) | {r['content_fit_s']:.2f} | {r['rope_fit_s']:.2f} | "
               f"{r['write_s']:.2f} | {r['peak_rss_over_start_bytes'] / mib:.0f} | {r['captured_bytes'] / mib:.1f} | "
               f"{r['moe_layer_bytes'] / mib:.1f} |")
        if gpu:
            row += f" {r.get('device_peak_bytes', 0) / mib:.0f} | {r.get('device_fit_peak_bytes', 0) / mib:.0f} |"
        rows.append(row)
    return "\n".join(rows)
