"""How fast cuBLAS reads the serve-bench model's projection weights at decode's few rows, one shape at a time.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.projection_gemms --out $OUT/profile/projection_gemms_h200.json

For each weight of one layer of the v2-lite geometry (q_proj, kv_a_proj_with_mqa, o_proj, the MLP's gate/up and
down, and the LM head, and the two products that read the same input as one weight: q_proj with kv_a_proj_with_mqa,
gate with up) and each row count M in ``--rows``, the time of ``y = x·Wᵀ`` for M rows, in three forms:

- ``linear``: ``F.linear(x, W)``, as the model's modules call it;
- ``transposed``: ``(W @ xᵀ)ᵀ``, the same product with the weight as the left operand (cuBLAS then sees M as the
  narrow dimension of its output and may pick a GEMV-like kernel);
- ``lt``: ``F.linear`` with ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
- with ``--triton``, ``triton N.. K.. w.. s..``: ``skinny_gemm.py``'s kernel (a candidate that streams W) at each of
  its tilings.

Each form runs on ``--copies`` copies of the weight in turn (at least 256 MB in all, so that no copy is still in
L2 when its turn comes, as across a model's 27 layers), captured in one CUDA graph whose replays are timed with CUDA
events; the JSON has the median µs a call and the weight bytes read a second. On the CPU (``--device cpu``) the same loop
runs as a smoke test of the script.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from quantmla_lab.bench.common import record, save
from quantmla_lab.bench.serving.throughput import PRESETS


def shapes(preset: str = "v2-lite") -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of one layer's projections and the LM head."""
    g = PRESETS[preset]
    h, H = g["hidden"], g["heads"]
    return {
        "q_proj": (H * (g["d_nope"] + g["d_r"]), h),
        "kv_a_proj_with_mqa": (g["d_c"] + g["d_r"], h),
        "q_proj+kv_a_proj_with_mqa": (H * (g["d_nope"] + g["d_r"]) + g["d_c"] + g["d_r"], h),
        "o_proj": (h, H * g["d_v"]),
        "gate_or_up_proj": (g["intermediate"], h),
        "gate_up_proj": (2 * g["intermediate"], h),
        "down_proj": (h, g["intermediate"]),
        "lm_head": (g["vocab"], h),
    }


def _forms(device: str, triton_tilings: bool = False):
    def linear(x, w):
        return F.linear(x, w)

    def transposed(x, w):
        return (w @ x.t()).t()

    out = {"linear": (linear, None), "transposed": (transposed, None)}
    if device == "cuda":
        out["lt"] = (linear, "cublaslt")
    if triton_tilings:  # the candidate kernel that streams W (skinny_gemm.py), one form a tiling
        from quantmla_lab.bench.serving.skinny_gemm import TILINGS, skinny_linear

        for t in TILINGS:
            out["triton N{} K{} w{} s{}".format(*t)] = (lambda x, w, t=t: skinny_linear(x, w, t), None)
    return out


def time_form(fn, x, ws, reps: int, device: str) -> float:
    """Median seconds of one call. On CUDA: one graph of a call on each weight copy in turn, replayed (so launch
    gaps do not count, as in the engine's graph steps), its time divided by the copies; on the CPU: single calls."""
    for w in ws[:2]:
        fn(x, w)
    times = []
    if device == "cuda":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for w in ws:
                fn(x, w)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for w in ws:
                fn(x, w)
        g.replay()
        for _ in range(max(3, reps // len(ws))):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / len(ws))
        return statistics.median(times)
    for i in range(reps):
        t = time.perf_counter()
        fn(x, ws[i % len(ws)])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(a) -> dict:
    dev, dtype = a.device, torch.bfloat16 if a.device == "cuda" else torch.float32
    res = record(preset=a.preset, reps=a.reps)
    res["rows"] = []
    for name, (n, k) in shapes(a.preset).items():
        if a.only and name not in a.only:
            continue
        nbytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(2, min(a.copies, -(-256 * 2**20 // nbytes))) if dev == "cuda" else 2
        ws = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(copies)]
        for m in a.rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = F.linear(x, ws[0]).float()
            for form, (fn, lib) in _forms(dev, a.triton).items():
                prev = torch.backends.cuda.preferred_blas_library() if lib else None
                if lib:
                    torch.backends.cuda.preferred_blas_library(lib)
                try:
                    got = fn(x, ws[0]).float()
                    err = float((got - ref).abs().max() / ref.abs().max())
                    s = time_form(fn, x, ws, a.reps, dev)
                except Exception as e:  # a tiling the device cannot launch (shared memory) is recorded, not fatal
                    if not form.startswith("triton"):
                        raise
                    why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                    res["rows"].append({"weight": name, "out": n, "in": k, "rows": m, "form": form, "error": why})
                    print(f"{name:>20} {n:6d}x{k:<6d} M={m:<3d} {form:>10} {why}")
                    continue
                finally:
                    if lib:
                        torch.backends.cuda.preferred_blas_library(prev)
                row = {"weight": name, "out": n, "in": k, "rows": m, "form": form, "us": s * 1e6,
                       "weight_GBps": nbytes / s / 1e9, "rel_diff_vs_linear": err, "copies": copies}
                res["rows"].append(row)
                print(f"{name:>20} {n:6d}x{k:<6d} M={m:<3d} {form:>10} {s * 1e6:8.1f} us  {nbytes / s / 1e9:7.0f} GB/s")
        del ws
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--preset", default="v2-lite")
    p.add_argument("--only", nargs="*", default=None, help="weights to time (default: all)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--copies", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--triton", action="store_true", help="also time skinny_gemm.py's kernel at each of its tilings")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    res = run(a)
    if a.out:
        import os

        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        save(res, a.out)
        print(f"saved {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
