"""Where a serving step spends its GPU time, per cache method (H200 diagnosis for issue #6).

    PYTHONPATH=src python3 bench/profile_serving.py --out $OUT/profile_serving.json
    PYTHONPATH=src python3 bench/profile_serving.py --phase prefill --batched-tokens 8192 --steps 4

Runs the serve-bench model (v2-lite geometry, random weights) under ``torch.profiler`` and prints, per
method, the CUDA time of each kernel family per step and the wall time per step. ``--phase decode``
(default): eager decode steps of ``--batch`` rows, profiled after every prompt is in. ``--phase
prefill``: the job's first ``--steps`` steps, which are all prefill chunks of ``--batched-tokens``.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from quantmla.serving.bench import build_bench_model, method_config
from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.graphs import EngineObserver
from quantmla.serving.scheduler import Request, SamplingParams

from common import record, save  # bench/common.py


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=1536)
    p.add_argument("--steps", type=int, default=24, help="decode steps profiled")
    p.add_argument("--methods", nargs="+", default=["bf16", "int4/int4", "int2/int4"])
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    p.add_argument("--batched-tokens", type=int, default=8192, help="max_num_batched_tokens (prefill chunk budget)")
    p.add_argument("--content-group", type=int, default=64)
    p.add_argument("--rope-group", type=int, default=32)
    p.add_argument("--preset", default="v2-lite", help="serve-bench model preset (tiny: a CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", type=int, default=0, help="also list the N costliest torch ops by input shapes")
    p.add_argument("--kv-budget-gib", type=float, default=8.0, help="KV cache budget (enough for --batch x --prompt)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    model = build_bench_model(a.preset, a.device, torch.bfloat16, 0)
    cuda = a.device.startswith("cuda")
    acts = ([ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if a.shapes else [])) if cuda else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator().manual_seed(0)
    res = {**record(), "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "batch": a.batch, "prompt": a.prompt, "steps": a.steps, "phase": a.phase,
           "max_num_batched_tokens": a.batched_tokens, "content_group": a.content_group, "rope_group": a.rope_group,
           "methods": {}}
    for m in a.methods:
        q = method_config(m, a.content_group, a.rope_group)
        cfg = EngineConfig(quant=q, kv_budget_bytes=int(a.kv_budget_gib * (1 << 30)), max_num_seqs=a.batch, max_num_batched_tokens=a.batched_tokens,
                           cuda_graphs=False, max_model_len=a.prompt + a.steps + a.batch + 8)
        e = Engine(model, cfg)
        warm = [Request(f"w{i}", torch.randint(3, min(1000, model.config.vocab_size), (64,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=3, ignore_eos=True)) for i in range(2)]
        e.generate(warm)
        reqs = [Request(i, torch.randint(3, model.config.vocab_size, (a.prompt,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=a.steps + a.batch + 2, ignore_eos=True)) for i in range(a.batch)]
        # the profiled window starts at the first step of the phase asked for (an engine observer)
        state = {"prof": None, "decode_steps": 0, "t": 0.0, "wall": 0.0, "tokens": 0}

        class Window(EngineObserver):
            def mine(self, plan) -> bool:
                if a.phase == "decode":
                    return plan.is_decode and len(plan.items) == a.batch
                return not plan.is_decode and state["prof"] is not False

            def step_begin(self, plan):
                if self.mine(plan) and state["prof"] is None:
                    sync()
                    state["prof"] = profile(activities=acts, record_shapes=a.shapes > 0)
                    state["prof"].__enter__()
                    state["t"] = time.perf_counter()

            def step_end(self, timing):
                plan = timing.plan
                if not (self.mine(plan) and state["prof"]):
                    return
                state["decode_steps"] += 1
                state["tokens"] += sum(it.n for it in plan.items)
                if a.phase == "prefill" and state["decode_steps"] == a.steps:
                    sync()
                    state["wall"] = time.perf_counter() - state["t"]
                    state["prof"].__exit__(None, None, None)
                    state["prof_done"], state["prof"] = state["prof"], False

        e.observers.append(Window())
        e.generate(reqs)
        sync()
        if a.phase == "prefill":
            prof, wall = state.get("prof_done"), state["wall"]
        else:
            wall, prof = time.perf_counter() - state["t"], state["prof"]
            if prof is not None:
                prof.__exit__(None, None, None)
        if not prof:
            print(f"{m}: no {a.phase} step profiled")
            continue
        n = max(1, state["decode_steps"])
        fam: dict[str, float] = {}
        for ev in prof.key_averages():
            # self device time: the kernels' own (a CPU op recorded with --shapes has none of its own)
            us = getattr(ev, "self_device_time_total", getattr(ev, "self_cuda_time_total", 0)) if cuda else ev.self_cpu_time_total
            if us <= 0:
                continue
            fam[ev.key[:90]] = fam.get(ev.key[:90], 0.0) + us / n
        top = sorted(fam.items(), key=lambda kv: -kv[1])[:14]
        total = sum(fam.values())
        res["methods"][m] = {"format": q.describe(), "steps": n, "tokens_per_step": state["tokens"] / n,
                             "wall_ms_per_step": 1e3 * wall / n,
                             "gpu_us_per_step": total, "top_us_per_step": dict(top)}
        if a.shapes and cuda:  # torch ops by input shapes: which call launches the costly kernels
            ops = [(ev.device_time_total / n, ev.count // n, ev.key, str(ev.input_shapes)[:160])
                   for ev in prof.key_averages(group_by_input_shape=True)
                   if ev.key.startswith("aten::") and ev.device_time_total > 0]
            ops.sort(key=lambda o: -o[0])
            res["methods"][m]["top_ops_by_shape"] = [dict(us_per_step=u, calls_per_step=c, op=k, shapes=sh)
                                                     for u, c, k, sh in ops[: a.shapes]]
        print(f"\n== {m} ({q.describe()}): {n} {a.phase} steps of {state['tokens'] / n:.0f} tokens, wall {1e3 * wall / n:.2f} ms/step, "
              f"GPU kernels {total / 1e3:.2f} ms/step")
        for k, v in top:
            print(f"  {v:9.1f} us  {k}")
        for o in res["methods"][m].get("top_ops_by_shape", []):
            print(f"  {o['us_per_step']:9.1f} us  x{o['calls_per_step']:<4} {o['op']} {o['shapes']}")
        e.close()
        del e
        if cuda:
            torch.cuda.empty_cache()
    save(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
