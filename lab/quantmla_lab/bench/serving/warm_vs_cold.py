"""The same small job twice on one engine (cold: graphs captured as buckets are first used; warm: all
captured), and once without CUDA graphs: how much of a short `quantmla serve` job is capture time.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.warm_vs_cold models/qmla-ref-deepseek-v3 \
        --out $OUT/serve_warm_cold.json
    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.warm_vs_cold models/qmla-ref-deepseek-v3 --emulate \
        --methods bf16 int4/int4  # CPU

Also records what one full ``gc.collect()`` costs in this process (what a collection before every
capture would add; the engine runs none, see ``quantmla.serving.graphs.no_gc``) and how many graphs
each engine captured.
"""

from __future__ import annotations

import gc
import time

import torch

from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.scheduler import Request
from quantmla_lab.bench.common import record, save, short_job, short_job_parser
from quantmla_lab.bench.serving.throughput import method_config


def main(argv=None) -> int:
    p = short_job_parser(__doc__)
    p.add_argument("--emulate", action="store_true",
                   help="CPU: graph steps emulated (torch backend), to count the graphs the job would capture")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    model, prompts, params = short_job(a.model, a.requests, a.new, "cuda" if torch.cuda.is_available() else "cpu")
    gc.collect()
    t = time.perf_counter()
    gc.collect()  # one full collection, with the model loaded
    gc_s = time.perf_counter() - t
    res = record(model=a.model, gc_collect_s=round(gc_s, 4), gc_objects=len(gc.get_objects()), rows=[])
    print(f"one full gc.collect(): {gc_s:.3f} s over {res['gc_objects']} objects", flush=True)
    for m in a.methods:
        q = method_config(m, 64, 32)
        for graphs in (("emulate",) if a.emulate else (True, False)):
            extra = {"backend": "torch"} if a.emulate else {}
            with Engine(model, EngineConfig(quant=q, kv_budget_bytes=int(a.budget_gib * (1 << 30)), cuda_graphs=graphs,
                                            **extra)) as e:
                for run in ("cold", "warm"):
                    t = time.perf_counter()
                    outs = e.generate([Request(i, pr, params) for i, pr in enumerate(prompts)])
                    wall = time.perf_counter() - t
                    st = e.stats
                    row = {"method": m, "cuda_graphs": graphs, "run": run, "wall_s": round(wall, 3),
                           "tokens": sum(len(o.output_ids) for o in outs), "steps": st.scheduler.steps,
                           "graph_steps": st.graph_steps, "prefill_graph_steps": st.prefill_graph_steps,
                           "eager_steps": st.eager_steps, "graph_decode_s": round(st.graph_decode_s, 3),
                           "eager_decode_s": round(st.eager_decode_s, 3), "mixed_s": round(st.mixed_s, 3),
                           "peak_batch": st.scheduler.peak_batch,
                           "graphs_captured": e.graph_count}
                    res["rows"].append(row)
                    print(row, flush=True)
    save(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
