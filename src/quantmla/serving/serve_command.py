"""`quantmla serve`: offline generation of a checkpoint on the paged low-bit cache.

    quantmla serve CKPT --prompts prompts.txt --out outputs.jsonl --kv-budget-gib 2 --max-new-tokens 256

Prompts come from a ``.txt`` file (one prompt per line) or a ``.jsonl`` file (one object per line
with ``"prompt"`` text or ``"prompt_ids"``, and optionally ``"id"`` and ``"max_new_tokens"``).
The cache formats are the checkpoint's own (``quantmla calibrate`` writes them), or those asked
for with ``--content-bits/--rope-bits``, or BF16. Outputs are written as JSONL in the order of
the prompts, with ``finish_reason`` "length", "eos" or "error" (a request that cannot run — it can
never fit in the KV budget, its prompt is empty or has ids outside the vocabulary — fails alone,
with the reason, and the command exits with status 1).
"""

from __future__ import annotations

import json
import os
import sys


def add_arguments(p):
    p.add_argument("model", help="checkpoint directory (config.json, safetensors weights, tokenizer)")
    p.add_argument("--prompts", required=True, help=".txt (one prompt per line) or .jsonl ({'prompt'|'prompt_ids', 'id'?})")
    p.add_argument("--out", default=None, help="write outputs here as JSONL (default: print them)")
    p.add_argument("--kv-budget-gib", type=float, default=1.0, help="KV cache budget in GiB over all layers")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens to generate per prompt (a .jsonl line's max_new_tokens overrides it)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--content-bits", type=int, default=None, help="content path bits (default: the checkpoint's, else BF16)")
    p.add_argument("--rope-bits", type=int, default=None, help="RoPE path bits (with --content-bits)")
    p.add_argument("--content-group", type=int, default=64, help="content channels per scale/zero group (with --content-bits)")
    p.add_argument("--rope-group", type=int, default=32, help="RoPE channels per scale/zero group (with --rope-bits)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="compute dtype of the model")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                   help="paged attention backend (auto: Triton kernels where they run, else torch)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly (no CUDA graph replay)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per engine step")
    p.add_argument("--max-batched-tokens", type=int, default=8192, help="tokens per engine step (prefill chunk budget)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def read_prompts(path: str) -> list[dict]:
    """Prompt records from a .txt or .jsonl file: dicts with "id" and "prompt" or "prompt_ids"."""
    from quantmla.cli import CLIError

    if not os.path.isfile(path):
        raise CLIError(f"prompts file {path!r} does not exist")
    records, seen = [], set()  # seen: the ids so far, as JSON text (an id may be any JSON value)
    with open(path, encoding="utf-8", newline="") as f:  # lines end at \n (or \r\n) only: a form feed or U+2028
        lines = [line.removesuffix("\r") for line in f.read().split("\n")]  # inside a prompt stays in it
    if path.endswith(".jsonl"):
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise CLIError(f"{path}:{i}: not a JSON object ({e.msg})") from None
            if not isinstance(r, dict) or ("prompt" in r) == ("prompt_ids" in r):
                raise CLIError(f"{path}:{i}: each line needs exactly one of \"prompt\" (text) or \"prompt_ids\" (token ids)")
            if "prompt_ids" in r and not (isinstance(r["prompt_ids"], list) and r["prompt_ids"]
                                          and all(isinstance(t, int) and t >= 0 for t in r["prompt_ids"])):
                raise CLIError(f"{path}:{i}: \"prompt_ids\" must be a non-empty list of token ids")
            m = r.get("max_new_tokens", 1)
            if not (isinstance(m, int) and not isinstance(m, bool) and m >= 1):
                raise CLIError(f"{path}:{i}: \"max_new_tokens\" must be a positive integer, got {m!r}")
            r.setdefault("id", len(records))
            if json.dumps(r["id"], sort_keys=True) in seen:
                raise CLIError(f"{path}:{i}: id {r['id']!r} is taken (a line without an id takes its line's number "
                               "among the prompts): give every line its own id, or none")
            seen.add(json.dumps(r["id"], sort_keys=True))
            records.append(r)
    else:
        records = [{"id": i, "prompt": line} for i, line in enumerate(x for x in lines if x.strip())]
    if not records:
        raise CLIError(f"{path}: no prompts (empty lines are skipped)")
    return records


def check_lengths(records: list[dict], reqs: list, max_positions: int | None) -> None:
    """Refuse, before any weights are read, a request whose prompt plus new tokens runs past the
    positions the model is built for (its RoPE tables and training stop there)."""
    from quantmla.cli import CLIError

    if not max_positions:
        return
    for r, q in zip(records, reqs):
        need = q.positions
        if need > max_positions:
            raise CLIError(
                f"prompt {r['id']!r} has {len(q.prompt)} tokens; with {q.params.max_new_tokens} new tokens it needs "
                f"{need} positions, but the model has max_position_embeddings {max_positions}: shorten the prompt or "
                "lower --max-new-tokens (or the line's max_new_tokens)")


def run(args) -> int:
    import time

    import torch
    from tqdm.auto import tqdm

    from quantmla.cache.config import QuantCacheConfig, resolve_cache_config
    from quantmla.checks import check_device, check_output_file, check_positive
    from quantmla.cli import CLIError
    from quantmla.errors import QuantMLAError
    from quantmla.model.load import check_model_dir, load_model
    from quantmla.serving.engine import BF16_CONFIG, Engine, EngineConfig
    from quantmla.serving.scheduler import Request, SamplingParams

    if (args.content_bits is None) != (args.rope_bits is None):
        raise CLIError("give both --content-bits and --rope-bits, or neither (the checkpoint's formats, else BF16)")
    check_positive(args.max_new_tokens, "--max-new-tokens", integer=True)
    check_positive(args.kv_budget_gib, "--kv-budget-gib")
    for flag in ("content_group", "rope_group", "max_num_seqs", "max_batched_tokens"):
        check_positive(getattr(args, flag), "--" + flag.replace("_", "-"), integer=True)
    records = read_prompts(args.prompts)
    check_output_file(args.out)  # a bad --out fails now, not after generating
    device = check_device(args.device) or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    spec = check_model_dir(args.model)  # clear errors for a missing path, no config.json, a non-MLA model, bad weights
    from transformers import AutoConfig, AutoTokenizer

    model_config = AutoConfig.from_pretrained(args.model)  # formats are settled before any weight is read
    requested = None
    if args.content_bits is not None:
        requested = QuantCacheConfig.of_bits(args.content_bits, args.rope_bits, args.content_group, args.rope_group)
    if requested is None and QuantCacheConfig.from_model_config(model_config) is None:
        quant = BF16_CONFIG
    else:
        quant = resolve_cache_config(model_config, requested)
    quant.check_model(spec)
    try:
        tok = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError, TypeError) as e:
        raise QuantMLAError(f"{args.model}: no usable tokenizer ({e}); the checkpoint directory must hold its tokenizer files") from None
    reqs = []
    for r in records:
        ids = r["prompt_ids"] if "prompt_ids" in r else tok(r["prompt"], add_special_tokens=True)["input_ids"]
        n_new = int(r.get("max_new_tokens", args.max_new_tokens))
        reqs.append(Request(r["id"], list(ids), SamplingParams(max_new_tokens=n_new, ignore_eos=args.ignore_eos)))
    check_lengths(records, reqs, spec.max_positions)
    model, tok = load_model(args.model, dtype=dtype, device=device)
    cfg = EngineConfig(quant=quant, kv_budget_bytes=int(args.kv_budget_gib * (1 << 30)), backend=args.backend,
                       cuda_graphs=not args.no_cuda_graphs, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_batched_tokens)
    t0 = time.perf_counter()
    with Engine(model, cfg) as engine:
        print(f"serving {args.model}: {quant.describe()}, {engine.num_pages} pages of {cfg.page_size} tokens "
              f"({engine.bytes_per_token:.0f} B/token over {len(engine.formats)} layers), backend {engine.backend.name}, "
              f"{len(reqs)} requests", file=sys.stderr)
        if engine.backend.fallback_reason:
            print(f"  (the Triton kernels cannot run this: {engine.backend.fallback_reason})", file=sys.stderr)
        with tqdm(total=len(reqs), desc="requests", unit="req", disable=args.no_progress, leave=False) as bar:
            outs = engine.generate(reqs, on_step=lambda done, total: bar.update(done - bar.n))
        st = engine.stats
    wall = time.perf_counter() - t0
    out_f = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    try:
        for r, o in zip(records, outs):
            row = {"id": o.request_id, "prompt_tokens": o.prompt_len, "output_ids": o.output_ids,
                   "text": tok.decode(o.output_ids, skip_special_tokens=True), "finish_reason": o.finish_reason}
            if "prompt" in r:
                row["prompt"] = r["prompt"]
            if o.error:
                row["error"] = o.error
            out_f.write(json.dumps(row, ensure_ascii=False) + "\n")
    finally:
        if args.out:
            out_f.close()
    print(f"{st.completed}/{st.requests} requests, {st.output_tokens} tokens in {st.wall_s:.2f} s "
          f"({st.tokens_per_s:.1f} tok/s), peak batch {st.scheduler.peak_batch}, preemptions {st.scheduler.preemptions}"
          f"; {wall:.1f} s with setup" + (f"; wrote {args.out}" if args.out else ""), file=sys.stderr)
    for o in outs:
        if o.error:
            print(f"request {o.request_id!r} failed: {o.error}", file=sys.stderr)
    return 0 if st.failed == 0 else 1
