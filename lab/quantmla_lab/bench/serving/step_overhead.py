"""How much of a graph-replayed decode step is GPU work and how much is host time (H200, issue #6).

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.step_overhead --out $OUT/step_overhead_h200.json

Per cache method and batch size: run a small job (``--batches`` rows of ``--prompt`` tokens, ``--new``
new tokens each, no cache pressure) with CUDA graphs, and take the mean wall time of its graph decode
steps (scheduling, host-to-device copies, replay, and the sampled tokens' trip back). Then replay that
bucket's graph back to back and time it with CUDA events: the GPU time of one step. The difference is
host time the GPU spends idle, the same for every cache format.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics

import torch

from quantmla.kernels import api
from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.scheduler import Request, SamplingParams
from quantmla_lab.bench.common import record, save
from quantmla_lab.bench.serving.throughput import build_bench_model, method_config


def replay_ms(graph, n: int = 100) -> float:
    """Median GPU milliseconds of one replay, over n back-to-back replays in 5 timed groups."""
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n // 5):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / (n // 5))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["bf16", "int4/int4"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt", type=int, default=1900)
    p.add_argument("--new", type=int, default=200)
    p.add_argument("--content-group", type=int, default=128)
    p.add_argument("--rope-group", type=int, default=64)
    p.add_argument("--preset", default="v2-lite")
    p.add_argument("--min-chunks", nargs="+", type=int, default=[0],
                   help="decode split floors to compare in one process (0: the API default)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_overhead.py times CUDA graphs: it needs a CUDA device")
    model = build_bench_model(a.preset, "cuda", torch.bfloat16, 0)
    g = torch.Generator().manual_seed(0)
    vocab = min(1000, model.config.vocab_size)
    rows = []
    for m, b, k in itertools.product(a.methods, a.batches, a.min_chunks):
        # the engine's decode tiling (graph plans and eager steps): the API default, or it with split floor k
        tiling = (lambda *args, k=k: dataclasses.replace(api.default_config(*args), min_chunk=k)) if k else None
        cfg = EngineConfig(quant=method_config(m, a.content_group, a.rope_group), kv_budget_bytes=4 << 30,
                           max_num_seqs=b, max_num_batched_tokens=8192, max_model_len=a.prompt + a.new + 8,
                           decode_config=tiling)
        e = Engine(model, cfg)
        reqs = [Request(i, torch.randint(3, vocab, (a.prompt,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=a.new, ignore_eos=True)) for i in range(b)]
        e.generate(reqs[:1] if b > 1 else reqs)  # warm-up: kernels compiled, graphs of small buckets captured
        e.capture_graphs()
        e.generate(reqs)
        st = e.stats
        wall = 1e3 * st.graph_decode_s / max(1, st.graph_steps)
        bucket, graph = e.decode_graph(b)
        gpu = replay_ms(graph)
        floor = k or api.default_config(16, next(iter(e.backend.layouts.values())), "cuda").min_chunk
        rows.append({"method": m, "batch": b, "min_chunk": floor, "bucket": bucket, "graph_steps": st.graph_steps,
                     "step_wall_ms": round(wall, 3), "replay_gpu_ms": round(gpu, 3), "host_ms": round(wall - gpu, 3)})
        print(f"{m:10} batch {b:3} (bucket {bucket:3}) split floor {floor:3}: step wall {wall:6.3f} ms, graph GPU {gpu:6.3f} ms, "
              f"host {wall - gpu:6.3f} ms over {st.graph_steps} steps", flush=True)
        e.close()
        del e
        torch.cuda.empty_cache()
    res = record(prompt=a.prompt, new=a.new, content_group=a.content_group, rope_group=a.rope_group, rows=rows)
    save(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
