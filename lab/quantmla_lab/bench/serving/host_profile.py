"""Host time of a job's prefilling steps: how long each takes to launch, and which Python functions that time is in.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.host_profile --out $OUT/profile/host_prefill_steps_h200.json

The serve-bench model (v2-lite geometry, random weights) runs one small job three times per method, as serve-bench
runs jobs (CUDA graphs for decode rows and short first chunks, the rest eager): once to compile and capture, once
timed, and once under ``cProfile`` switched on only inside the steps that prefill (an engine observer). The job's
prompts are longer than the step's token budget, so that, as in the ``long`` job, later steps carry a prompt's
remainder beside the decode rows of the requests already in. Reported per method: each prefilling step of the
timed run (prompt tokens, decode rows, kind, launch and total ms: host seconds until its GPU work was queued and
until its tokens were back), the profiled run's synchronizing CUDA calls in each such step and where in Python they
are made (torch's sync debug mode), and its costliest functions by own time and by cumulative time, in ms per
prefilling step. The profiler slows the host, so its figures place the time; the timed run measures it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import warnings

import torch

from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.graphs import EngineObserver
from quantmla.serving.scheduler import Request, SamplingParams
from quantmla_lab.bench.common import parse_fresh, record, save
from quantmla_lab.bench.serving.throughput import build_bench_model, method_config


SYNC_WARNING = "synchronizing CUDA operation"  # the words of torch's sync debug mode warnings


class PrefillSteps(EngineObserver):
    """Records every prefilling step's timing and, with ``profiler`` given, profiles only those steps; with
    ``syncs`` (the list a ``warnings.catch_warnings(record=True)`` fills while torch's CUDA sync debug mode warns),
    each step's synchronizing calls and where in Python they were made."""

    def __init__(self, profiler: cProfile.Profile | None = None, syncs: list | None = None):
        self.steps: list[dict] = []
        self.profiler, self.syncs, self._seen = profiler, syncs, 0

    def step_begin(self, plan):
        if self.syncs is not None:
            self._seen = len(self.syncs)
        if self.profiler is not None and not plan.is_decode:
            self.profiler.enable()

    def step_end(self, timing):
        plan = timing.plan
        if plan.is_decode:
            return
        if self.profiler is not None:
            self.profiler.disable()
        decode = [it.n == 1 and it.start >= it.seq.prompt_len for it in plan.items]  # a generated token's row
        step = {"prompt_tokens": sum(it.n for it, d in zip(plan.items, decode) if not d),
                "decode_rows": sum(decode),
                "kind": timing.kind, "launch_ms": round(1e3 * timing.launch_s, 2),
                "total_ms": round(1e3 * timing.total_s, 2)}
        if self.syncs is not None:
            new = [w for w in self.syncs[self._seen:] if SYNC_WARNING in str(w.message)]
            where = {}
            for w in new:
                k = f"{w.filename.split('/src/')[-1].split('site-packages/')[-1]}:{w.lineno}"
                where[k] = where.get(k, 0) + 1
            step["syncs"] = len(new)
            step["sync_sites"] = where
        self.steps.append(step)


def top_functions(prof: cProfile.Profile, steps: int, n: int, key: str) -> list[dict]:
    """The n functions with the most ``key`` time ("tottime": own, "cumtime": with callees), ms per step."""
    if steps == 0:
        return []
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"function": f"{file.split('site-packages/')[-1].split('/src/')[-1]}:{line}({fn})",
                     "calls_per_step": round(nc / steps, 1), "own_ms_per_step": round(1e3 * tt / steps, 3),
                     "cum_ms_per_step": round(1e3 * ct / steps, 3)})
    k = "own_ms_per_step" if key == "tottime" else "cum_ms_per_step"
    return sorted(rows, key=lambda r: -r[k])[:n]


def job(vocab: int, requests: int, prompt: int, new: int, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(i, torch.randint(3, vocab, (prompt + 97 * i,), generator=g).tolist(),
                    SamplingParams(max_new_tokens=new, ignore_eos=True)) for i in range(requests)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["fp8", "int4/int4"])
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--prompt", type=int, default=6000, help="the shortest prompt; each next one 97 tokens longer")
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--batched-tokens", type=int, default=4096, help="max_num_batched_tokens")
    p.add_argument("--kv-budget-gib", type=float, default=4.0)
    p.add_argument("--content-group", type=int, default=128)
    p.add_argument("--rope-group", type=int, default=64)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--preset", default="v2-lite")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    a = parse_fresh(p) if argv is None else p.parse_args(argv)
    model = build_bench_model(a.preset, a.device, torch.bfloat16 if a.device != "cpu" else torch.float32, 0)
    res = record(settings=vars(a), methods={})
    for m in a.methods:
        cfg = EngineConfig(quant=method_config(m, a.content_group, a.rope_group), kv_budget_bytes=int(a.kv_budget_gib * (1 << 30)),
                           max_num_batched_tokens=a.batched_tokens, backend=a.backend,
                           max_model_len=a.prompt + 97 * a.requests + a.new + 8)
        e = Engine(model, cfg)
        reqs = lambda: job(model.config.vocab_size, a.requests, a.prompt, a.new)
        e.generate(reqs())  # compiles and captures
        timed = PrefillSteps()
        e.observers.append(timed)
        e.generate(reqs())
        e.observers.remove(timed)
        prof = cProfile.Profile()
        with warnings.catch_warnings(record=True) as syncs:
            warnings.simplefilter("always")
            if a.device != "cpu":
                torch.cuda.set_sync_debug_mode("warn")
            profiled = PrefillSteps(prof, syncs)
            e.observers.append(profiled)
            try:
                e.generate(reqs())
            finally:
                prof.disable()
                e.observers.remove(profiled)
                if a.device != "cpu":
                    torch.cuda.set_sync_debug_mode("default")
        if len(profiled.steps) != len(timed.steps):
            raise RuntimeError(f"{m}: the profiled run took {len(profiled.steps)} prefilling steps, the timed run "
                               f"{len(timed.steps)}: the same job should schedule the same steps")
        n = len(profiled.steps)
        res["methods"][m] = {"steps": timed.steps, "profiled_steps": profiled.steps,
                             "by_own_time": top_functions(prof, n, a.top, "tottime"),
                             "by_cumulative_time": top_functions(prof, n, a.top, "cumtime")}
        print(f"== {m}: {n} prefilling steps")
        for s, sp in zip(timed.steps, profiled.steps):
            print(f"  {s['prompt_tokens']:6d} prompt tokens + {s['decode_rows']:2d} decode rows, {s['kind']:13s} "
                  f"launch {s['launch_ms']:8.2f} ms, total {s['total_ms']:8.2f} ms; {sp['syncs']} syncs "
                  + ", ".join(f"{k} x{v}" for k, v in sorted(sp["sync_sites"].items(), key=lambda kv: -kv[1])[:4]))
        print("  own time, ms a step (profiled):")
        for r in res["methods"][m]["by_own_time"][:25]:
            print(f"    {r['own_ms_per_step']:8.3f}  x{r['calls_per_step']:<7} {r['function'][:110]}")
        print("  cumulative, ms a step (profiled):")
        for r in res["methods"][m]["by_cumulative_time"][:25]:
            print(f"    {r['cum_ms_per_step']:8.3f}  x{r['calls_per_step']:<7} {r['function'][:110]}")
        e.close()
        del e
        if a.device != "cpu":
            torch.cuda.empty_cache()
    save(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
