"""`quantmla analyze MODEL`: the dual-path error model measured per layer (docs/design.md §2).

On full-precision activations of held-out text, per MLA layer: attention-output distortion from
content-only, RoPE-only and joint quantization at equal bits, its exact split into matching and
aggregation error, the first-order model's accuracy, per-frequency-pair RMS of q^R and k_R, and the
RoPE amplification factor. Writes <out>/analysis.json, <out>/summary.md and four PNGs.
"""

from __future__ import annotations

import os
import sys
import time


def add_arguments(p):
    p.add_argument("model", help="checkpoint directory, or the name of a reference model under models/")
    p.add_argument("--out", default=None,
                   help="output directory (default out/analysis/<model name>; the committed results/analysis/<model> "
                        "is written only when named)")
    p.add_argument("--heldout", default=None, help="held-out set directory (default models/heldout)")
    p.add_argument("--kind", default="code", choices=("code", "prose"), help="held-out text to capture activations on")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per captured sequence")
    p.add_argument("--num-seqs", type=int, default=4, help="held-out sequences to capture")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 8], help="bit widths to measure")
    p.add_argument("--content-group", type=int, default=64, help="content channels per scale/zero group")
    p.add_argument("--rope-group", type=int, default=32, help="RoPE channels per scale/zero group")
    p.add_argument("--layers", type=int, nargs="+", default=None, help="MLA cache slots to analyze (default: all)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--no-plots", action="store_true", help="write the JSON and Markdown only, no figures")


def summary_markdown(result: dict, name: str) -> str:
    """Per-bits and per-layer tables of the headline figures."""
    s = result["settings"]
    L = result["layers"]
    out = [f"# Dual-path error analysis: {name}", "",
           f"{s['sequences']} held-out sequences x {s['seq_len']} tokens; content groups of {s['content_group']}, "
           f"RoPE groups of {s['rope_group']} channels (per-token affine, fp16 scale+zero); each layer's cache "
           "quantized alone on full-precision activations; float64.", "",
           "Distortion = ‖Δo‖/‖o‖ of the attention block's output after o_proj (mean over layers). "
           "Amplification = (distortion per unit relative RoPE-key error) / (distortion per unit relative latent error), "
           "geometric mean over layers; 'of which in logits' is the same ratio for the RMS logit error.", "",
           "| bits | content only | RoPE only | both | RoPE/content distortion | RoPE amplification | of which in logits | "
           "layers RoPE worse | content matching share | first-order rel. err (max) |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b in map(str, s["bits"]):
        mean = lambda p: sum(x["runs"][p][b]["distortion"] for x in L) / len(L)  # noqa: E731
        r = result["summary"]["by_bits"][b]
        out.append(f"| {b} | {mean('content'):.4g} | {mean('rope'):.4g} | {mean('both'):.4g} | "
                   f"{r['distortion_ratio_gmean']:.3g} | {r['rope_amplification_gmean']:.3g} | "
                   f"{r['rope_logit_amplification_gmean']:.3g} | "
                   f"{r['layers_rope_worse']}/{len(L)} | {r['content_matching_share_mean']:.3g} | "
                   f"{r['first_order_rel_err_max']:.2g} |")
    b = "4" if "4" in map(str, s["bits"]) else str(s["bits"][0])
    out += ["", f"Per layer at INT{b}:", "",
            "| layer | content | RoPE | RoPE/content | amplification | content: matching | content: aggregation | "
            "rel. err c | rel. err k_R | top k_R pair (RMS) | median k_R pair RMS |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in L:
        c, r = x["runs"]["content"][b], x["runs"]["rope"][b]
        kr = x["pairs"]["k_rope_rms"]
        top = max(range(len(kr)), key=lambda j: kr[j])
        med = sorted(kr)[len(kr) // 2]
        out.append(f"| {x['layer']} | {c['distortion']:.4g} | {r['distortion']:.4g} | "
                   f"{x['distortion_ratio'][b]:.3g} | {x['rope_amplification'][b]:.3g} | {c['matching']:.3g} | "
                   f"{c['aggregation']:.3g} | {c['content_rel_err']:.3g} | {r['rope_rel_err']:.3g} | "
                   f"{top} ({kr[top]:.3g}) | {med:.3g} |")
    fo = result["summary"]["first_order_check"]
    out += ["", f"First-order check: at INT{fo['bits']} the first-order model is within "
            f"{100 * fo['max_rel_err']:.3g}% of the exact output error (worst layer and path)."]
    return "\n".join(out) + "\n"


def check_formats(spec, args) -> None:
    """Every --bits width at the group sizes given fits the model's latent and RoPE dims."""
    from quantmla.errors import UnsupportedFormatError
    from quantmla.quant.format import INT_BITS, PathFormat

    for b in args.bits:
        if b == 16:  # a valid width elsewhere (no quantization), with no error to analyze
            raise UnsupportedFormatError(f"--bits 16: 16 bits quantize nothing, so there is no error to analyze; "
                                         f"give bits from {INT_BITS}")
        for flag, group, dim, what in (("--content-group", args.content_group, spec.d_c, "content path (kv_lora_rank"),
                                       ("--rope-group", args.rope_group, spec.d_r, "RoPE path (qk_rope_head_dim")):
            try:
                PathFormat(b, group).check_dim(dim, f"the {what} {dim})")
            except UnsupportedFormatError as e:
                raise UnsupportedFormatError(f"--bits {b} {flag} {group}: {e}") from None


def run(args) -> int:
    from quantmla.analysis.plots import plot_all
    from quantmla.analysis.run import analyze_model
    from quantmla import jsonfile
    from quantmla.checks import check_output_dir
    from quantmla.errors import QuantMLAError
    from quantmla.corpus import datasets as DS
    from quantmla.model.load import check_model_dir, load_model, resolve_model
    from quantmla.corpus.chunks import token_chunks

    path = resolve_model(args.model)
    if args.num_seqs < 1 or args.seq_len < 2:
        raise QuantMLAError(f"--num-seqs {args.num_seqs} --seq-len {args.seq_len}: give at least 1 sequence of at "
                            "least 2 tokens")
    spec = check_model_dir(path)
    check_formats(spec, args)  # bad path, non-MLA model or bad bits: before any weights are read
    if spec.max_positions and args.seq_len > spec.max_positions:
        raise QuantMLAError(f"--seq-len {args.seq_len}: {path} has max_position_embeddings {spec.max_positions}; "
                            f"ask for at most {spec.max_positions} tokens")
    name = os.path.basename(os.path.normpath(path))
    out = args.out or os.path.join("out", "analysis", name)
    check_output_dir(out)  # an unwritable output fails now, not after the analysis
    model, tok = load_model(path, device=args.device)
    root = DS.heldout_root(args.heldout)
    if not (root / f"{args.kind}.jsonl").exists():
        raise FileNotFoundError(f"no held-out set at {root / f'{args.kind}.jsonl'} (set --heldout)")
    ids = token_chunks(tok, DS.load_texts(args.kind, root), args.seq_len, max_chunks=args.num_seqs)
    if ids.shape[0] < args.num_seqs or ids.shape[1] != args.seq_len:
        raise QuantMLAError(f"held-out text gave {tuple(ids.shape)} tokens, wanted {args.num_seqs} x {args.seq_len}")
    t0 = time.time()
    result = analyze_model(model, ids.to(args.device), bits=args.bits, content_group=args.content_group, rope_group=args.rope_group,
                           layers=args.layers, progress=lambda m: print(f"[analyze] {m}", file=sys.stderr, flush=True))
    result["model"] = name
    result["settings"]["heldout"] = f"{args.kind} ({root.name})"
    result["seconds"] = round(time.time() - t0, 1)
    jsonfile.write(os.path.join(out, "analysis.json"), result)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary_markdown(result, name))
    files = [] if args.no_plots else plot_all(result, out, title=name)
    if os.path.basename(os.path.normpath(out)) == name:  # the layout <root>/<model>: refresh the cross-model overview
        from quantmla.analysis.overview import write_overview

        ov, why = write_overview(os.path.dirname(os.path.normpath(out)))
        if ov:
            files.append(ov)
        else:
            print(f"[analyze] no cross-model overview written: {why}", file=sys.stderr)
    print(summary_markdown(result, name))
    print("wrote " + ", ".join([os.path.join(out, "analysis.json"), os.path.join(out, "summary.md"), *files]))
    return 0
