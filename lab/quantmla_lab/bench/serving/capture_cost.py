"""Where the time of a CUDA-graph capture goes in a short `quantmla serve` job (H200, issue #6).

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.capture_cost models/qmla-ref-deepseek-v3 \
        --out $OUT/capture_cost_h200.json

Runs the job of ``lab/quantmla_lab/bench/serving/warm_vs_cold.py`` (48 prompts of 30–300 tokens, 96 new tokens each,
2 MiB KV budget) once on a fresh engine per cache method, with every capture timed. A capture runs
the step three times: a warm-up on a side stream (first launches: Triton compilation, workspaces),
a probe with host synchronization made an error, then the capture itself. Per capture the script
records the host seconds of each of the three runs, the whole capture, and how many Triton kernel
variants were compiled during it.
"""

from __future__ import annotations

import gc
import time

import torch
import triton

from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.graphs import EngineObserver
from quantmla_lab.bench.common import record, save, short_job, short_job_parser
from quantmla_lab.bench.serving.throughput import method_config


def compiled_variants() -> int:
    """Triton kernel binaries compiled so far in this process (every JITFunction, every device)."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # isinstance() on deprecated torch aliases
    n = 0
    for obj in gc.get_objects():
        if isinstance(obj, triton.runtime.jit.JITFunction):
            for cache in getattr(obj, "device_caches", {}).values():
                n += len(cache[0])
    return n


def compiled_variants_s() -> float:
    """Seconds one compiled_variants() scan takes (subtracted from the cold job's wall time)."""
    t = time.perf_counter()
    compiled_variants()
    return time.perf_counter() - t


def main(argv=None) -> int:
    p = short_job_parser(__doc__)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("capture_cost.py times CUDA-graph captures: it needs a CUDA device")
    model, prompts, params = short_job(a.model, a.requests, a.new, "cuda")

    records: list[dict] = []
    label = ["?"]

    class Captures(EngineObserver):
        """Each capture's timings, and the Triton variants compiled during it (the scans of every Python
        object that count them run outside the engine's timings)."""

        def capture_begin(self, graph, size):
            records.append(dict(method=label[0], graph=f"{graph} {size}", before=compiled_variants()))

        def capture_end(self, timing):
            r = records[-1]
            r.update(runs_s=[round(x, 4) for x in timing.runs_s], capture_s=round(timing.capture_s, 4), ok=timing.ok,
                     compiled=compiled_variants() - r.pop("before"))

    res = record(model=a.model, triton=triton.__version__, jobs=[])
    for m in a.methods:
        label[0] = m
        with Engine(model, EngineConfig(quant=method_config(m, 64, 32), kv_budget_bytes=int(a.budget_gib * (1 << 30)))) as e:
            e.observers.append(Captures())
            c0 = compiled_variants()
            scans = len(records)
            t = time.perf_counter()
            e.generate(prompts, params)
            wall = time.perf_counter() - t
            scan_s = compiled_variants_s() * 2 * (len(records) - scans)  # the scans inside the cold job
            t = time.perf_counter()
            e.generate(prompts, params)
            warm = time.perf_counter() - t
        mine = [r for r in records if r["method"] == m]
        wall -= scan_s
        job = dict(method=m, cold_s=round(wall, 3), warm_s=round(warm, 3), captures=len(mine),
                   capture_s=round(sum(r.get("capture_s", 0) for r in mine), 3), compiled_in_job=compiled_variants() - c0)
        res["jobs"].append(job)
        print(f"{m}: cold job {wall:.2f} s, warm {warm:.2f} s, {len(mine)} captures take {job['capture_s']:.2f} s, "
              f"{job['compiled_in_job']} Triton variants compiled", flush=True)
        for r in mine:
            print(f"   {r['graph']:14} capture {r.get('capture_s', 0):6.3f} s  runs {r.get('runs_s')}  "
                  f"compiled {r.get('compiled')}", flush=True)
    res["captures"] = records
    save(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
