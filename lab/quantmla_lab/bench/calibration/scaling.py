"""Time and peak memory of layer-streamed calibration per layer, against d_c, heads and
calibration tokens; a cost model fitted to the measurements; projected wall time for
DeepSeek-V3 geometry on 1 and 8 GPUs.

    python -m quantmla_lab.bench.calibration.scaling          # CPU sweep -> lab/results/calibration_scaling/cpu.json
    python -m quantmla_lab.bench.calibration.scaling --quick  # tiny shapes, a few seconds per point (smoke test)
    # one H200, at most ~4 minutes (GPU memory from torch.cuda.max_memory_allocated):
    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.calibration.scaling --device cuda --in-process --with-dsv3 \\
        --time-limit 220 --out calibration_scaling_cuda.json

Each sweep point writes a small synthetic deepseek_v3 checkpoint (3 layers: one dense, two MoE;
on a GPU just the two MoE layers; random weights) and calibrates it (method quantmla, ``--steps``
content Adam steps) with ``calibrate_streamed``; in a fresh process by default (so peak RSS is the run's own), or in this
process with ``--in-process`` (no per-point start-up; what a time-limited GPU run wants). Reported
per layer (the MoE layers' median): load, forward (which includes capturing the calibration data),
fit (split into the content fit, the RoPE search and the joint held-out check) and write seconds,
peak RSS above the process's RSS at the start of the run, captured-data bytes and, on a GPU, the
layer's peak GPU memory (``torch.cuda.max_memory_allocated``, reset per layer) and the fit's own.
With ``--device cuda`` the fit runs on the GPU too (``--fit-device`` to change), and GPU timings are
synchronized.

``--with-dsv3`` measures one layer at DeepSeek-V3 geometry first: attention exactly as DeepSeek-V3
(hidden 7168, 128 heads, d_c 512, d_r 64, d_n = d_v = 128, q-LoRA 1536), a MoE with DeepSeek-V3's
*active* compute per token (8 routed + 1 shared experts of 2048) but 16 instead of 256 routed
experts (so the layer is 1.9 GB instead of 23 GB), bf16 source weights, ``--dsv3-tokens``
calibration tokens (default 16x512, the CLI's) and ``--dsv3-steps`` content steps (default 200,
calibrate's). From it, the 61-layer run is projected on 1 and 8 GPUs (``projection_dsv3_measured``):
compute from the measurement, reading / writing the real 23 GB bf16 layers at the assumed NVMe rates,
GPU memory with the real layer's weights in place of the synthetic one's.

``--time-limit`` stops in time: points that would not fit are skipped, a running one is interrupted
(``--in-process``: SIGALRM; otherwise its process is killed) and everything measured so far is
written. Per-unit costs (seconds per multiply-add of each part) are fitted across the sweep and
projected to DeepSeek-V3 geometry as well (``projection_dsv3``, with assumed H200 rates).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time

import torch

from quantmla_lab.bench.calibration.scaling_model import (
    ASSUMED,
    DSV3,
    capture_work,
    fit_model,
    markdown,
    project,
    project_measured,
    rope_keys,
    step_work,
)
from quantmla_lab.bench.common import save

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "results")  # lab/results

# synthetic MoE of the sweep: 8 experts of 256, 2 routed + 1 shared active; dense layer 1024 wide
SWEEP_MOE = {"experts": 8, "routed": 2, "shared": 1, "moe_inter": 256, "dense_inter": 1024, "layers": 3,
             "dense_layers": 1, "source_dtype": "float32"}
BASE = dict(hidden=1024, heads=16, d_c=256, d_r=64, d_n=128, d_v=128, q_lora=384, seqs=8, seq_len=256, **SWEEP_MOE)
# tiny shapes for --quick (a smoke test of every code path, on a CPU in seconds per point)
TINY = dict(hidden=128, heads=4, d_c=32, d_r=16, d_n=16, d_v=16, q_lora=48, seqs=4, seq_len=32,
            **{**SWEEP_MOE, "experts": 4, "moe_inter": 32, "dense_inter": 64})


def sweep(quick: bool, cuda: bool) -> list[dict]:
    """The sweep, in the order it runs: the base point first, then each axis's far end, then the
    rest (so a time-limited run covers every axis early)."""
    base = TINY if quick else BASE
    if cuda:  # two MoE layers (no dense layer: its fit would only cost time)
        base = {**base, "layers": 2, "dense_layers": 0}
    if quick:
        return [{**base, "axis": "d_c"}, {**base, "heads": 8, "axis": "heads"}, {**base, "seqs": 6, "seq_len": 64, "axis": "tokens"}]
    pts = [{**base, "axis": "d_c"}, {**base, "d_c": 512, "axis": "d_c"}, {**base, "heads": 64, "axis": "heads"},
           {**base, "seqs": 16, "seq_len": 512, "axis": "tokens"}, {**base, "d_c": 128, "axis": "d_c"},
           {**base, "heads": 8, "axis": "heads"}, {**base, "heads": 32, "axis": "heads"},
           {**base, "seq_len": 128, "axis": "tokens"}, {**base, "seq_len": 512, "axis": "tokens"}]
    if cuda:  # further out on each axis, if the time limit leaves room
        pts += [{**base, "heads": 128, "axis": "heads"}, {**base, "d_c": 1024, "axis": "d_c"},
                {**base, "seqs": 32, "seq_len": 1024, "axis": "tokens"}]
    return pts


def dsv3_point(quick: bool, tokens: str, steps: int) -> dict:
    n, s = (int(x) for x in tokens.lower().split("x"))
    moe = {"experts": 16, "routed": 8, "shared": 1, "moe_inter": 2048, "dense_inter": 1024, "layers": 1,
           "dense_layers": 0, "source_dtype": "bfloat16"}
    if quick:  # the same layout at toy size
        p = {**TINY, "hidden": 256, "heads": 8, "d_c": 64, "q_lora": 96, "experts": 4, "routed": 2, "moe_inter": 64,
             "layers": 1, "dense_layers": 0, "source_dtype": "bfloat16", "seqs": min(n, 4), "seq_len": min(s, 32)}
    else:
        p = {**{k: DSV3[k] for k in ("hidden", "heads", "d_c", "d_r", "d_n", "d_v", "q_lora")}, **moe, "seqs": n, "seq_len": s}
    return {**p, "axis": "dsv3", "steps": steps}


def _config(p: dict):
    from quantmla.model.tiny import tiny_config

    p = {**SWEEP_MOE, **p}
    return tiny_config(
        "deepseek_v3", num_hidden_layers=p["layers"], first_k_dense_replace=p["dense_layers"], hidden_size=p["hidden"],
        intermediate_size=p["dense_inter"], moe_intermediate_size=p["moe_inter"], n_routed_experts=p["experts"],
        n_shared_experts=p["shared"], num_experts_per_tok=p["routed"], num_attention_heads=p["heads"],
        num_key_value_heads=p["heads"], kv_lora_rank=p["d_c"], q_lora_rank=p["q_lora"], qk_rope_head_dim=p["d_r"],
        qk_nope_head_dim=p["d_n"], v_head_dim=p["d_v"], vocab_size=1024, max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    )


# ---- one point ----------------------------------------------------------------------------------
_PROBE: dict = {"split": {"content": [], "rope": []}, "fit_mem": [], "cuda": False}


def _sync() -> None:
    if _PROBE["cuda"]:
        torch.cuda.synchronize()


@contextlib.contextmanager
def _timed(step: str):
    """A step of calibrate's per-layer work (ProjectFitter.timer): on a GPU synchronized before and after
    (so that its time includes its kernels); the two path fits ("content", "rope") timed."""
    _sync()
    t = time.perf_counter()
    try:
        yield
    finally:
        _sync()
        if step in _PROBE["split"]:
            _PROBE["split"][step].append(time.perf_counter() - t)


def _probe_fitter():
    """calibrate's own per-layer fit (ProjectFitter) with the benchmark's probes: its timer times each
    batch's capture (synchronized) and each path's fit, and on a GPU each fit's memory is recorded."""
    from quantmla.calibration.stream.fitters import ProjectFitter

    class ProbeFitter(ProjectFitter):
        timer = staticmethod(_timed)

        def fit(self, slot, d, module):
            if not _PROBE["cuda"]:
                return super().fit(slot, d, module)
            # the layer's peak so far (the streamer reads and resets the peak per layer, after the write)
            before = {"peak_before_fit": torch.cuda.max_memory_allocated(),
                      "allocated_at_fit_start": torch.cuda.memory_allocated()}
            torch.cuda.reset_peak_memory_stats()
            try:
                return super().fit(slot, d, module)
            finally:
                _PROBE["fit_mem"].append({**before, "fit_peak": torch.cuda.max_memory_allocated()})

    return ProbeFitter


def run_point(p: dict, steps: int, device: str, threads: int | None, fit_device: str | None = None,
              workdir: str | None = None) -> dict:
    """One calibration (in this process); -> per-layer figures (median over the MoE layers)."""
    if threads:
        torch.set_num_threads(threads)
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.calibration.stream import calibrate_streamed
    from quantmla.calibration.stream.memory import rss_bytes
    from quantmla_lab.random_checkpoint import write_random_checkpoint

    p = {**SWEEP_MOE, **p}
    cuda = str(device).startswith("cuda")
    _PROBE.update(split={"content": [], "rope": []}, fit_mem=[], cuda=cuda)
    fit_kwargs = {"steps": steps}
    if fit_device and fit_device != "cpu":
        fit_kwargs["device"] = fit_device
    with tempfile.TemporaryDirectory(prefix="qmla-scal-", dir=workdir) as tmp:
        t_ckpt = time.perf_counter()
        info = write_random_checkpoint(_config(p), os.path.join(tmp, "src"), seed=0, dtype=getattr(torch, p["source_dtype"]))
        t_ckpt = time.perf_counter() - t_ckpt
        ids = torch.randint(3, 1024, (p["seqs"], p["seq_len"]), generator=torch.Generator().manual_seed(0))
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        device_start = torch.cuda.memory_allocated() if cuda else 0
        base_rss = rss_bytes()
        t0 = time.perf_counter()
        rep = calibrate_streamed(os.path.join(tmp, "src"), os.path.join(tmp, "out"), ids,
                                 QuantCacheConfig.of_bits(2, 4, min(64, p["d_c"]), min(32, p["d_r"])), method="quantmla",
                                 seed=0, device=device, fit_kwargs=fit_kwargs, fit_fn=_probe_fitter())
        wall = time.perf_counter() - t0
        moe = list(range(p["dense_layers"], p["layers"]))
        secs = []
        for i in moe:
            with open(os.path.join(tmp, "out", ".quantmla_stream", f"layer-{i:05d}.json")) as f:
                secs.append(json.load(f)["fit"][str(i)]["seconds"])
    layers = [s for s in rep.layers if s.layer in moe]
    med = lambda k: statistics.median(getattr(s, k) for s in layers)
    content = statistics.median(_PROBE["split"]["content"][p["dense_layers"]:])
    rope = statistics.median(_PROBE["split"]["rope"][p["dense_layers"]:])
    out = {
        "steps": steps, "device": str(device), "fit_device": fit_device or "cpu", "wall_s": wall,
        "checkpoint_write_s": t_ckpt, "model_bytes": info["bytes"],
        "moe_layer_bytes": layers[0].weight_bytes,  # as loaded (compute dtype, fp32)
        "moe_layer_file_bytes": info["max_layer_bytes"],  # in the checkpoint (source dtype)
        "load_s": med("load_s"), "forward_s": med("forward_s"), "fit_s": med("fit_s"), "write_s": med("write_s"),
        "capture_s": statistics.median(x["capture"] for x in secs),
        "content_fit_s": content, "rope_fit_s": rope,
        "joint_eval_s": statistics.median(x["fit"] for x in secs) - content - rope,
        "peak_rss_over_start_bytes": max(s.peak_rss_bytes for s in layers) - rep.start_rss_bytes,
        "peak_rss_over_baseline_bytes": max(s.peak_rss_bytes for s in layers) - base_rss,
        "captured_bytes": max(s.captured_bytes for s in layers), "activation_bytes": layers[0].activation_bytes,
        "device_peak_bytes": max(s.device_peak_bytes for s in layers),
        "layers": [{k: getattr(s, k) for k in ("layer", "load_s", "forward_s", "fit_s", "write_s", "peak_rss_bytes",
                                                 "captured_bytes", "weight_bytes", "device_peak_bytes")} for s in rep.layers],
    }
    if cuda:
        fm = _PROBE["fit_mem"]  # one per fitted layer, in layer order
        for row, m in zip(out["layers"], fm):
            # the streamer's per-layer peak covers fit + write; the probe saw the peak before the fit
            row["device_peak_bytes"] = max(row["device_peak_bytes"], m["peak_before_fit"])
            row.update(device_fit_peak_bytes=m["fit_peak"], device_at_fit_start_bytes=m["allocated_at_fit_start"])
        rows = [r for r in out["layers"] if r["layer"] in moe]
        out.update(device_start_bytes=device_start, device_peak_bytes=max(r["device_peak_bytes"] for r in rows),
                   device_fit_peak_bytes=max(r["device_fit_peak_bytes"] for r in rows),
                   device_fit_temporaries_bytes=max(r["device_fit_peak_bytes"] - r["device_at_fit_start_bytes"] for r in rows),
                   device_name=torch.cuda.get_device_name(), device_total_bytes=torch.cuda.get_device_properties(0).total_memory)
    return out


# ---- running points under a time limit ----------------------------------------------------------
class TimeUp(Exception):
    pass


def _on_alarm(signum, frame):
    raise TimeUp()


def _run_in_process(args_tuple, timeout: float | None):
    if timeout is not None:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(max(1, int(timeout)))
    try:
        return 0, run_point(*args_tuple)
    except TimeUp:
        return "time limit", None
    except Exception as e:  # noqa: BLE001 - one failed point must not lose the others' results
        import traceback

        traceback.print_exc()
        return f"{type(e).__name__}: {str(e)[:300]}", None
    finally:
        if timeout is not None:
            signal.alarm(0)


def _call_to_file(args_tuple, result_file: str) -> None:
    out = run_point(*args_tuple)
    torch.save(out, result_file + ".tmp")
    os.replace(result_file + ".tmp", result_file)


def _run_in_fresh_process(args_tuple, timeout: float | None):
    """A fresh spawned process (its peak RSS is the run's own), killed at the time limit."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="qmla-scal-call-") as tmp:
        result_file = os.path.join(tmp, "result.pt")
        proc = ctx.Process(target=_call_to_file, args=(args_tuple, result_file))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            return "time limit", None
        if proc.exitcode != 0 or not os.path.exists(result_file):
            return proc.exitcode, None
        return 0, torch.load(result_file, weights_only=False)


def _describe(p: dict, r: dict) -> str:
    s = (f"{p['axis']:>6} d_c={p['d_c']:4d} H={p['heads']:3d} tokens={p['seqs']}x{p['seq_len']:<4d}: "
         f"load {r['load_s']:.2f}s forward {r['forward_s']:.2f}s (capture {r['capture_s']:.2f}s) "
         f"fit {r['fit_s']:.2f}s (content {r['content_fit_s']:.2f}s, RoPE {r['rope_fit_s']:.2f}s) "
         f"write {r['write_s']:.2f}s peak RSS +{r['peak_rss_over_start_bytes'] / 2**20:.0f} MiB, "
         f"captured {r['captured_bytes'] / 2**20:.1f} MiB")
    if r.get("device_name"):
        s += f", GPU peak {r['device_peak_bytes'] / 2**20:.0f} MiB (fit {r['device_fit_peak_bytes'] / 2**20:.0f} MiB)"
    return s + f" [{r['wall_s']:.1f}s]"


def _parse_tokens(s: str) -> str:
    n, _, m = s.lower().partition("x")
    if not (n.isdigit() and m.isdigit() and int(n) >= 2 and int(m) >= 2):
        raise argparse.ArgumentTypeError(f"expected SEQSxLEN such as 16x512, got {s!r}")
    return s.lower()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="where the layers run: cpu, cuda")
    ap.add_argument("--fit-device", default=None, help="where the fits run (default: --device, as `quantmla calibrate` does)")
    ap.add_argument("--steps", type=int, default=None,
                    help="content Adam steps per layer in the sweep (default 20; --quick: 2; calibrate's default: 200)")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test of every code path")
    ap.add_argument("--in-process", action="store_true",
                    help="run the points in this process (no per-point start-up; peak RSS then includes earlier points' "
                         "leftovers, GPU peaks are still per layer)")
    ap.add_argument("--with-dsv3", action="store_true",
                    help="first measure one layer at DeepSeek-V3 geometry and project 61 layers on 1 and 8 GPUs from it")
    ap.add_argument("--dsv3-tokens", type=_parse_tokens, default="16x512", help="calibration tokens of that point (SEQSxLEN)")
    ap.add_argument("--dsv3-steps", type=int, default=None, help="its content Adam steps (default 200; --quick: 2)")
    ap.add_argument("--time-limit", type=float, default=None, metavar="S",
                    help="seconds for the whole run: skip points that would not fit, interrupt a running one, "
                         "write what was measured")
    ap.add_argument("--nvme-read-gbps", type=float, default=ASSUMED["nvme_read_gbps"],
                    help="read rate assumed for the real 23 GB layers in the measured projection")
    ap.add_argument("--nvme-write-gbps", type=float, default=ASSUMED["nvme_write_gbps"], help="write rate assumed likewise")
    ap.add_argument("--workdir", default=None, help="where the synthetic checkpoints are written (default: the temp dir)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None, metavar="JSON", help="print the markdown table of a results file and exit")
    ap.add_argument("--reproject", default=None, metavar="JSON", help="refit the cost model / projection of a results file")
    ap.add_argument("--dsv3-point", default=None, metavar="JSON",
                    help="add one point with DeepSeek-V3's attention geometry (hidden 7168, 128 heads, d_c 512, "
                         "q-LoRA 1536; small MoE; 4x128 tokens; --steps content steps) to a results file, with the "
                         "cost model's prediction for it")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    steps = args.steps if args.steps is not None else (2 if args.quick else 20)
    dsv3_steps = args.dsv3_steps if args.dsv3_steps is not None else (2 if args.quick else 200)
    cuda = args.device.startswith("cuda")
    fit_device = args.fit_device if args.fit_device is not None else args.device
    rates = {"nvme_read_gbps": args.nvme_read_gbps, "nvme_write_gbps": args.nvme_write_gbps}
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    if args.table:
        with open(args.table) as f:
            print(markdown(json.load(f)))
        return 0
    if args.dsv3_point:
        from quantmla.calibration.distributed import spawn_call

        with open(args.dsv3_point) as f:
            res = json.load(f)
        p = {**BASE, "hidden": 7168, "heads": 128, "d_c": 512, "q_lora": 1536, "seqs": 4, "seq_len": 128, "axis": "dsv3_attention"}
        code, r = spawn_call(run_point, p, steps, args.device, args.threads, fit_device)
        if code != 0:
            raise SystemExit(f"DeepSeek-V3 attention point failed with exit code {code}")
        m = {k: v["median"] for k, v in res["cost_model"].items()}
        pred = {"content_fit_s": m["content_s_per_step_mac"] * steps * step_work(p),
                "rope_fit_s": m["rope_s_per_key"] * rope_keys(p), "capture_s": m["capture_s_per_mac"] * capture_work(p)}
        res["dsv3_attention_point"] = {**p, "runs": [r], "predicted": pred, "step_mac": step_work(p)}
        save(res, args.dsv3_point)
        print(json.dumps({k: v for k, v in r.items() if k != "layers"}, indent=1), json.dumps(pred, indent=1))
        return 0
    if args.reproject:  # refit the cost model and the projection of an existing results file
        with open(args.reproject) as f:
            res = json.load(f)
        res["cost_model"] = fit_model(res["points"])
        res["projection_dsv3"] = {name: project(res["cost_model"], n, sl)
                                  for name, (n, sl) in {"16x512": (16, 512), "64x1024": (64, 1024)}.items()}
        if res.get("dsv3_point"):
            res["projection_dsv3_measured"] = project_measured(res["dsv3_point"], rates)
        res["assumed_h200_rates"] = ASSUMED
        res["dsv3_geometry"] = DSV3
        save(res, args.reproject)
        print(json.dumps({k: res[k] for k in ("cost_model", "projection_dsv3", "projection_dsv3_measured") if k in res}, indent=1))
        return 0

    kind = "cuda" if cuda else "cpu"
    out = args.out or os.path.join(RESULTS, "calibration_scaling", f"{kind}{'_quick' if args.quick else ''}.json")
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads, "python": sys.version.split()[0],
               "torch": torch.__version__, "load_average_start": os.getloadavg(), "in_process": args.in_process,
               "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor()}
    if cuda:
        machine.update(cuda=torch.version.cuda, gpu_count=torch.cuda.device_count(),
                       gpu_total_bytes=torch.cuda.get_device_properties(0).total_memory,
                       tf32_matmul=torch.backends.cuda.matmul.allow_tf32, float32_matmul_precision=torch.get_float32_matmul_precision())
    try:
        import transformers

        machine["transformers"] = transformers.__version__
    except ImportError:
        pass
    res = {"machine": machine, "device": args.device, "fit_device": fit_device,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "command": " ".join(["python"] + sys.argv), "steps": steps, "quick": args.quick,
           "time_limit_s": args.time_limit, "points": [], "skipped": [], "dsv3_geometry": DSV3, "assumed_h200_rates": ASSUMED}

    def remaining() -> float | None:
        return None if args.time_limit is None else args.time_limit - (time.perf_counter() - t_start)

    def save_to(path):
        save(res, path)

    def run(p: dict, n_steps: int):
        left = remaining()
        timeout = None if left is None else left - 3.0  # a few seconds to write the results
        if timeout is not None and timeout < 5:
            return "time limit", None
        call = (p, n_steps, args.device, args.threads, res["fit_device"], args.workdir)
        return (_run_in_process if args.in_process else _run_in_fresh_process)(call, timeout)

    if args.in_process and cuda:  # CUDA context, cuBLAS handles, allocator: not in the first point's figures
        t = time.perf_counter()
        code, _ = run({**TINY, "axis": "warmup"}, 2)
        if code != 0 and code != "time limit" and res["fit_device"] != "cpu":
            # the streamed run works but the fit on the GPU does not: measure with the fit on the host
            res["fit_device_fallback"] = f"fit on {res['fit_device']} failed in the warm-up ({code}); fits run on the CPU"
            print(res["fit_device_fallback"], flush=True)
            res["fit_device"] = "cpu"
            code, _ = run({**TINY, "axis": "warmup"}, 2)
        res["warmup_s"] = time.perf_counter() - t
        print(f"warm-up ({code or 'ok'}) {res['warmup_s']:.1f}s", flush=True)
        if code != 0:
            res["error"] = f"warm-up point failed: {code}"
            save_to(out)
            print(f"wrote {out}: {res['error']}")
            return 1

    todo = [("dsv3", dsv3_point(args.quick, args.dsv3_tokens, dsv3_steps))] if args.with_dsv3 else []
    todo += [("sweep", p) for p in sweep(args.quick, cuda)]
    walls: list[float] = []
    for kind_, p in todo:
        n_steps = p.pop("steps", steps)
        left = remaining()
        if kind_ == "sweep" and left is not None and walls and left < 1.3 * max(walls) + 3:
            res["skipped"].append({**p, "reason": f"time limit: {left:.0f}s left, points took up to {max(walls):.0f}s"})
            continue
        t = time.perf_counter()
        code, r = run(p, n_steps)
        wall = time.perf_counter() - t
        if code != 0:
            why = "interrupted at the time limit" if code == "time limit" else f"failed ({code})"
            res["skipped"].append({**p, "reason": f"{why} after {wall:.0f}s"})
            print(f"{p['axis']:>6} d_c={p['d_c']} H={p['heads']} tokens={p['seqs']}x{p['seq_len']}: {res['skipped'][-1]['reason']}",
                  flush=True)
            if code == "time limit":
                break
            continue
        print(_describe(p, r), flush=True)
        entry = {**p, "runs": [r], "step_mac": step_work(p), "capture_mac": capture_work(p), "rope_keys": rope_keys(p)}
        if kind_ == "dsv3":
            res["dsv3_point"] = entry
            res["projection_dsv3_measured"] = project_measured(entry, rates)
        else:
            walls.append(wall)
            res["points"].append(entry)
        save_to(out + ".partial")

    machine["load_average_end"] = os.getloadavg()
    if res["points"]:
        res["cost_model"] = fit_model(res["points"])
        res["projection_dsv3"] = {name: project(res["cost_model"], n, sl)
                                  for name, (n, sl) in {"16x512": (16, 512), "64x1024": (64, 1024)}.items()}
    res["wall_s"] = time.perf_counter() - t_start
    save_to(out)
    if os.path.exists(out + ".partial"):
        os.remove(out + ".partial")
    print(markdown(res))
    print(json.dumps({k: res[k] for k in ("cost_model", "projection_dsv3_measured", "skipped") if k in res}, indent=1))
    print(f"wrote {out} ({len(res['points'])} sweep points{', DeepSeek-V3 point' if res.get('dsv3_point') else ''}, "
          f"{len(res['skipped'])} skipped) in {res['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
