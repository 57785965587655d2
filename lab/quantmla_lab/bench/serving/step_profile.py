"""Where a serving step spends its GPU time, per cache method: kernel families and the step's parts.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.step_profile --out $OUT/profile_serving.json
    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.step_profile --phase prefill --batched-tokens 8192 \
        --steps 4

Runs the serve-bench model (v2-lite geometry, random weights) under ``torch.profiler`` and prints, per
method, the CUDA time of each kernel family per step and the wall time per step. ``--phase decode``
(default): eager decode steps of ``--batch`` rows, profiled after every prompt is in. ``--phase
prefill``: the job's first ``--steps`` steps, which are all prefill chunks of ``--batched-tokens``.
Each method's ``parts`` split a step into attention, cache append, projections and MLP, sampling,
other kernels and host time, with the bytes attention and the weights must read and the fraction of
the device's copy bandwidth they reach (``copy_GBps``, measured first). In the prefill phase each method
also gets ``prefill``: tokens/s and TFLOP/s of the dense part (the layers' linear maps over the chunk's
tokens, kv_b_proj over the context it reads back, the LM head over sampled rows) and of the attention
part (causal, non-absorbed: d_qk + d_v multiply-adds per query, key and head), against a bf16 matmul's
rate measured first (``matmul_bf16_TFLOPs``).

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.step_profile --batch 32 --prompt 16384 --steps 6 \
        --kv-budget-gib 20 --content-group 128 --rope-group 64 --batched-tokens 16384 --methods bf16 fp8 int4/int4 int2/int4
"""

from __future__ import annotations

import argparse
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.graphs import EngineObserver
from quantmla.serving.scheduler import Request, SamplingParams
from quantmla_lab.bench.common import record, save
from quantmla_lab.bench.serving.throughput import build_bench_model, method_config

PARTS = (  # kernel name patterns of each part of a step, first match wins
    ("attention", re.compile(r"mla_decode|_mla_combine|mla_prefill")),
    ("cache append", re.compile(r"_append_kernel|_read_kernel")),
    ("projections and MLP", re.compile(r"gemm|nvjet|cutlass|sm90_xmma|ampere_|matmul|cublas", re.I)),
    ("sampling", re.compile(r"argmax|ArgMax|topk|sort|isfinite|softmax", re.I)),
)


def weight_bytes(model) -> int:
    """Bytes of the weights one step reads: every parameter once, less the input embedding table, of
    which a step reads only its tokens' rows (a table tied to the LM head is read whole, and counted)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    if head is None or head.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def step_parts(fam: dict, engine, model, batch: int, context: float, copy_gbps: float, wall_s: float) -> dict:
    """The step's GPU time (``fam``: µs per step by kernel name) split into attention, cache append,
    projections and MLP, sampling and the rest, with the bytes each part must read (attention: ``batch``
    rows of ``context`` cached tokens, mean over the steps, every layer's record; projections and MLP:
    :func:`weight_bytes`) and the fraction of copy bandwidth (GB/s) it reaches; host time is the wall
    time per step (``wall_s``, seconds) less the GPU time (the step is not overlapped). -> {part:
    {us_per_step, bytes_per_step, GBps, frac_copy}}"""
    parts = {name: 0.0 for name, _ in PARTS} | {"other": 0.0}
    for k, us in fam.items():
        parts[next((name for name, pat in PARTS if pat.search(k)), "other")] += us
    need = {"attention": batch * context * engine.bytes_per_token, "projections and MLP": weight_bytes(model)}
    out = {}
    for name, us in parts.items():
        row = {"us_per_step": round(us, 1)}
        if name in need and us > 0:
            gbps = need[name] / (us * 1e-6) / 1e9
            row.update(bytes_per_step=int(need[name]), GBps=round(gbps, 1), frac_copy=round(gbps / copy_gbps, 3))
        out[name] = row
    out["host"] = {"us_per_step": round(max(0.0, wall_s * 1e6 - sum(parts.values())), 1)}
    return out


def matmul_rate(device: str) -> float:
    """TFLOP/s of an 8192^3 bf16 matmul (median of 20 after 5), the dense rate prefill is measured against."""
    if not device.startswith("cuda"):
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        a @ a
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
    for e0, e1 in ev:
        e0.record()
        a @ a
        e1.record()
    torch.cuda.synchronize()
    ms = sorted(e0.elapsed_time(e1) for e0, e1 in ev)[len(ev) // 2]
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def prefill_flops(model, items) -> dict[str, float]:
    """FLOPs of one prefill step of ``items`` (start, n, sample) per sequence: ``dense`` (every decoder
    layer's linear maps over the n new tokens, kv_b_proj over the start + n context tokens the chunk
    reads back, the LM head over sampled rows) and ``attention`` (causal, non-absorbed: a query at
    position p meets p + 1 keys, 2·(d_qk + d_v) FLOPs per pair and head)."""
    c = model.config
    layers = model.model.layers
    lin = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    kvb = sum(layer.self_attn.kv_b_proj.weight.numel() for layer in layers)
    head = model.get_output_embeddings().weight.numel()
    d_qk, d_v, H = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, c.num_attention_heads
    dense = attn = 0.0
    for start, n, sample in items:
        dense += 2.0 * (lin - kvb) * n + 2.0 * kvb * (start + n) + (2.0 * head if sample else 0.0)
        pairs = n * start + n * (n + 1) / 2
        attn += 2.0 * (d_qk + d_v) * H * pairs * len(layers)
    return {"dense": dense, "attention": attn}


def copy_bandwidth(device: str) -> float:
    """Copy GB/s (bytes read + written) of a 1 GiB device-to-device copy (64 MiB in host memory on the
    CPU), the ceiling the parts are measured against."""
    cuda = device.startswith("cuda")
    src = torch.empty((1 << 30) if cuda else (1 << 26), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync()
    return 2 * 10 * src.numel() / (time.perf_counter() - t0) / 1e9


def kernel_families(prof, steps: int, cuda: bool) -> dict[str, float]:
    """µs per step (over ``steps`` profiled steps) of each kernel name (CUDA: its self device time) or op
    name (CPU: its self CPU time) in a finished ``torch.profiler`` window, names cut at 90 characters."""
    fam: dict[str, float] = {}
    for ev in prof.key_averages():
        # self device time: the kernels' own (a CPU op recorded with --shapes has none of its own)
        us = (getattr(ev, "self_device_time_total", getattr(ev, "self_cuda_time_total", 0)) if cuda
              else ev.self_cpu_time_total)
        if us > 0:
            fam[ev.key[:90]] = fam.get(ev.key[:90], 0.0) + us / steps
    return fam


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
    copy_gbps = copy_bandwidth(a.device)
    mm = matmul_rate(a.device) if a.phase == "prefill" else None
    print(f"copy bandwidth {copy_gbps:.0f} GB/s" + (f", bf16 matmul {mm:.0f} TFLOP/s" if mm else ""), flush=True)
    cuda = a.device.startswith("cuda")
    acts = ([ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if a.shapes else [])) if cuda else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator().manual_seed(0)
    res = {**record(), "copy_GBps": copy_gbps, "matmul_bf16_TFLOPs": mm,
           "device": torch.cuda.get_device_name(0) if cuda else "cpu",
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
        state = {"prof": None, "decode_steps": 0, "t": 0.0, "wall": 0.0, "tokens": 0,
                 "flops": {"dense": 0.0, "attention": 0.0}}

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
                items = [(it.start, it.n, it.sample) for it in plan.items]
                for k, v in prefill_flops(model, items).items():
                    state["flops"][k] += v
                if state["decode_steps"] == a.steps:  # the window closes after --steps steps of the phase
                    sync()
                    state["wall"] = time.perf_counter() - state["t"]
                    state["prof"].__exit__(None, None, None)
                    state["prof_done"], state["prof"] = state["prof"], False

        e.observers.append(Window())
        e.generate(reqs)
        sync()
        prof, wall = state.get("prof_done"), state["wall"]
        if prof is None and state["prof"]:  # the job ended inside the window
            wall, prof = time.perf_counter() - state["t"], state["prof"]
            prof.__exit__(None, None, None)
        if not prof:
            print(f"{m}: no {a.phase} step profiled")
            continue
        n = max(1, state["decode_steps"])
        fam = kernel_families(prof, n, cuda)
        top = sorted(fam.items(), key=lambda kv: -kv[1])[:14]
        total = sum(fam.values())
        context = a.prompt + a.steps / 2 + a.batch / 2  # mean cached tokens per row over the profiled steps
        res["methods"][m] = {"format": q.describe(), "steps": n, "tokens_per_step": state["tokens"] / n,
                             "wall_ms_per_step": 1e3 * wall / n,
                             "gpu_us_per_step": total, "top_us_per_step": dict(top),
                             "parts": step_parts(fam, e, model, a.batch, context, copy_gbps, wall / n)}
        if a.phase == "prefill":  # rates of the dense and attention parts
            parts = res["methods"][m]["parts"]
            t_dense = parts["projections and MLP"]["us_per_step"] * 1e-6
            t_attn = parts["attention"]["us_per_step"] * 1e-6
            fl = {k: v / n for k, v in state["flops"].items()}
            pre = {"tokens_per_s": state["tokens"] / wall,
                   "gpu_tokens_per_s": state["tokens"] / n / (total * 1e-6),
                   "dense_TFLOP_per_step": fl["dense"] / 1e12, "attention_TFLOP_per_step": fl["attention"] / 1e12,
                   "dense_TFLOPs": fl["dense"] / t_dense / 1e12 if t_dense else None,
                   "attention_TFLOPs": fl["attention"] / t_attn / 1e12 if t_attn else None}
            if mm and pre["dense_TFLOPs"]:
                pre["dense_frac_of_matmul"] = pre["dense_TFLOPs"] / mm
            res["methods"][m]["prefill"] = pre
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
        for k, v in res["methods"][m]["parts"].items():
            extra = f"  {v['GBps']:8.0f} GB/s ({v['frac_copy']:.2f} of copy)" if "GBps" in v else ""
            print(f"  part {k:22s} {v['us_per_step']:9.1f} us{extra}")
        if "prefill" in res["methods"][m]:
            pre = res["methods"][m]["prefill"]
            frac = pre.get("dense_frac_of_matmul", float("nan"))
            print(f"  prefill {pre['tokens_per_s']:.0f} tok/s (GPU only {pre['gpu_tokens_per_s']:.0f}); dense "
                  f"{pre['dense_TFLOPs'] or 0:.0f} TFLOP/s ({frac:.2f} of the matmul), "
                  f"attention {pre['attention_TFLOPs'] or 0:.0f} TFLOP/s")
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
