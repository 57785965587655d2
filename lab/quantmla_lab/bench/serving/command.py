"""`quantmla serve-bench`: whole-job throughput under cache pressure, BF16 vs low-bit caches (GPU).

Runs one fixed job (N requests, long prompts, hundreds of output tokens, EOS ignored) under several
KV byte budgets for each cache method on a model with DeepSeek-V2-Lite attention geometry (random
weights), prints a table and saves JSON. ``--check`` first verifies greedy agreement of the engine
with transformers generate() on QuantMLACache (tiny models, and checkpoints under models/).
"""

from __future__ import annotations

import json
import os
import sys
import time

from quantmla_lab.bench.common import save
from quantmla_lab.bench.serving.throughput import (
    JOBS,
    PRESETS,
    BenchSettings,
    job_budgets_gib,
    run_bench,
)
from quantmla_lab.bench.serving.throughput_report import format_table

CHECKS_DEVICE = True  # check_args checks --device (after the model path), with the GPU job's own advice


def add_arguments(p):
    d = BenchSettings()
    p.add_argument("--preset", choices=sorted(PRESETS), default=d.preset, help="model geometry (default v2-lite)")
    p.add_argument("--model", dest="model_path", default=None, help="serve this checkpoint directory instead of random weights")
    p.add_argument("--requests", type=int, default=d.requests, help="requests in the job")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(d.prompt_min, d.prompt_max), metavar=("MIN", "MAX"),
                   help="prompt lengths (tokens), drawn between MIN and MAX")
    p.add_argument("--output-len", type=int, nargs=2, default=(d.output_min, d.output_max), metavar=("MIN", "MAX"),
                   help="output lengths (tokens), drawn between MIN and MAX (EOS ignored)")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed of the job")
    p.add_argument("--budgets-gib", type=float, nargs="+", default=None,
                   help="KV budgets in GiB (page data, all layers; default "
                        f"{' '.join(map(str, d.budgets_gib))}, or the --job's)")
    p.add_argument("--methods", nargs="+", default=None,
                   help=f"cache methods: bf16, fp8, intC/intR, intC/intR-page (RoPE keys per channel per page), intC/intR-pageN "
                        f"(per channel per block of N tokens) "
                        f"(default: {' '.join(d.methods)}; fp8 only where its 128-channel groups divide the model's d_c)")
    p.add_argument("--content-group", type=int, default=d.content_group, help="content channels per scale/zero group")
    p.add_argument("--rope-group", type=int, default=d.rope_group, help="RoPE channels per scale/zero group")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per cache page")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per engine step")
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help=f"tokens per engine step (prefill chunk budget; default: the --job's, else "
                        f"{d.max_num_batched_tokens})")
    p.add_argument("--watermark", type=float, default=d.watermark, help="fraction of pages admission leaves free")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly (no CUDA graph replay)")
    p.add_argument("--backend", default=d.backend, choices=("auto", "torch", "triton"),
                   help="paged attention backend (auto: Triton kernels where they run, else torch)")
    p.add_argument("--device", default=d.device, help="torch device (the benchmark is meant for cuda)")
    p.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float16", "float32"), help="compute dtype")
    p.add_argument("--max-seconds", type=float, default=0.0, help="start no new run after this many seconds")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="run each budget's methods this many times in turn (the summary and figure take medians)")
    p.add_argument("--stall-seconds", type=float, default=d.stall_seconds,
                   help="end with status 3, naming the method and step, when one engine step or graph capture runs this "
                        "long (a kernel that never returns); 0: never")
    p.add_argument("--graph-units", default=d.graph_units, choices=("length", "rows"),
                   help="how a decode graph bucket deals its work units out: by the real lengths, or the same to every "
                        "row (EngineConfig.graph_units)")
    p.add_argument("--prefill-graph-max", type=int, default=d.prefill_graph_max,
                   help="no prefill graph above this many tokens: longer first chunks run eagerly "
                        "(EngineConfig.prefill_graph_max)")
    p.add_argument("--mixed-decode-graphs", type=int, default=d.mixed_decode_graphs,
                   help="decode rows replay their graph beside eager prompt chunks of at most this many tokens "
                        "(EngineConfig.mixed_decode_graphs; 0: never)")
    p.add_argument("--check", action="store_true", help="first check greedy agreement with transformers generate()")
    p.add_argument("--check-only", action="store_true", help="run only the agreement check")
    p.add_argument("--tie-tol", type=float, default=2e-2, help="agreement check: relative logit margin counted as a tie")
    p.add_argument("--check-families", nargs="*", default=["deepseek_v2"], help="tiny random models to check (none: skip)")
    p.add_argument("--check-refs", nargs="*", default=None, help="checkpoint dirs to check (default: all under models/)")
    p.add_argument("--check-methods", nargs="+", default=["bf16", "int4/int4", "int2/int4"],
                   help="cache methods of the agreement check")
    p.add_argument("--out", default=None, help="JSON output path, the figure beside it (.png); default "
                   "out/serve-bench/serving.json, or agreement.json with --check-only")
    p.add_argument("--overwrite", action="store_true", help="replace an --out (and its figure) that exists")
    p.add_argument("--replot", metavar="RESULT_JSON", default=None, help="only draw the figure of a saved result, then exit")
    p.add_argument("--job", choices=sorted(JOBS), default=None,
                   help="a named job shape (short: prompts 1K-2K, outputs 256-384, 64 requests; long: prompts 16K-24K, "
                        "outputs 1K-1.5K, 32 requests; longest: prompts 60K-64K, outputs 1K, 16 requests); sets "
                        "--requests, --prompt-len and --output-len, and --budgets-gib and --max-batched-tokens (unless "
                        "given) to where BF16 holds about 2, 8 and 32 requests and to 8192 (short) or 16384 tokens")


def run_check(device: str, tie_tol: float, log=print, families=("deepseek_v2",), refs=None,
              methods=("bf16", "int4/int4", "int2/int4")) -> dict:
    import torch

    from quantmla.model.tiny import tiny_model
    from quantmla_lab.bench.serving.agreement import engine_agreement, local_reference_models
    from quantmla_lab.bench.serving.throughput import method_config

    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    models = [(f"tiny:{f}", lambda f=f: tiny_model(f)) for f in families]
    for path in (local_reference_models() if refs is None else refs):
        def load(path=path):
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        models.append((path, load))
    for name, load in models:
        t0 = time.perf_counter()
        model = load().to(device).eval()
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 33, 90, 150, 1)]
        for m in methods:
            q = method_config(m, 32 if model.config.kv_lora_rank < 64 else 64, 16 if model.config.qk_rope_head_dim < 32 else 32)
            # a pool of 24 pages of 16 tokens forces preemptions on the way
            try:
                rep, st = engine_agreement(model, q, prompts, 24, tie_tol, num_pages=24, graph_buckets=(1, 2, 4, 8))
            except Exception as err:
                rows.append({"model": name, "method": m, "ok": False, "error": f"{type(err).__name__}: {err}"})
                log(f"check {name} {m}: FAILED {type(err).__name__}: {err}")
                continue
            row = {"model": name, "method": m, "format": q.describe(), **rep.to_dict(), "preemptions": st["sched_preemptions"],
                   "backend": st["backend"], "cuda_graphs": st["cuda_graphs"], "graph_steps": st["graph_steps"],
                   "graph_error": st.get("graph_error")}
            line = (f"check {name} {m}: exact {rep.exact}/{rep.requests}, ties {rep.ties}, mismatches {rep.mismatches}, "
                    f"preemptions {row['preemptions']}, backend {row['backend']}, graph steps {row['graph_steps']}")
            if st["backend"] != "torch" and (q.content.quantized or q.rope.quantized):
                # the same engine (scheduler, pages, quantizer, preemption) with fp32 torch attention: where it is
                # exact and the kernels are not, the kernels' bf16 operands (as FlashMLA's) moved a latent across
                # a quantization boundary in a later layer, and the sequences part from there
                logic, _ = engine_agreement(model, q, prompts, 24, tie_tol, num_pages=24, backend="torch")
                row["engine_logic"] = {"backend": "torch", **{k: v for k, v in logic.to_dict().items() if k != "details"}}
                row["kernel_rounding_only"] = not rep.ok and logic.ok
                line += f"; engine logic (torch backend, fp32): exact {logic.exact}/{logic.requests}, mismatches {logic.mismatches}"
            rows.append(row)
            log(line)
        del model
        log(f"  ({time.perf_counter() - t0:.1f}s)")
    return {"rows": rows, "ok": all(r["ok"] for r in rows), "tie_tol": tie_tol,
            "ok_up_to_kernel_rounding": all(r["ok"] or r.get("kernel_rounding_only", False) for r in rows)}


def check_methods(methods, args, d_c: int, d_r: int, flag: str = "--methods") -> None:
    """Each cache method parses, fits the model's dims and (unless --backend torch) runs on the Triton
    kernels; errors name the method and what to pass instead."""
    from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout
    from quantmla.errors import QuantMLAError, UnsupportedFormatError
    from quantmla.kernels.api import check_layout_supported
    from quantmla.serving.rope_stage import page_grouped
    from quantmla_lab.bench.serving.throughput import method_config, rope_pages_method

    for m in methods:
        try:
            base, rope_block = rope_pages_method(m)
            q = method_config(base, args.content_group, args.rope_group)
            q.content.check_dim(d_c, f"content path (--content-group, kv_lora_rank {d_c})")
            q.rope.check_dim(d_r, f"RoPE path (--rope-group, qk_rope_head_dim {d_r})")
            rope = q.rope if rope_block is None else page_grouped(q.rope, rope_block)  # EngineConfig.rope_pages
            rope.meta_block(args.page_size)
        except QuantMLAError as e:
            raise type(e)(f"{flag} {m}: {e}") from None
        if args.backend != "torch":
            try:
                check_layout_supported(PageLayout(TokenLayout(d_c, d_r, CacheFormat(q.content, rope)), args.page_size))
            except UnsupportedFormatError as e:
                raise UnsupportedFormatError(
                    f"{flag} {m}: {e}; choose kernel formats such as bf16, int4/int4, int2/int4, int4/int8, or pass "
                    "--backend torch to time the pure-torch reference path instead") from None


def check_args(args) -> None:
    """Bad methods, paths and devices are reported before a model is built or loaded."""
    import torch

    from quantmla.errors import QuantMLAError
    from quantmla.model.spec import load_spec

    if args.model_path:
        spec = load_spec(args.model_path)  # missing path, non-MLA model
        spec.require_latent_cache()
        d_c, d_r = spec.d_c, spec.d_r
    else:
        d_c, d_r = PRESETS[args.preset]["d_c"], PRESETS[args.preset]["d_r"]
    if args.methods is None:  # the default list, less FP8 where its fixed 128-channel groups do not fit
        args.methods = [m for m in BenchSettings().methods if m != "fp8" or d_c % 128 == 0]
    if not args.check_only:
        check_methods(args.methods, args, d_c, d_r)
    from quantmla.checks import check_device, check_positive

    for b in args.budgets_gib or ():
        check_positive(b, "--budgets-gib")
    for flag, (lo, hi) in (("--prompt-len", args.prompt_len), ("--output-len", args.output_len)):
        if not 1 <= lo <= hi:
            raise QuantMLAError(f"{flag} {lo} {hi}: give MIN and MAX tokens with 1 <= MIN <= MAX")
    for flag, v in (("--requests", args.requests), ("--page-size", args.page_size),
                    ("--max-num-seqs", args.max_num_seqs)):
        if v < 1:
            raise QuantMLAError(f"{flag} {v}: give 1 or more")
    if not 0.0 <= args.watermark < 1.0:
        raise QuantMLAError(f"--watermark {args.watermark:g}: the fraction of pages admission leaves free, in [0, 1)")
    if args.repeats < 1:
        raise QuantMLAError(f"--repeats {args.repeats}: give how many times each method runs at each budget (1 or more)")
    if args.stall_seconds < 0:
        raise QuantMLAError(f"--stall-seconds {args.stall_seconds:g}: give seconds a step may run before the run is "
                            "declared stuck, or 0 to never end it")

    if not args.device.startswith("cuda") or torch.cuda.is_available():
        check_device(args.device)  # a name torch does not know, a GPU index past the count
    else:
        raise QuantMLAError(f"--device {args.device}: no CUDA GPU is visible here; serve-bench times the GPU job, so run "
                            "it on a GPU machine (or pass --device cpu --preset tiny for a slow smoke run)")


def _figure(result: dict, json_path: str) -> str:
    from quantmla_lab.bench.serving.throughput_report import plot_curve

    return plot_curve(result, os.path.splitext(json_path)[0] + ".png")


def apply_job(args) -> None:
    """--job's shape into args: requests, prompt and output lengths, and, unless the command line gives them,
    its budgets and its tokens an engine step batches (without --job: the settings' default budgets and chunk
    budget)."""
    if args.job:
        j = JOBS[args.job]
        args.requests, args.prompt_len, args.output_len = j["requests"], j["prompt"], j["output"]
        if args.budgets_gib is None:
            args.budgets_gib = job_budgets_gib(args.job, args.preset, page_size=args.page_size)
        if args.max_batched_tokens is None:
            args.max_batched_tokens = j["batched_tokens"]
    if args.budgets_gib is None:
        args.budgets_gib = list(BenchSettings.budgets_gib)
    if args.max_batched_tokens is None:
        args.max_batched_tokens = BenchSettings.max_num_batched_tokens


def claim_output(args) -> None:
    """--out (default: serving.json, or agreement.json with --check-only) can be written, and neither it nor its
    figure exists unless --overwrite says to replace them (then the old figure goes now, so none is left beside a
    result that draws none)."""
    from quantmla.checks import check_output_file
    from quantmla.errors import QuantMLAError

    if args.out is None:
        args.out = "out/serve-bench/" + ("agreement.json" if args.check_only else "serving.json")
    check_output_file(args.out)  # an unwritable --out fails now, not after the benchmark
    png = os.path.splitext(args.out)[0] + ".png"
    there = [p for p in (args.out, png) if os.path.exists(p)]
    if there and not args.overwrite:
        raise QuantMLAError(f"--out {args.out}: {' and '.join(there)} exist; pass --overwrite to replace them, or "
                            "give another --out")
    if args.overwrite and os.path.exists(png):
        os.remove(png)


def run(args) -> int:
    if args.replot:
        from quantmla_lab.bench.serving.throughput_report import load_result

        print(f"wrote {_figure(load_result(args.replot), args.replot)}")
        return 0
    check_args(args)
    apply_job(args)
    claim_output(args)
    s = BenchSettings(
        preset=args.preset, model_path=args.model_path, requests=args.requests, prompt_min=args.prompt_len[0],
        prompt_max=args.prompt_len[1], output_min=args.output_len[0], output_max=args.output_len[1], seed=args.seed,
        budgets_gib=tuple(args.budgets_gib), methods=tuple(args.methods), content_group=args.content_group,
        rope_group=args.rope_group, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens, watermark=args.watermark, cuda_graphs=not args.no_cuda_graphs,
        backend=args.backend, device=args.device, dtype=args.dtype, max_seconds=args.max_seconds,
        stall_seconds=args.stall_seconds, graph_units=args.graph_units, prefill_graph_max=args.prefill_graph_max,
        mixed_decode_graphs=args.mixed_decode_graphs, repeats=args.repeats,
    )
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    cmd = getattr(args, "command_line", " ".join(sys.argv))
    check = None
    if args.check or args.check_only:
        check = run_check(args.device, args.tie_tol, log, args.check_families, args.check_refs, args.check_methods)
        if args.check_only:
            import datetime

            from quantmla_lab.bench.serving.throughput import _device_name

            save({"device": _device_name(args.device),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": cmd, "correctness": check}, args.out, default=str)
            print(json.dumps({"ok": check["ok"], "ok_up_to_kernel_rounding": check["ok_up_to_kernel_rounding"]}))
            return 0 if check["ok"] else 1
    def partial(res):
        save({**res, "command": cmd, "correctness": check, "partial": True}, args.out, default=str)

    result = run_bench(s, log, on_run=partial)
    result["command"] = cmd
    if check is not None:
        result["correctness"] = check
    save(result, args.out, default=str)
    log(f"saved {args.out}")
    if result.get("runs"):
        log(f"figure: {_figure(result, args.out)}")
    log(format_table(result))
    log("summary: " + json.dumps(result["summary"]))
    failed = [r for r in result.get("runs", []) if not r.get("all_complete_and_unique")]
    if result.get("errors") or not result.get("runs") or failed:
        log(f"serve-bench: {len(result.get('errors', []))} errors, {len(result.get('runs', []))} runs, "
            f"{len(failed)} with a request not completed exactly once (see {args.out})")
        return 1
    return 0 if (check is None or check["ok"]) else 1
