"""Timing a GPU call for the kernel benchmarks: the median of CUDA-graph replays (or eager calls where a graph cannot be
captured), with L2 emptied before each call, either by Triton's do_bench (it zeroes a 256 MB buffer) or by reading one
(FLUSH = "read": no dirty lines left to be written back during the timed call). On a machine without CUDA (smoke runs
in the Triton interpreter) a call's wall clock, which means only that it runs."""

from __future__ import annotations

import time

import torch

FLUSH = "write"  # how L2 is emptied between timed calls: "write" (do_bench's zeroing) or "read"
_FLUSH_BUF: list = []


def flush_l2() -> None:
    """Empty L2 by reading a 256 MB buffer (no dirty lines are left to be written back during the next call)."""
    if not _FLUSH_BUF:
        _FLUSH_BUF.append(torch.empty(64 << 20, dtype=torch.int32, device="cuda").fill_(1))
        _FLUSH_BUF.append(torch.empty((), dtype=torch.int32, device="cuda"))
    torch.amax(_FLUSH_BUF[0], dim=0, out=_FLUSH_BUF[1])


def _median_read_flushed_ms(fn, warmup_ms: float, rep_ms: float) -> float:
    """Median time of fn with L2 emptied before each call by reading a 256 MB buffer (do_bench zeroes one
    instead, and the dirty lines it leaves in L2 are written back to DRAM during the timed call)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush_l2()
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(1e-3, start.elapsed_time(end) / 5)
    n_warm, n_rep = max(1, int(warmup_ms / est)), max(5, int(rep_ms / est))
    for _ in range(n_warm):
        fn()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n_rep)]
    for a, b in evs:
        flush_l2()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in evs)
    return ts[len(ts) // 2]


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn run once on a side stream (its lazy allocations and compiles), then captured as a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_ms(fn, warmup: int, rep: int, graph: bool = True) -> tuple[float, bool]:
    """Median time of fn (replayed as a CUDA graph when it can be captured), with L2 emptied before each call
    as FLUSH says: do_bench's (it zeroes a 256 MB buffer) or a read of one (no dirty lines left)."""
    import triton.testing

    def bench(f):
        if FLUSH == "read":
            return _median_read_flushed_ms(f, warmup, rep)
        return float(triton.testing.do_bench(f, warmup=warmup, rep=rep, return_mode="median"))

    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    else:  # smoke runs on CPU (interpreter): wall clock, no meaning beyond "it runs"
        ts = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return sorted(ts)[len(ts) // 2], False
    if graph:
        try:
            g = capture_graph(fn)
            torch.cuda.synchronize()
            return bench(g.replay), True
        except Exception as e:  # noqa: BLE001 - fall back to eager timing
            print(f"  (graph capture failed: {type(e).__name__}: {e}; timing eagerly)", flush=True)
    return bench(fn), False
