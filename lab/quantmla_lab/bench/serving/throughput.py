"""Cache-pressure serving benchmark: one fixed job under fixed KV byte budgets, BF16 vs low-bit caches.

The job: ``requests`` requests with prompt lengths ~ U[prompt_min, prompt_max] and output lengths
~ U[output_min, output_max] (integers, inclusive, seeded), random token ids, greedy decoding with
EOS ignored, all submitted at t = 0. For each KV budget (bytes of cache pages over all layers) and
each cache method, the engine runs the whole job; whole-job throughput is generated tokens over wall
seconds from submission to the last completion. The model has DeepSeek-V2-Lite's attention
geometry (16 heads, d_c 512, d_r 64, nope 128, value 128, 27 layers, hidden 2048, no query LoRA)
with random weights and dense MLPs (the MoE routing of random weights says nothing about caches).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.errors import QuantMLAError
from quantmla.kernels.partials import partials_setting
from quantmla.serving.engine import BF16_CONFIG, Engine, EngineConfig
from quantmla.serving.scheduler import Request, SamplingParams
from quantmla_lab.bench.serving.compile_watch import CompileWatch
from quantmla_lab.bench.serving.stall import StallWatch
from quantmla_lab.bench.serving.step_log import StepLog
from quantmla_lab.bench.serving.throughput_report import add_ratios, summarize

GIB = 1 << 30

PRESETS = {
    # DeepSeek-V2-Lite attention geometry; dense MLP of V2-Lite's dense-layer width
    "v2-lite": dict(layers=27, hidden=2048, heads=16, d_c=512, d_r=64, d_nope=128, d_v=128, intermediate=10944,
                    vocab=102400, q_lora_rank=None),
    # DeepSeek-V3's attention geometry (128 heads, q_lora 1536) in 8 layers, dense MLPs of V3's dense-layer width:
    # where decode attention runs on the many-heads kernel (mla_decode_wg.cu)
    "v3-slice": dict(layers=8, hidden=7168, heads=128, d_c=512, d_r=64, d_nope=128, d_v=128, intermediate=18432,
                     vocab=129280, q_lora_rank=1536),
    # toy sizes for CPU smoke runs
    "tiny": dict(layers=2, hidden=64, heads=4, d_c=32, d_r=16, d_nope=16, d_v=16, intermediate=96, vocab=128,
                 q_lora_rank=None),
}


@dataclass
class BenchSettings:
    preset: str = "v2-lite"
    model_path: str | None = None  # serve this checkpoint instead of a random model
    requests: int = 64
    prompt_min: int = 1024
    prompt_max: int = 2048
    output_min: int = 256
    output_max: int = 384
    seed: int = 0
    budgets_gib: tuple[float, ...] = (0.25, 0.5, 1.0, 3.0)
    methods: tuple[str, ...] = ("bf16", "fp8", "int4/int4", "int2/int4")
    content_group: int = 64
    rope_group: int = 32
    page_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # prefill chunk budget per step (tokens)
    watermark: float = 0.01
    cuda_graphs: bool = True
    backend: str = "auto"
    device: str = "cuda"
    dtype: str = "bfloat16"
    max_seconds: float = 0.0  # stop starting new runs after this many seconds (0: no limit)
    stall_seconds: float = 300.0  # end the process (status 3) when a step or capture runs this long (0: never)
    graph_units: str = "length"  # EngineConfig.graph_units: a decode graph bucket's units dealt out by length, or by row
    prefill_graph_max: int = 4096  # EngineConfig.prefill_graph_max: longer first chunks run eagerly
    mixed_decode_graphs: int = 0  # EngineConfig.mixed_decode_graphs: decode rows through graphs beside short chunks
    warmup: bool = True
    repeats: int = 1  # each budget's methods run this many times in turn; the summary takes medians
    graph_benefit: bool = True  # time decode steps with and without CUDA graphs on a small decode-heavy job


JOBS = {
    # name: requests, prompt lengths U[min, max], output lengths U[min, max], tokens an engine step batches
    "short": dict(requests=64, prompt=(1024, 2048), output=(256, 384), batched_tokens=8192),
    "long": dict(requests=32, prompt=(16384, 24576), output=(1024, 1536), batched_tokens=16384),
    "longest": dict(requests=16, prompt=(61440, 65536), output=(1024, 1024), batched_tokens=16384),
}
"""Named job shapes: ``short`` (the cache-pressure curve's job), ``long`` (contexts of 17K to 26K
tokens, where attention fills a decode step) and ``longest`` (64K-token contexts), each with the prefill
chunk budget its published runs use."""


def job_budgets_gib(job: str, preset: str = "v2-lite", holds=(2, 8, 32), page_size: int = 64) -> list[float]:
    """KV budgets (GiB, page data over all layers) at which a BF16 cache holds about `holds` requests of
    the job's mean length at once (counts above the job's request count are dropped)."""
    from quantmla.cache.layout import PageLayout, TokenLayout
    from quantmla.cache.layout import preset as fmt_preset

    j, g = JOBS[job], PRESETS[preset]
    mean_tokens = (sum(j["prompt"]) + sum(j["output"])) / 2
    lay = PageLayout(TokenLayout(g["d_c"], g["d_r"], fmt_preset("bf16")), page_size)
    per_request = lay.pages_for(int(mean_tokens)) * lay.page_bytes * g["layers"]
    return [round(n * per_request / GIB, 4) for n in holds if n <= j["requests"]]


def rope_pages_method(name: str) -> tuple[str, int | None]:
    """A serve-bench method name -> (its format's name, its RoPE metadata block: None where the RoPE keys are
    grouped per token, 0 per channel per page, N per channel per block of N tokens): "int4/int4" -> ("int4/int4",
    None), "int4/int4-page" -> ("int4/int4", 0), "int4/int4-page16" -> ("int4/int4", 16)."""
    base, sep, block = name.rpartition("-page")
    if not sep or (block and not block.isdigit()):
        return name, None
    return base, int(block or 0)


def method_config(name: str, content_group: int = 64, rope_group: int = 32) -> QuantCacheConfig:
    """A cache method by name: a named format of ``cache.layout.PRESETS`` ("bf16", "fp8" — fp8_ds_mla —,
    "int4/int4", ...) or any "intC/intR", integer formats at the given group sizes. In serve-bench a name
    ending in "-page" (``int4/int4-page``) is that format with its RoPE keys per channel per page
    (EngineConfig.rope_pages), "-pageN" per channel per block of N tokens (EngineConfig.rope_block)."""
    from quantmla.cache.layout import PRESETS, preset

    n = name.lower()
    if n == "bf16":
        return BF16_CONFIG
    if n in PRESETS:
        f = preset(n, content_group, rope_group)
        return QuantCacheConfig(content=f.content, rope=f.rope)
    try:
        c, r = n.split("/")
        cb, rb = int(c.removeprefix("int")), int(r.removeprefix("int"))
    except ValueError:
        raise QuantMLAError(f"unknown cache method {name!r}: use bf16, fp8 or intC/intR, e.g. int4/int4, int2/int4") from None
    return QuantCacheConfig.of_bits(cb, rb, content_group, rope_group)


def build_bench_model(preset: str = "v2-lite", device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A random-weight deepseek_v2 model of the preset's geometry (all MLPs dense)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    g = PRESETS[preset]
    cfg = AutoConfig.for_model(
        "deepseek_v2", vocab_size=g["vocab"], hidden_size=g["hidden"], intermediate_size=g["intermediate"],
        moe_intermediate_size=g["intermediate"], num_hidden_layers=g["layers"], num_attention_heads=g["heads"],
        num_key_value_heads=g["heads"], kv_lora_rank=g["d_c"], q_lora_rank=g["q_lora_rank"], qk_rope_head_dim=g["d_r"],
        qk_nope_head_dim=g["d_nope"], v_head_dim=g["d_v"], first_k_dense_replace=g["layers"], n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=131072, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=dtype)
    return model.eval()


def make_job(s: BenchSettings, vocab: int) -> list[Request]:
    rng = np.random.default_rng(s.seed)
    plens = rng.integers(s.prompt_min, s.prompt_max + 1, s.requests)
    olens = rng.integers(s.output_min, s.output_max + 1, s.requests)
    reqs = []
    for i, (p, o) in enumerate(zip(plens, olens)):
        ids = rng.integers(3, vocab, int(p)).tolist()
        reqs.append(Request(i, ids, SamplingParams(max_new_tokens=int(o), ignore_eos=True)))
    return reqs


def shaped_warmup(job: list[Request], n: int = 3, new_tokens: int = 2) -> list[Request]:
    """The job's first `n` prompts whole, `new_tokens` tokens each: an untimed pass through the job's own step
    shapes (first chunks at the chunk budget, chunks after a context, decode rows riding in mixed steps), so
    that their kernels compile before the timed run; the short warm-up prompts never reach those shapes."""
    return [Request(f"shape{i}", list(r.prompt), SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            for i, r in enumerate(job[:n])]


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_bench(s: BenchSettings, log=print, model=None, on_run=None) -> dict:
    """Run the job for every budget and method; `on_run(result)` after each run (incremental saves)."""
    t_start = time.perf_counter()
    dtype = getattr(torch, s.dtype)
    if model is None:
        if s.model_path:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(s.model_path, dtype=dtype, attn_implementation="eager").to(s.device)
        else:
            model = build_bench_model(s.preset, s.device, dtype, s.seed)
    model.eval()
    vocab = model.config.vocab_size
    job = make_job(s, vocab)
    max_len = s.prompt_max + s.output_max
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {model.config.model_type}, {n_params / 1e9:.2f}B params, {model.config.num_hidden_layers} layers; "
        f"job: {len(job)} requests, prompts U[{s.prompt_min},{s.prompt_max}], outputs U[{s.output_min},{s.output_max}] "
        f"({sum(r.params.max_new_tokens for r in job)} output tokens)")
    result: dict = {
        "device": _device_name(s.device),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "commit": _source_commit(),
        "partials": partials_setting(),
        "settings": asdict(s),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "model": {"model_type": model.config.model_type, "params": n_params, "layers": model.config.num_hidden_layers,
                  "hidden": model.config.hidden_size, "heads": model.config.num_attention_heads,
                  "d_c": model.config.kv_lora_rank, "d_r": model.config.qk_rope_head_dim,
                  "d_nope": model.config.qk_nope_head_dim, "d_v": model.config.v_head_dim,
                  "weights": "random" if not s.model_path else s.model_path},
        "job": {"requests": len(job), "prompt_tokens": sum(len(r.prompt) for r in job),
                "output_tokens": sum(r.params.max_new_tokens for r in job),
                "distribution": f"prompt ~ U[{s.prompt_min},{s.prompt_max}], output ~ U[{s.output_min},{s.output_max}], "
                                f"integers, seed {s.seed}, EOS ignored, all requests submitted at t=0"},
        "runs": [],
        "skipped": [],
    }
    try:
        import triton

        result["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    budgets = sorted(s.budgets_gib)
    engines: dict[str, Engine] = {}
    watch = StallWatch(s.stall_seconds) if s.stall_seconds > 0 else None
    for m in s.methods:
        base, rope_block = rope_pages_method(m)
        q = method_config(base, s.content_group, s.rope_group)
        cfg = EngineConfig(quant=q, kv_budget_bytes=int(max(budgets) * GIB), page_size=s.page_size,
                           max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                           watermark=s.watermark, backend=s.backend, cuda_graphs=s.cuda_graphs, max_model_len=max_len,
                           rope_pages=rope_block is not None, rope_block=rope_block or 0, graph_units=s.graph_units,
                           prefill_graph_max=s.prefill_graph_max, mixed_decode_graphs=s.mixed_decode_graphs)
        t0 = time.perf_counter()
        try:
            e = Engine(model, cfg)
            if watch is not None:
                e.observers.append(watch.observer(m))
            if s.warmup:
                warm = [Request(f"w{i}", job[i].prompt[: max(2, min(len(job[i].prompt), 300 + 50 * i))],
                                SamplingParams(max_new_tokens=4, ignore_eos=True)) for i in range(min(3, len(job)))]
                e.generate(warm)  # compiles the kernels before any capture
                e.capture_graphs()
                e.generate(warm)
                e.generate(shaped_warmup(job))  # the job's chunk and context shapes, compiled before any timing
                _sync(s.device)
        except Exception as err:  # keep the other methods going; the JSON says what failed
            result.setdefault("errors", []).append({"method": m, "stage": "setup", "error": f"{type(err).__name__}: {err}"})
            log(f"{m}: setup failed: {type(err).__name__}: {err}")
            continue
        engines[m] = e
        log(f"{m}: {q.describe()}, {e.bytes_per_token * 1:.0f} B/token over {len(e.formats)} layers, backend "
            f"{e.backend.name}, graphs {'on' if e.use_graphs else 'off'}; set up in {time.perf_counter() - t0:.1f}s")
        result.setdefault("methods", {})[m] = {
            "format": q.describe(), "bytes_per_token_all_layers": e.bytes_per_token,
            "bytes_per_token_per_layer": e.bytes_per_token / len(e.formats), "page_bytes_all_layers": e.page_bytes,
            "backend": e.backend.name, "cuda_graphs": e.use_graphs, "graph_error": e.graph_error,
            "prefill_graphs": e.use_prefill_graphs, "prefill_graph_error": e.prefill_graph_error,
            "setup_s": round(time.perf_counter() - t0, 2),
        }
    if s.graph_benefit and engines:
        try:
            result["cuda_graph_benefit"] = graph_benefit(engines, vocab, log)
        except Exception as err:
            result.setdefault("errors", []).append({"stage": "graph_benefit", "error": f"{type(err).__name__}: {err}"})
    for b, rep, m in ((b, rep, m) for b in budgets for rep in range(s.repeats) for m in s.methods):
        if m not in engines:
            continue
        if s.max_seconds and time.perf_counter() - t_start > s.max_seconds:
            result["skipped"].append({"budget_gib": b, "method": m, "repeat": rep,
                                      "why": f"time limit {s.max_seconds}s"})
            log(f"skip {m} at {b} GiB" + (f", repeat {rep}" if s.repeats > 1 else "") + ": time limit")
            continue
        e = engines[m]
        try:
            pages = e.set_budget(int(b * GIB))
            with CompileWatch() as compiles:
                steps = StepLog(compiles)
                e.observers.append(steps)
                try:
                    outs = e.generate(job)
                finally:
                    e.observers.remove(steps)
        except Exception as err:
            result.setdefault("errors", []).append({"method": m, "budget_gib": b, "repeat": rep, "stage": "run",
                                                    "error": f"{type(err).__name__}: {err}"})
            log(f"  {b:g} GiB {m}" + (f" repeat {rep}" if s.repeats > 1 else "") + f": failed: {type(err).__name__}: {err}")
            continue
        st = e.stats
        bad = [o.request_id for o, r in zip(outs, job) if not o.ok or len(o.output_ids) != r.params.max_new_tokens]
        ids = [o.request_id for o in outs]
        run = {
            "budget_gib": b, "budget_bytes": int(b * GIB), "method": m, "repeat": rep, "pages": pages,
            "tokens_capacity": pages * s.page_size,
            "requests": len(outs), "completed": st.completed, "failed": st.failed,
            "all_complete_and_unique": not bad and len(set(ids)) == len(ids) == len(job),
            "output_tokens": st.output_tokens, "wall_s": round(st.wall_s, 4),
            "tokens_per_s": round(st.tokens_per_s, 2),
            "peak_batch": st.scheduler.peak_batch, "peak_running": st.scheduler.peak_running,
            "preemptions": st.scheduler.preemptions, "recomputed_tokens": st.scheduler.recomputed_tokens,
            "computed_tokens": st.scheduler.computed_tokens,
            "steps": st.scheduler.steps, "decode_steps": st.scheduler.decode_steps,
            "graph_steps": st.graph_steps, "eager_steps": st.eager_steps,
            "prefill_graph_steps": st.prefill_graph_steps, "eager_chunks": st.eager_chunks,
            "peak_pages_used": st.scheduler.peak_pages_used,
            "graph_decode_s": round(st.graph_decode_s, 3), "eager_decode_s": round(st.eager_decode_s, 3),
            "mixed_s": round(st.mixed_s, 3),
            "step_log": steps.summary(),
        }
        if bad:
            run["incomplete_requests"] = bad[:20]
        result["runs"].append(run)
        if on_run is not None:
            on_run(result)
        c = run["step_log"]["compiles"]
        log(f"  {b:g} GiB {m:10s}" + (f" rep {rep}" if s.repeats > 1 else "")
            + f" {pages:6d} pages  {run['tokens_per_s']:10.1f} tok/s  wall {run['wall_s']:7.2f}s  "
            f"peak batch {run['peak_batch']:4d}  preemptions {run['preemptions']:4d}"
            + (f"  compiled {c['count']} kernels in the run ({c['seconds']:.2f}s)" if c["count"] else ""))
    for e in engines.values():
        e.close()
    if watch is not None:
        watch.close()
    add_ratios(result["runs"])
    result["summary"] = summarize(result)
    result["total_seconds"] = round(time.perf_counter() - t_start, 1)
    return result


def graph_benefit(engines: dict, vocab: int, log=print, sizes=(8, 64), prompt: int = 64, new: int = 24) -> list[dict]:
    """Mean decode-step seconds with CUDA graphs and eagerly, per method and batch size (a decode-heavy job)."""
    rows = []
    rng = np.random.default_rng(1)
    for m, e in engines.items():
        if not e.use_graphs:
            continue
        e.set_budget(num_pages=e.pool_pages)
        plen = max(1, min(prompt, e.max_pages_per_seq * e.config.page_size - new))
        for b in sizes:
            reqs = [Request(i, rng.integers(3, vocab, plen).tolist(), SamplingParams(max_new_tokens=new, ignore_eos=True))
                    for i in range(b)]
            row = {"method": m, "batch": b}
            for mode in (True, False):
                e.use_graphs = mode
                e.generate(reqs)
                st = e.stats
                steps = st.graph_steps if mode else st.eager_decode_steps
                secs = st.graph_decode_s if mode else st.eager_decode_s
                row["graph_step_ms" if mode else "eager_step_ms"] = round(1e3 * secs / max(steps, 1), 3)
            e.use_graphs = True
            row["speedup"] = round(row["eager_step_ms"] / max(row["graph_step_ms"], 1e-9), 2)
            rows.append(row)
            log(f"  decode step {m} batch {b}: graph {row['graph_step_ms']:.2f} ms, eager {row['eager_step_ms']:.2f} ms "
                f"({row['speedup']:.1f}x)")
    return rows




def _source_commit() -> str | None:
    from quantmla_lab.bench.kernels.decode_speed import source_commit

    return source_commit()
