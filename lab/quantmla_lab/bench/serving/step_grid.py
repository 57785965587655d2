"""Where a decode step's time goes, over batches x contexts x cache formats, in one process.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.step_grid --out $OUT/profile/step_grid_graphs_h200.json
    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.step_grid --from-json $OUT/profile/step_grid_graphs_h200.json

For every point (batch in ``--batches``, context in ``--contexts``, method in ``--methods``) the
serve-bench model (v2-lite geometry, 27 layers, random weights, built once) runs ``--warm`` decode steps
of the full batch (the first builds the kernels, the others time a whole step without the profiler:
``step_us_unprofiled``), then ``--steps`` under ``torch.profiler``, and the point records the step's parts
(:func:`~quantmla_lab.bench.serving.step_profile.step_parts`: attention, cache append, projections and MLP,
sampling, other kernels, host time), the kernels launched a step, the bytes a step must read (weights,
cached records) and the fraction of the copy bandwidth each part reaches, and the roofline ratio: wall step
time / ((weight bytes + cache bytes) / copy bandwidth). On CUDA the steps replay the engine's CUDA graph for
the batch (captured in the first step), as serve-bench's decode steps run, and the point also records
``replay_us``: the GPU time of one replay back to back with the next, so that wall - replay is the host's share
and replay - kernel time the launch gaps inside the graph. ``--eager`` (the default on the CPU) runs eager
steps, whose host time is Python's launches.

Reaching the decode phase: each point's engine holds exactly the pages of ``batch`` sequences of
``context + warm + steps`` tokens; every page of its pool gets random records (latent and RoPE key
N(0, 1), written through the backend's own quantizing write), and every request carries a prompt of
``context`` tokens with ``Request.cached_prefix = context - 1``, so its first step is already a decode
step over ``context`` cached tokens. No prefill runs; the attention reads as many bytes in the same
layout as after a real prefill, but the outputs are not the model's on a prompt. A point whose cache
plus weights plus ``--headroom-gib`` exceeds the device memory (``--memory-gib``, default the device's
own; on CUDA also the memory free at that point) is skipped with the reason, as is a point that runs
out of memory or starts after ``--max-seconds``; a point that raises is recorded as an error with the
exception. The JSON is written after every point.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from quantmla.model.spec import load_spec
from quantmla.serving.backends import AttentionBackend
from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.graphs import EngineObserver
from quantmla.serving.scheduler import Request, SamplingParams
from quantmla_lab.bench.common import record, save
from quantmla_lab.bench.serving.step_overhead import replay_ms
from quantmla_lab.bench.serving.step_profile import copy_bandwidth, kernel_families, step_parts, weight_bytes
from quantmla_lab.bench.serving.throughput import build_bench_model, method_config

GiB = 1 << 30
PART_NAMES = ("attention", "cache append", "projections and MLP", "sampling", "other", "host")


class DecodeWindow(EngineObserver):
    """Profiles full-batch decode steps ``warm .. warm + steps - 1`` of a job: the window opens when step
    ``warm`` begins and closes when step ``warm + steps`` begins (each profiled step's scheduling and
    commit inside it), the device synchronized at both ends. ``wall_s``: host seconds of the window;
    ``begins``: host time (s) at which each full-batch step began, so that the unprofiled steps
    ``1 .. warm - 1`` time a whole step without the profiler (:meth:`unprofiled_s`)."""

    def __init__(self, batch: int, warm: int, steps: int, activities, sync):
        self.batch, self.warm, self.steps, self.activities, self.sync = batch, warm, steps, activities, sync
        self.k, self.prof, self.t0, self.wall_s, self.tokens, self.done = 0, None, 0.0, 0.0, 0, False
        self.begins: list[float] = []

    def _mine(self, plan) -> bool:
        return plan.is_decode and len(plan.items) == self.batch

    def step_begin(self, plan):
        if not self._mine(plan):
            return
        self.begins.append(time.perf_counter())
        if self.k == self.warm:
            self.sync()
            self.prof = profile(activities=self.activities)
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif self.k == self.warm + self.steps:
            self.close()

    def step_end(self, timing):
        if self._mine(timing.plan):
            if self.warm <= self.k < self.warm + self.steps:
                self.tokens += timing.plan.num_tokens
            self.k += 1

    def unprofiled_s(self) -> float | None:
        """Median host seconds of a whole unprofiled step (steps 1 .. warm - 1, after the kernel builds of
        step 0), or None when ``warm`` < 2."""
        d = sorted(b - a for a, b in zip(self.begins[1: self.warm], self.begins[2: self.warm + 1]))
        return d[len(d) // 2] if d else None

    def close(self) -> None:
        if self.prof is not None and not self.done:
            self.sync()
            self.wall_s = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            self.done = True


def kernel_launches(prof, steps: int, cuda: bool) -> float | None:
    """Kernels launched per step in a finished ``torch.profiler`` window (CUDA only, else None)."""
    if not cuda:
        return None
    return sum(ev.count for ev in prof.key_averages() if getattr(ev, "self_device_time_total", 0) > 0) / steps


def fill_pool(engine: Engine, seed: int = 0, chunk: int = 1 << 16) -> None:
    """Writes a random record (latent [d_c] and RoPE key [d_r], N(0, 1) in the engine's dtype, quantized by
    the backend's own write) at every token slot of every page the engine can hand out, in every layer:
    slots [page_size, (pool_pages + 1) * page_size), ``chunk`` tokens a write."""
    ps, dev, spec = engine.config.page_size, engine.device, engine.spec
    lo, hi = ps, (engine.pool_pages + 1) * ps
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.inference_mode():
        for s in range(lo, hi, chunk):
            n = min(chunk, hi - s)
            slots = torch.arange(s, s + n, device=dev)
            lat = torch.randn(n, spec.d_c, generator=g, device=dev, dtype=engine.dtype)
            kr = torch.randn(n, spec.d_r, generator=g, device=dev, dtype=engine.dtype)
            for slot in engine.formats:
                engine.backend.write(slot, lat, kr, slots)


def pool_bytes(spec, quant, pages: int, page_size: int) -> int:
    """Bytes of an engine pool of ``pages`` pages (and the null page) over every MLA layer."""
    page = AttentionBackend.bytes_per_page(spec, {s: quant.format_for(s) for s in spec.mla_layers}, page_size)
    return (pages + 1) * page


def device_memory(device: str) -> int:
    """Bytes of memory of the device (CUDA: its total; CPU: the host's physical memory)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def roofline(step_us: float, weights: float, cache: float, copy_gbps: float) -> dict:
    """A step of ``step_us`` µs against the time its ``weights`` + ``cache`` bytes take at the copy
    bandwidth (GB/s): {floor_us, ratio (step / floor), frac_copy (floor / step)}."""
    floor_us = (weights + cache) / (copy_gbps * 1e9) * 1e6
    ok = step_us > 0 and floor_us > 0 and math.isfinite(floor_us)
    return {"floor_us": round(floor_us, 3), "ratio": round(step_us / floor_us, 3) if ok else float("nan"),
            "frac_copy": round(floor_us / step_us, 3) if ok else float("nan")}


def profile_point(model, method: str, batch: int, context: int, a, copy_gbps: float, resident: int,
                  memory: int) -> dict:
    """One grid point: (method, batch, context) -> its record, status "ok", or "skipped" / "error" with the reason."""
    t_start = time.perf_counter()
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    q = method_config(method, a.content_group, a.rope_group)
    spec, ps = load_spec(model), a.page_size
    tokens = context + a.warm + a.steps  # cached tokens per sequence at the job's last step
    pages = batch * -(-tokens // ps)
    pool = pool_bytes(spec, q, pages, ps)
    head = int(a.headroom_gib * GiB)
    pt = {"method": method, "format": q.describe(), "batch": batch, "context": context, "pool_pages": pages,
          "pool_bytes": pool}
    need = resident + pool + head
    if need > memory:
        return pt | {"status": "skipped", "reason": (
            f"needs {need / GiB:.1f} GiB (cache {pool / GiB:.1f} + weights {resident / GiB:.2f} + headroom "
            f"{a.headroom_gib:g}) of the device's {memory / GiB:.1f} GiB")}
    if cuda:
        free = torch.cuda.mem_get_info(torch.device(a.device))[0]
        if pool + head > free:
            return pt | {"status": "skipped", "reason": (
                f"cache {pool / GiB:.1f} GiB + headroom {a.headroom_gib:g} exceed the {free / GiB:.1f} GiB free")}
    e = window = None
    try:
        cfg = EngineConfig(quant=q, num_pages=pages, page_size=ps, max_num_seqs=batch, max_num_batched_tokens=batch,
                           watermark=0.0, backend=a.backend, cuda_graphs=a.cuda_graphs, max_model_len=tokens + 1,
                           fused_rope=not a.no_fused_rope, merged_projections=not a.no_merged_projections,
                           overlap_steps=not a.no_overlap, graph_units=a.graph_units,
                           decode_config=decode_tiling(a.ctas_per_sm))
        e = Engine(model, cfg)
        pt["rope"], pt["projections"] = e.rope, e.projections
        if a.cuda_graphs and not e.use_graphs:
            return pt | {"status": "skipped", "reason": "--cuda-graphs: the engine does not replay graphs on this "
                                                          f"device and backend ({e.graph_error or 'not CUDA'})"}
        pt["mlps"] = sorted(set(e.mlps.values()))
        sync()
        t_build = time.perf_counter()
        fill_pool(e, seed=batch * 7919 + context)
        sync()
        t_fill = time.perf_counter()
        g = torch.Generator().manual_seed(context + batch)
        last = torch.randint(3, model.config.vocab_size, (batch,), generator=g).tolist()
        params = SamplingParams(max_new_tokens=a.warm + a.steps + 1, ignore_eos=True)
        # the prompt's first context - 1 tokens are never read (cached_prefix): a filler id, the last one random
        reqs = [Request(i, [3] * (context - 1) + [last[i]], params, cached_prefix=context - 1) for i in range(batch)]
        acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        window = DecodeWindow(batch, a.warm, a.steps, acts, sync)
        e.observers.append(window)
        outs = e.generate(reqs)
        window.close()
        t_run = time.perf_counter()
        bad = [o.error for o in outs if not o.ok]
        if bad or not window.done:
            return pt | {"status": "error", "reason": f"the job failed: {bad[0] if bad else 'no full-batch window'}"}
        n = a.steps
        fam = kernel_families(window.prof, n, cuda)
        wall_us = window.wall_s / n * 1e6
        mean_ctx = context + a.warm + (n - 1) / 2  # cached tokens per row after each profiled step's write, mean
        parts = step_parts(fam, e, model, batch, mean_ctx, copy_gbps, window.wall_s / n)
        cache_b = batch * mean_ctx * e.bytes_per_token
        weights_b = weight_bytes(model)
        gpu_us = sum(fam.values())
        top = sorted(fam.items(), key=lambda kv: -kv[1])[: a.top]
        unprof = window.unprofiled_s()
        if a.cuda_graphs and e.stats.graph_steps < a.warm + a.steps:
            return pt | {"status": "error", "reason": f"--cuda-graphs: {e.stats.graph_steps} of the job's "
                                                      f"{a.warm + a.steps} decode steps replayed a graph ({e.graph_error})"}
        if a.cuda_graphs:  # the bucket's graph replayed back to back: the GPU's time for a step, gaps included
            bucket, graph = e.decode_graph(batch)
            pt["replay_us"] = round(replay_ms(graph) * 1e3, 1)
        pt |= {"status": "ok", "steps": n, "graph_steps": e.stats.graph_steps,
               "kernels_per_step": kernel_launches(window.prof, n, cuda),
               "tokens_per_step": window.tokens / n, "mean_context": mean_ctx,
               "step_us": round(wall_us, 1), "step_us_unprofiled": None if unprof is None else round(unprof * 1e6, 1),
               "gpu_us": round(gpu_us, 1), "parts": parts,
               "bytes": {"weights": int(weights_b), "cache": int(cache_b)},
               "roofline": roofline(wall_us, weights_b, cache_b, copy_gbps),
               "roofline_gpu": roofline(gpu_us, weights_b, cache_b, copy_gbps),
               "top_us_per_step": {k: round(v, 1) for k, v in top}}
        t_end = time.perf_counter()
        pt["timing_s"] = {"build": round(t_build - t_start, 3), "fill": round(t_fill - t_build, 3),
                          "job": round(t_run - t_fill, 3), "total": round(t_end - t_start, 3)}
        return pt
    except torch.OutOfMemoryError as err:
        return pt | {"status": "skipped", "reason": f"out of memory: {str(err).splitlines()[0]}"}
    except Exception as err:  # one point's failure is recorded, and the grid goes on
        return pt | {"status": "error", "reason": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"}
    finally:
        if window is not None and window.prof is not None and not window.done:
            window.prof.__exit__(None, None, None)
        if e is not None:
            e.close()
        del e, window
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def run_grid(a) -> dict:
    """Every (context, batch, method) point in that order, in one process -> the result record."""
    t0 = time.perf_counter()
    cuda = a.device.startswith("cuda")
    model = build_bench_model(a.preset, a.device, torch.bfloat16, 0)
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]):  # the profiler's set-up
        torch.ones(1, device=a.device).add_(1)
    resident = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    copy_gbps = copy_bandwidth(a.device)
    if cuda:
        torch.cuda.empty_cache()
    memory = int(a.memory_gib * GiB) if a.memory_gib else device_memory(a.device)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s, memory {memory / GiB:.1f} GiB, weights {resident / GiB:.2f} GiB",
          flush=True)
    res = {**record(), "device": torch.cuda.get_device_name(0) if cuda else "cpu", "copy_GBps": copy_gbps,
           "memory_GiB": memory / GiB, "headroom_GiB": a.headroom_gib, "preset": a.preset,
           "content_group": a.content_group, "rope_group": a.rope_group, "page_size": a.page_size,
           "warm_steps": a.warm, "steps": a.steps, "weights_resident_bytes": resident,
           "cuda_graphs": a.cuda_graphs, "overlap_steps": not a.no_overlap, "graph_units": a.graph_units,
           "ctas_per_sm": a.ctas_per_sm,
           "how": ("CUDA-graph replays of" if a.cuda_graphs else "eager") + " full-batch decode steps; prompts of "
                  "`context` tokens with cached_prefix = context - 1 over a "
                  "pool of random N(0, 1) records (no prefill); parts per step from torch.profiler; host = wall - GPU",
           "points": []}
    for context in a.contexts:
        for batch in a.batches:
            for m in a.methods:
                elapsed = time.perf_counter() - t0
                if elapsed > a.max_seconds:
                    pt = {"method": m, "batch": batch, "context": context, "status": "skipped",
                          "reason": f"time limit: {elapsed:.0f} s > --max-seconds {a.max_seconds:g}"}
                else:
                    pt = profile_point(model, m, batch, context, a, copy_gbps, resident, memory)
                res["points"].append(pt)
                print(point_line(pt), flush=True)
                save(res, a.out)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    save(res, a.out)
    return res


def point_line(pt: dict) -> str:
    head = f"{pt['method']:>9} b{pt['batch']:<3} ctx {pt['context']:>6}"
    if pt["status"] != "ok":
        return f"{head}  {pt['status']}: {pt['reason']}"
    p = pt["parts"]
    replay = f"  replay {pt['replay_us'] / 1e3:6.2f}" if "replay_us" in pt else ""
    return (f"{head}  step {pt['step_us'] / 1e3:8.2f} ms{replay}  attn {p['attention']['us_per_step'] / 1e3:7.2f}  "
            f"host {p['host']['us_per_step'] / 1e3:7.2f}  roofline x{pt['roofline']['ratio']:.2f}  "
            f"({pt['timing_s']['total']:.1f} s)")


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f}"


def _frac(part: dict) -> str:
    f = part.get("frac_copy")
    return "" if f is None or not math.isfinite(f) else f"{f:.2f}"


def render(res: dict) -> str:
    """A markdown table of a grid result: per point, ms per step of each part, GB a step reads, the
    fraction of copy bandwidth of attention and of the weights, and the roofline ratio of the step's wall
    time (eager: host time included) and of its GPU time (what a CUDA-graph replay approaches)."""
    lines = [f"Decode step parts, {res['device']}, copy {res['copy_GBps']:.0f} GB/s, groups "
             f"{res['content_group']}/{res['rope_group']}, {res['steps']} profiled steps "
             f"after {res['warm_steps']} (commit {res.get('commit')}, {res['date']})", "",
             "| method | batch | context | step ms | unprofiled | attention | cache append | proj + MLP | sampling "
             "| other | host | GPU ms | weights GB | cache GB | attn / copy | weights / copy | roofline x (wall) "
             "| roofline x (GPU) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for pt in res["points"]:
        head = f"| {pt['method']} | {pt['batch']} | {pt['context']} |"
        if pt["status"] != "ok":
            lines.append(head + f" {pt['status']}: {pt['reason']} |" + " |" * 14)
            continue
        p = pt["parts"]
        lines.append(head + " " + " | ".join(
            [_ms(pt["step_us"]), "" if pt.get("step_us_unprofiled") is None else _ms(pt["step_us_unprofiled"])]
            + [_ms(p[k]["us_per_step"]) for k in PART_NAMES] + [_ms(pt["gpu_us"])]
            + [f"{pt['bytes']['weights'] / 1e9:.2f}", f"{pt['bytes']['cache'] / 1e9:.2f}", _frac(p["attention"]),
               _frac(p["projections and MLP"]), f"{pt['roofline']['ratio']:.2f}",
               f"{pt['roofline_gpu']['ratio']:.2f}"]) + " |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 16384, 65536], help="cached tokens per row")
    p.add_argument("--methods", nargs="+", default=["bf16", "fp8", "int4/int4", "int2/int4"])
    p.add_argument("--content-group", type=int, default=128)
    p.add_argument("--rope-group", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="decode steps profiled per point")
    p.add_argument("--warm", type=int, default=8,
                   help="decode steps before the profiled ones: the first builds the kernels (and captures the graph), "
                        "the median of the others times a step without the profiler")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--preset", default="v2-lite", help="serve-bench model preset (tiny: a CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-fused-rope", action="store_true", help="the family's own RoPE function (EngineConfig.fused_rope)")
    p.add_argument("--no-merged-projections", action="store_true",
                   help="each projection its own GEMM, the MLP's activation the modules' own (EngineConfig.merged_projections)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="decode steps replay the engine's CUDA graphs, as in serve-bench (the first warm step captures "
                        "them); the default on CUDA, where the point is skipped if the engine replays none")
    p.add_argument("--eager", action="store_true", help="eager decode steps (the default on the CPU)")
    p.add_argument("--no-overlap", action="store_true",
                   help="with --cuda-graphs, each decode step waits for the previous one's tokens before it is launched "
                        "(EngineConfig.overlap_steps)")
    p.add_argument("--graph-units", default="length", choices=("length", "rows"),
                   help="how a decode graph bucket deals its work units out (EngineConfig.graph_units)")
    p.add_argument("--backend", default=None, help="attention backend (default: auto on CUDA, torch on the CPU)")
    p.add_argument("--ctas-per-sm", type=int, default=None, choices=(1, 2),
                   help="the decode schedule's programs an SM (the API's default tiling otherwise; "
                        "EngineConfig.decode_config)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="device memory the points must fit (default: the device's)")
    p.add_argument("--headroom-gib", type=float, default=4.0, help="memory left beside weights and cache (activations)")
    p.add_argument("--max-seconds", type=float, default=float("inf"), help="points that would start later are skipped")
    p.add_argument("--top", type=int, default=6, help="costliest kernels kept per point")
    p.add_argument("--out", default=None)
    p.add_argument("--from-json", default=None, help="print the table of a saved result and exit")
    return p


def decode_tiling(ctas_per_sm: int | None):
    """EngineConfig.decode_config for --ctas-per-sm: the API's default tiling with that many programs an SM (None: the
    default itself)."""
    if ctas_per_sm is None:
        return None
    from dataclasses import replace

    from quantmla.kernels.api import default_config

    return lambda rows, layout, device: replace(default_config(rows, layout, device), ctas_per_sm=ctas_per_sm)


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            print(render(json.load(f)))
        return 0
    if a.backend is None:
        a.backend = "auto" if a.device.startswith("cuda") else "torch"
    if a.eager and a.cuda_graphs:
        raise SystemExit("step_grid: --eager and --cuda-graphs exclude each other")
    a.cuda_graphs = a.cuda_graphs or (a.device.startswith("cuda") and not a.eager)
    res = run_grid(a)
    print()
    print(render(res))
    print(f"\n{sum(p['status'] == 'ok' for p in res['points'])} of {len(res['points'])} points in {res['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
