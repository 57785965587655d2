"""`quantmla eval`: held-out bits per byte and retrieval accuracy at 1K/2K/4K under a quantized
cache, for any (model directory, cache config, method); writes <out>/accuracy.json and the Markdown
table <out>/accuracy.md (default out/eval, outside the tracked tree).

    quantmla eval --all                       every shipped reference model, the whole grid
    quantmla eval --all --groups 64/32 32/16 --fp-window 0 32 --device cuda --out results
                                              the committed table: every row in one call
    quantmla eval --all --quick               CI-sized: few chunks and samples, a subset of rows
    quantmla eval models/qmla-ref-deepseek-v3 --config INT4/INT4 --method rtn quantmla
    quantmla eval MODEL --groups 128/32 64/32 --rows BF16:bf16 INT4/INT4:quantmla:128/32 INT4/INT4:rtn
                                              rows in the order given (a timed-out run keeps the first ones)
    quantmla eval --from-json results/accuracy.json --readme README.md
                                              the table and the README's summary block, from the JSON
    quantmla eval --from-json a/accuracy.json b/accuracy.json --out results
                                              runs of one data setting (one per model or GPU) merged

Rows join an existing result file only when they were measured on identical data (table.DATA_KEYS);
a row already there is replaced only with --replace-rows; --overwrite replaces the file.
"""

from __future__ import annotations

import json
import os
import sys
import time

QUICK = dict(seq_len=256, ppl_chunks=4, retrieval_n=4, lengths=[1024], calib_n=4)
FULL = dict(seq_len=512, ppl_chunks=64, retrieval_n=50, lengths=[1024, 2048, 4096], calib_n=16)


def add_arguments(p):
    p.add_argument("models", nargs="*", help="checkpoint directories, or names of reference models under models/")
    p.add_argument("--all", action="store_true", help="every reference model present under models/, the full grid")
    p.add_argument("--quick", action="store_true", help="CI-sized run: few chunks and samples, a subset of rows")
    p.add_argument("--config", nargs="+", default=None,
                   help="cache configs: BF16, FP8, CONTENT/ROPE like INT4/INT4, INT2/INT4, INT4/BF16, MIX<a>/INT4 (content "
                        "INT2 or INT4 per layer, a bits on average; MIX2.5@g64/INT4: the INT4 layers at content "
                        "group 64) (default: the grid)")
    p.add_argument("--method", nargs="+", default=None,
                   help="methods: bf16 rtn kivi hadamard quantmla quantmla-content quantmla-rope quantmla-rope-channel "
                        "quantmla-rope-channel-pagefit quantmla-content-rope-channel (default: the grid)")
    p.add_argument("--rows", nargs="+", default=None, metavar="CONFIG:METHOD[:C/R]",
                   help="rows in this order, instead of --config x --method: e.g. BF16:bf16 INT4/INT4:quantmla:128/32; "
                        "a row without C/R runs at each group setting (--groups, or --content-group/--rope-group)")
    p.add_argument("--out", default=None,
                   help="output directory for accuracy.json/.md (default out/eval, or out/eval-quick with --quick; "
                        "the committed table is results/, written only when named)")
    p.add_argument("--heldout", default=None, help="held-out set directory (default models/heldout)")
    p.add_argument("--kind", default="code", choices=("code", "prose"),
                   help="held-out text for bits per byte (each kind is its own data setting: its own --out)")
    p.add_argument("--seq-len", type=int, default=None, help="perplexity chunk length in tokens (default 512, quick 256)")
    p.add_argument("--ppl-chunks", type=int, default=None, help="held-out chunks for bits per byte (default 64, quick 4)")
    p.add_argument("--retrieval-n", type=int, default=None, help="retrieval samples per length and format (default 50, quick 4)")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="retrieval lengths in tokens, at most the model's max_position_embeddings (default 1024 2048 4096)")
    p.add_argument("--retrieval-formats", nargs="+", default=["key"], choices=("key", "line"),
                   help="key: the `<key> =` lookups the models trained on; line: complete an earlier unique line of "
                        "held-out code from its first half (never trained on), with a control that removes the line")
    p.add_argument("--calib-n", type=int, default=None, help="calibration rows (of --calib-len tokens, training text)")
    p.add_argument("--calib-len", type=int, default=None,
                   help="tokens per calibration row (default --seq-len): rows as long as the contexts served fit the "
                        "RoPE path to the positions it meets there")
    p.add_argument("--calib-steps", type=int, default=None, help="optimizer steps per layer of the learned transforms")
    p.add_argument("--calib-device", default=None,
                   help="where calibration keeps its captured activations and runs its fits (cpu, cuda; default: the "
                        "CPU); the capture forward runs on --device")
    p.add_argument("--content-group", type=int, default=64, help="content channels per scale/zero group")
    p.add_argument("--rope-group", type=int, default=32, help="RoPE channels per scale/zero group")
    p.add_argument("--groups", nargs="+", default=None, metavar="C/R",
                   help="several group settings in one call, e.g. 64/32 32/16 (overrides --content-group/--rope-group)")
    p.add_argument("--content-clip", type=float, default=1.0, metavar="CLIP",
                   help="share of each content group's range its integer codes span (0.875: 1/16 of the range "
                        "clipped at each end), for every row, baselines included; 1 - 2^-k (default 1)")
    p.add_argument("--fp-window", type=int, nargs="+", default=[0], metavar="N",
                   help="newest tokens kept unquantized, the same for every method (KIVI's unfinished block included); "
                        "several values run each")
    p.add_argument("--kivi-block", type=int, default=None, help="KIVI token block (default: the RoPE group size, equal bytes)")
    p.add_argument("--rope-block", type=int, default=None, metavar="TOKENS",
                   help="tokens whose RoPE channels share one scale in the per-channel RoPE methods (default: the page, "
                        "64; 16 stores four blocks a page: at g32/g16 the KIVI-style baseline's 104 B a token)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed (calibration, line-recall sampling; key retrieval reads the first --retrieval-n "
                        "shipped samples)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--resume", action="store_true", help="skip rows already in the output (same data settings)")
    p.add_argument("--replace-rows", action="store_true",
                   help="replace rows already in the output (same data settings) with this run's; without it that is refused")
    p.add_argument("--overwrite", "--no-merge", dest="overwrite", action="store_true",
                   help="replace the output files whole with this run's rows")
    p.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                   help="evaluate nothing: rewrite the Markdown table next to this accuracy.json and print its claims; "
                        "several files (runs on identical data, e.g. one per model or GPU) are merged into --out")
    p.add_argument("--readme", default=None, metavar="README",
                   help="with --from-json: rewrite the generated accuracy summary block of this README")


def _log(msg: str) -> None:
    print(f"[eval {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_groups(text: str, flag: str = "--groups") -> tuple[int, int]:
    """(content_group, rope_group), channels per group, from "C/R" such as "64/32" or "g64/g32"."""
    from quantmla.cli import CLIError

    parts = text.lower().replace("g", "").split("/")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise CLIError(f"{flag} {text}: give CONTENT/ROPE channel counts such as 64/32")
    return int(parts[0]), int(parts[1])


def group_settings(args) -> list[tuple[int, int]]:
    """(content_group, rope_group) pairs from --groups C/R ..., else --content-group/--rope-group."""
    if not args.groups:
        return [(args.content_group, args.rope_group)]
    return list(dict.fromkeys(parse_groups(g) for g in args.groups))


def rows_for(args):
    """Every RowSpec of this call: (configs x methods, or the default grid) x group settings x windows,
    or with --rows each named row (at its own group setting, or at each one) x windows, in that order.
    BF16 rows (nothing grouped, nothing windowed) appear once. --content-clip sets every row's integer
    content path's clip (``PathFormat.clip``), baselines included."""
    from quantmla.cli import CLIError
    from quantmla.quant.format import CLIPS

    clip = getattr(args, "content_clip", 1.0)
    if clip not in CLIPS:
        raise CLIError(f"--content-clip {clip:g}: choose one of {', '.join(f'{c:g}' for c in CLIPS)} (1 - 2^-k)")
    if any(w < 0 for w in args.fp_window):
        raise CLIError(f"--fp-window {' '.join(map(str, args.fp_window))}: windows are token counts >= 0")
    rows, seen = [], set()

    def add(r):
        key = (r.config, r.method, r.kivi_block if r.method == "kivi" else 0, r.fp_window)
        if key not in seen:
            seen.add(key)
            rows.append(r)

    rows = _rows(args, add, rows)
    if getattr(args, "rope_block", None) is not None:
        from quantmla.evaluation.harness import ROPE_CHANNEL

        if not any(r.method in ROPE_CHANNEL for r in rows):
            raise CLIError(f"--rope-block {args.rope_block} sets the RoPE scales' block of the per-channel RoPE methods "
                           f"({', '.join(ROPE_CHANNEL)}); none of these rows uses one: add such a row or leave it out")
    if getattr(args, "kivi_block", None) is not None and not any(r.method == "kivi" for r in rows):
        raise CLIError(f"--kivi-block {args.kivi_block} sets the KIVI-style baseline's token block; none of these rows "
                       "uses method kivi: add such a row or leave it out")
    if clip != 1.0:  # every row's integer content path, baselines included
        from dataclasses import replace

        def clipped(c):  # a MIX config's INT4 layers (mix_high) are part of its content path too
            c = replace(c, content=replace(c.content, clip=clip))
            return c if c.mix_high is None else replace(c, mix_high=replace(c.mix_high, clip=clip))

        rows = [r if not (r.config.content.quantized and r.config.content.mode != "fp8") else
                replace(r, config=clipped(r.config)) for r in rows]
    return rows


def check_rope_block(tokens: int) -> int:
    """--rope-block: a power of two that divides the cache page (the per-channel RoPE scales of a page's blocks
    live in its page metadata)."""
    from quantmla.cache.layout import DEFAULT_PAGE_SIZE
    from quantmla.cli import CLIError

    if tokens < 1 or tokens & (tokens - 1) or DEFAULT_PAGE_SIZE % tokens:
        raise CLIError(f"--rope-block {tokens}: give a power of two that divides the {DEFAULT_PAGE_SIZE}-token page, "
                       "e.g. 32 or 64")
    return tokens


def _rows(args, add, rows):
    """rows_for's rows before the content clip (see there)."""
    from quantmla.errors import QuantMLAError
    from quantmla.evaluation.configs import named_config
    from quantmla.evaluation.harness import ROPE_CHANNEL, RowSpec, default_rows

    from quantmla.cli import CLIError

    rope_block = {} if getattr(args, "rope_block", None) is None else {"rope_page": check_rope_block(args.rope_block)}
    if getattr(args, "rows", None):
        if args.config is not None or args.method is not None:
            raise CLIError("--rows names each row's config and method: leave out --config and --method")
        for spec in args.rows:
            parts = spec.split(":")
            if len(parts) not in (2, 3):
                raise CLIError(f"--rows {spec}: give CONFIG:METHOD or CONFIG:METHOD:C/R, "
                               "such as INT4/INT4:quantmla:128/32")
            settings = [parse_groups(parts[2], f"--rows {spec}, groups")] if len(parts) == 3 else group_settings(args)
            for cg, rg in settings:
                for w in args.fp_window:
                    try:
                        block = rg if args.kivi_block is None else args.kivi_block
                        add(RowSpec(named_config(parts[0], cg, rg), parts[1], block, 0 if parts[1] == "bf16" else w,
                                    **rope_block))
                    except QuantMLAError as e:
                        raise type(e)(f"--rows {spec}: {e}") from None
        return rows
    for cg, rg in group_settings(args):
        block = rg if args.kivi_block is None else args.kivi_block
        for w in args.fp_window:
            window = 0 if w is None else w
            if args.config is None and args.method is None:
                for r in default_rows(cg, rg, quick=args.quick):
                    add(RowSpec(r.config, r.method, block, 0 if r.method == "bf16" else window, **rope_block))
                continue
            configs = args.config or ["INT4/INT4"]
            methods = args.method or ["rtn"]
            for c in configs:
                try:
                    cfg = named_config(c, cg, rg)
                except QuantMLAError as e:
                    raise type(e)(f"--config {c}: {e}") from None
                for m in methods:
                    per_channel = m == "kivi" or m in ROPE_CHANNEL
                    if (m == "bf16") != (not cfg.quantized) or (per_channel and (cfg.rope.mode == "fp8" or not cfg.rope.quantized)):
                        continue  # bf16 pairs only with the BF16 config; per-channel RoPE needs integer RoPE codes
                    add(RowSpec(cfg, m, block, 0 if m == "bf16" else window, **rope_block))
    if not rows:
        raise QuantMLAError(f"no valid (config, method) pair in {args.config} x {args.method}: BF16 goes with method "
                            "bf16, quantized configs with the other methods")
    return rows


def _config_flags(q) -> str:
    """The --config / group flags that select the cache formats of `q` (a QuantCacheConfig)."""
    name = lambda f: "BF16" if not f.quantized else ("FP8" if f.mode == "fp8" else f"INT{f.bits}")  # noqa: E731
    flags = f"--config {name(q.content)}/{name(q.rope)}"
    if q.content.quantized:
        flags += f" --content-group {q.content.group_size}"
    if q.rope.quantized:
        flags += f" --rope-group {q.rope.group_size}"
    return flags


def check_rows(path: str, spec, rows, args) -> None:
    """Each row's formats fit the model's dims, and a checkpoint written by `quantmla calibrate` is
    evaluated only at the formats it was calibrated for, without calibrating it a second time."""
    import json

    from quantmla.cache.config import QuantCacheConfig, check_matches
    from quantmla.errors import QuantMLAError
    from quantmla.evaluation.harness import CALIBRATED

    for r in rows:
        r.config.check_dims(spec.d_c)  # every content format (a MIX row's INT4 layers: their own group)
        if r.config.rope.quantized and r.method != "kivi":
            r.config.rope.check_dim(spec.d_r, f"{r.config.name}: the RoPE path (--rope-group, qk_rope_head_dim {spec.d_r})")
    with open(os.path.join(path, "config.json")) as f:
        stored = QuantCacheConfig.from_model_config(json.load(f))
    if stored is None:
        return
    stored.check_model(spec)  # its RoPE offsets and overrides fit this model (the cache will use them)
    for r in rows:
        if r.method == "bf16":
            continue  # the unquantized reference reads no quantized format
        if r.method == "kivi":
            raise QuantMLAError(
                f"{path} is calibrated ({stored.method}, {stored.describe()}); the KIVI baseline stores RoPE keys its "
                "own way, not in the calibrated formats and without the checkpoint's RoPE offsets. Give the original "
                "checkpoint to compare with KIVI")
        requested = QuantCacheConfig(content=r.config.content, rope=r.config.rope, method=r.method)
        c, rp = r.config.content, r.config.rope
        recalibrate = (f"quantmla calibrate ORIGINAL --content-bits {c.bits} --rope-bits {rp.bits} "
                       f"--content-group {c.group_size} --rope-group {rp.group_size} --out DIR")
        check_matches(stored, requested, fix=(
            f"Evaluate {path} with {_config_flags(stored)}, or calibrate the original checkpoint for {r.config.name} "
            f"({recalibrate}) and evaluate that"))
        if r.method in CALIBRATED:
            raise QuantMLAError(
                f"{path} is already calibrated ({stored.method}, {stored.describe()}); method {r.method} would "
                "calibrate it again on top of the fused transforms. Evaluate it with --method rtn (its cache read at "
                "the calibrated formats), or give the original checkpoint to compare methods"
            )


def check_settings(preset: dict, args, specs: dict) -> None:
    """Bad sizes and lengths beyond a model's positions are refused before any weights are read."""
    from quantmla.cli import CLIError
    from quantmla.corpus import datasets as DS

    for k, flag, lo in (("ppl_chunks", "--ppl-chunks", 1), ("retrieval_n", "--retrieval-n", 1), ("seq_len", "--seq-len", 2),
                        ("calib_n", "--calib-n", 1), ("calib_len", "--calib-len", 2)):
        if preset[k] < lo:
            raise CLIError(f"{flag} {preset[k]}: must be at least {lo}")
    if not preset["lengths"]:
        raise CLIError("--lengths: give at least one retrieval length")
    if args.calib_steps is not None and args.calib_steps < 1:
        raise CLIError(f"--calib-steps {args.calib_steps}: must be at least 1")
    for m, spec in specs.items():
        top = spec.max_positions
        for what, n in (("--seq-len", preset["seq_len"]), ("--calib-len", preset["calib_len"]),
                        *(("--lengths", L) for L in preset["lengths"])):
            if top and n > top:
                raise CLIError(f"{what} {n}: {m} has max_position_embeddings {top}; ask for at most {top} tokens")
    if "key" in args.retrieval_formats:
        have = DS.retrieval_lengths(args.heldout)
        bad = [L for L in preset["lengths"] if L not in have]
        if bad:
            raise CLIError(f"--lengths {' '.join(map(str, bad))}: no key-retrieval samples of that length under "
                           f"{DS.heldout_root(args.heldout)} (shipped: {' '.join(map(str, have)) or 'none'}); "
                           "use those lengths, or --retrieval-formats line, which builds samples of any length")
        for L in preset["lengths"]:
            have_n = len(DS.load_retrieval(L, args.heldout))
            if preset["retrieval_n"] > have_n:
                raise CLIError(f"--retrieval-n {preset['retrieval_n']}: {DS.heldout_root(args.heldout)} holds {have_n} "
                               f"key-retrieval samples of {L} tokens; ask for at most {have_n}")


def from_json(args) -> int:
    """--from-json: the Markdown table (and the README block) regenerated from result files; several
    files of identical data settings are merged (a row in two of them is refused) into --out."""
    from quantmla.checks import check_output_dir
    from quantmla.cli import CLIError
    from quantmla.evaluation import claims, table

    sources = []
    for path in args.from_json:
        if os.path.basename(path) != "accuracy.json":
            raise CLIError(f"--from-json {path}: give the path of an accuracy.json written by quantmla eval")
        rows = table.load(os.path.dirname(os.path.abspath(path)))
        if not rows:
            raise CLIError(f"--from-json {path}: no such file, or it has no rows")
        sources.append((path, rows))
    if len(sources) > 1 and not args.out:
        raise CLIError("--from-json with several files: name the merged table's directory with --out")
    out = args.out or os.path.dirname(os.path.abspath(args.from_json[0]))
    rows = sources[0][1]
    if len(sources) > 1:
        rows = []
        for path, more in sources:
            data = table.check_same_data(more, path)
            more = table.drop_repeated_rows(rows, more)
            table.check_merge(rows, data, replace=False, out_dir=f"the files before {path}",
                              new_keys=[table.row_key(r) for r in more])
            rows = table.merge_rows(rows, more)
        table.check_fingerprints(rows, "the --from-json files")
    target = os.path.abspath(os.path.join(out, "accuracy.json"))
    if os.path.exists(target) and target not in {os.path.abspath(p) for p, _ in sources} and not args.overwrite:
        raise CLIError(f"--out {out} holds an accuracy.json that is not among the --from-json files, and this would "
                       "replace it: add it to --from-json to merge it, or pass --overwrite")
    check_output_dir(out, "--out" if args.out else "--from-json")
    block = claims.readme_block(rows)
    new = None
    if args.readme:  # its markers checked before anything is written
        with open(args.readme) as f:
            text = f.read()
        try:
            new = claims.replace_block(text, block)
        except ValueError as e:
            raise CLIError(f"--readme {args.readme}: {e}") from None
    jpath, mpath = table.write([], out, base=rows, claim_lines=claims.claim_lines)
    if new is not None:
        with open(args.readme, "w") as f:
            f.write(new)
    print(block)
    print(f"wrote {jpath}, {mpath}" + (f" and the summary block of {args.readme}" if args.readme else ""))
    return 0


def run(args) -> int:
    from quantmla.checks import check_output_dir
    from quantmla.cli import CLIError
    from quantmla.evaluation import claims, table
    from quantmla.corpus.datasets import REFERENCE_MODELS, models_root
    from quantmla.cache.layout import DEFAULT_PAGE_SIZE
    from quantmla.evaluation.harness import CALIBRATED, ROPE_CHANNEL, evaluate_row, load_eval_data
    from quantmla.model.load import check_model_dir, load_model, resolve_model

    if args.from_json:
        return from_json(args)
    if args.readme:
        raise CLIError("--readme goes with --from-json (the README block is written from a finished result file)")
    preset = dict(QUICK if args.quick else FULL)
    for k in ("seq_len", "ppl_chunks", "retrieval_n", "lengths", "calib_n", "calib_len"):
        if getattr(args, k) is not None:
            preset[k] = getattr(args, k)
    preset["calib_len"] = preset.get("calib_len") or preset["seq_len"]
    models = [resolve_model(m) for m in args.models]
    if args.all:
        found = [str(models_root() / n) for n in REFERENCE_MODELS if (models_root() / n / "config.json").exists()]
        if not found:
            raise CLIError(f"--all: no reference model under {models_root()} (expected {', '.join(REFERENCE_MODELS)})")
        models += [m for m in found if m not in models]
    if not models:
        raise CLIError("give a model directory (or a reference model name), or --all")
    if args.kivi_block is not None and args.kivi_block < 1:
        raise CLIError(f"--kivi-block {args.kivi_block}: give KIVI's token block, 1 or more (default: the RoPE group)")
    if sum(map(bool, (args.resume, args.replace_rows, args.overwrite))) > 1:
        raise CLIError("--resume, --replace-rows and --overwrite exclude each other: pick one")
    specs = {m: check_model_dir(m) for m in models}  # fail early on a bad path or a non-MLA model
    rows = rows_for(args)
    calib_flags = (("--calib-n", args.calib_n), ("--calib-len", args.calib_len), ("--calib-steps", args.calib_steps),
                   ("--calib-device", args.calib_device))
    given = [f for f, v in calib_flags if v is not None]
    if given and not any(r.method in CALIBRATED or r.config.mix for r in rows):
        raise CLIError(f"{', '.join(given)} set the calibration of rows that read calibration data (methods "
                       f"{', '.join(sorted(CALIBRATED))}, or MIX configs); none of these rows does: add one or leave "
                       f"{'it' if len(given) == 1 else 'them'} out")
    for m, spec in specs.items():  # and on formats a model cannot take, before any weights are read
        check_rows(m, spec, rows, args)
    check_settings(preset, args, specs)
    out = args.out or ("out/eval-quick" if args.quick else "out/eval")
    from quantmla.corpus.datasets import heldout_root

    data = {"heldout": os.path.basename(os.path.normpath(str(heldout_root(args.heldout)))), "kind": args.kind,
            "seq_len": preset["seq_len"], "ppl_chunks": preset["ppl_chunks"], "retrieval_n": preset["retrieval_n"],
            "retrieval_lengths": list(preset["lengths"]), "retrieval_formats": list(args.retrieval_formats),
            "seed": args.seed}
    calib_kwargs = {"progress": True, "verbose": False}  # a progress bar while a row calibrates, no report table
    if args.calib_steps is not None:
        calib_kwargs["steps"] = args.calib_steps
    elif args.quick:
        calib_kwargs["steps"] = 20
    if args.calib_device is not None:
        calib_kwargs["device"] = args.calib_device
    names = {m: os.path.basename(os.path.normpath(m)) for m in models}
    if len(set(names.values())) < len(names):
        dup = next(n for n in names.values() if list(names.values()).count(n) > 1)
        raise CLIError(f"two of the models share the directory name {dup!r}, which names their rows: give each "
                       "checkpoint a directory of its own name")
    from quantmla.evaluation.provenance import data_fingerprint, model_fingerprint

    provenance = {"heldout": data_fingerprint(heldout_root(args.heldout)),
                  "models": {names[m]: model_fingerprint(m) for m in models}}

    def setup(r) -> dict:
        if r.method == "bf16":
            return {}
        clip = {"content_clip": r.config.content.clip} if r.config.content.clip != 1.0 else {}  # absent: the full range
        return {"content_group": r.config.content.group_size if r.config.content.quantized else None,
                "rope_group": r.config.rope.group_size if r.config.rope.quantized else None, **clip,
                **({"rope_block": r.rope_page} if r.method in ROPE_CHANNEL and r.rope_page != DEFAULT_PAGE_SIZE else {}),
                **({"kivi_block": r.kivi_block}  # absent: the RoPE group's tokens (equal bytes), as rows made before
                   if r.method == "kivi" and r.kivi_block != r.config.rope.group_size else {}),
                "fp_window": r.fp_window,
                **({"calib_rows": preset["calib_n"],  # only rows that read calibration data (a MIX row's bits too)
                    **({"calib_len": preset["calib_len"]} if preset["calib_len"] != preset["seq_len"] else {}),
                    "calib_steps": calib_kwargs.get("steps", "default")}
                   if r.method in CALIBRATED or r.config.mix else {})}

    # the output: checked writable and mergeable before any weights are read
    check_output_dir(out)
    base = [] if args.overwrite else table.load(out)
    keys = [(names[m], r.config.name, r.method, json.dumps(table.setup_of({"method": r.method, "config": r.config.name, "setup": setup(r)}),
                                                           sort_keys=True)) for m in models for r in rows]
    table.check_merge(base, data, replace=args.replace_rows or args.resume, out_dir=out, new_keys=keys,
                      provenance=provenance)
    done = {table.row_key(r) for r in base} if args.resume else set()
    new_rows: list[dict] = []
    for mdir in models:
        name = names[mdir]
        todo = [r for r, k in zip(rows, keys[models.index(mdir) * len(rows):]) if k not in done]
        if not todo:
            _log(f"{name}: all rows done")
            continue
        model, tok = load_model(mdir, device=args.device)
        need_calib = any(r.method in CALIBRATED or r.config.mix for r in todo)  # a MIX row's bits come from calib rows
        ev = load_eval_data(tok, heldout_root=args.heldout, seq_len=preset["seq_len"], ppl_chunks=preset["ppl_chunks"],
                            retrieval_n=preset["retrieval_n"], lengths=preset["lengths"],
                            calib_n=preset["calib_n"] if need_calib else 0, calib_len=preset["calib_len"],
                            formats=args.retrieval_formats, seed=args.seed,
                            kind=args.kind)
        _log(f"{name}: {len(todo)} rows; ppl {tuple(ev.ppl.shape)} tokens, retrieval "
             + ", ".join(f"{L}:{len(s)}" for L, s in ev.retrieval.items())
             + "".join(f", line {L}:{len(s)}" for L, s in ev.line.items()))
        prepared = {}  # one calibration serves every window and every cache read of the same calibration
        for r in todo:
            t0 = time.time()
            row = evaluate_row(model, tok, r, ev, spec=specs[mdir], seed=args.seed, progress=_log,
                               calib_kwargs=calib_kwargs, prepared=prepared)
            row["model"] = name
            row["data"] = data
            row["provenance"] = {"model": provenance["models"][name], "heldout": provenance["heldout"]}
            row["setup"] = setup(r)
            row["device"] = _device_name(args.device)
            if "calibration" in row:
                row["calibration"]["fit_device"] = args.calib_device or "cpu"
            new_rows.append(row)
            _log(f"{name} {r.config.name} {r.method}: bpb {row['bits_per_byte']:.4f} retrieval "
                 + " ".join(f"{L}:{v['accuracy']:.2f}" for L, v in row["retrieval"].items())
                 + "".join(f" line {L}:{v['accuracy']:.2f} (ctrl {v['control_accuracy']:.2f})"
                           for L, v in row.get("retrieval_line", {}).items())
                 + f" ({row['bytes_per_token']:.1f} B/token, {time.time() - t0:.0f}s)")
            # after every row: an interrupted run keeps its rows
            jpath, mpath = table.write(new_rows, out, base=base, claim_lines=claims.claim_lines)
    if not new_rows:
        jpath, mpath = table.write([], out, base=base, claim_lines=claims.claim_lines)
    print(f"wrote {jpath} and {mpath}")
    return 0


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device
