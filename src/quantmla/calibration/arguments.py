"""The options of ``quantmla calibrate`` (in memory and ``--stream``) and the checks both runs make
before any weights are read: formats against the model's dims, an already calibrated source, the
tokenizer and calibration text."""

from __future__ import annotations

import json
import os

DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def add_arguments(p):
    p.add_argument("model", help="MLA checkpoint directory (config.json, safetensors, tokenizer)")
    p.add_argument("--content-bits", type=int, default=4, help="content latent bits (2, 3, 4, 8; 16 = unquantized)")
    p.add_argument("--rope-bits", type=int, default=4, help="RoPE key bits (2, 3, 4, 8; 16 = unquantized)")
    p.add_argument("--content-group", type=int, default=64, help="content channels per scale/zero group")
    p.add_argument("--rope-group", type=int, default=32, help="RoPE channels per scale/zero group")
    p.add_argument("--content-clip", type=float, default=1.0, metavar="CLIP",
                   help="share of each content group's range the integer codes span, 1 - 2^-k (0.875 clips 1/16 of "
                        "the range at each end; default 1: min to max); the transform is fitted under it")
    p.add_argument("--calib", default="default",
                   help="calibration text: a text file, a .jsonl of {\"text\": ...}, or 'default' (training-split "
                        "Python sources, never the held-out evaluation packages)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a checkpoint already in --out (the new one is written beside it and swapped in whole "
                        "when complete); with --stream, also discard an earlier run's state there")
    p.add_argument("--method", default="quantmla", choices=("quantmla", "hadamard", "rtn"),
                   help="quantmla: learned path transforms; hadamard: a fixed rotation of the content path; rtn: none")
    p.add_argument("--paths", default="content,rope", help="paths to transform: content,rope | content | rope")
    p.add_argument("--seed", type=int, default=0, help="random seed (held-out split, initialization)")
    p.add_argument("--steps", type=int, default=200, help="Adam steps per layer (content; also the RoPE Adam search)")
    p.add_argument("--calib-seqs", type=int, default=16, help="calibration rows (a quarter is held out)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration row")
    p.add_argument("--rope-weighting", default="attention", choices=("attention", "uniform"),
                   help="weighting of the positional QK objective (see docs/calibration.md)")
    p.add_argument("--no-rope-center", action="store_true",
                   help="fit without RoPE key offsets, for runtimes that ignore quantization_config's rope_offsets "
                        "(marked \"rope_centring\": false). By default the keys' mean is removed before they are "
                        "quantized: softmax ignores a constant key offset and the quantizer's range shrinks (README: "
                        "which to choose)")
    p.add_argument("--rope-spread", type=float, default=0.0, metavar="F",
                   help="fraction (0..1) of the RoPE objective's keys moved to random positions of the model's "
                        "context before fitting: trades short-context perplexity for long-context robustness "
                        "(docs/calibration.md)")
    p.add_argument("--dtype", default="auto", choices=tuple(DTYPES),
                   help="dtype of the saved weights (auto: the checkpoint's own); calibration always runs in fp32")
    p.add_argument("--device", default="cpu", help="torch device the fits run on (cpu, cuda)")
    p.add_argument("--json", action="store_true", help="print the calibration report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_stream_arguments(p)  # --stream and its options (their own help group)


# the streaming options and their defaults: given without --stream they would be ignored silently
_STREAM_ONLY = {"nproc": 1, "activations": "memory", "checkpoint_every": 1, "checksum": False, "stream_report": None}


def cli_cache_config(content_bits: int, rope_bits: int, content_group: int, rope_group: int, spec,
                     content_clip: float = 1.0):
    """The QuantCacheConfig of the command-line flags, checked against the model's dims before any
    weights are read; errors name the flag to change."""
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.errors import UnsupportedFormatError
    from quantmla.quant.format import PathFormat

    fmts = []
    for name, bits, group, dim, dim_name in (("content", content_bits, content_group, spec.d_c, "kv_lora_rank"),
                                             ("rope", rope_bits, rope_group, spec.d_r, "qk_rope_head_dim")):
        clip = content_clip if name == "content" else 1.0
        flags = f"--{name}-bits {bits} --{name}-group {group}" + (f" --content-clip {clip:g}" if clip != 1.0 else "")
        try:
            fmt = PathFormat(bits, group, clip=clip)
            fmt.check_dim(dim, f"the {'content' if name == 'content' else 'RoPE'} path ({dim_name} {dim})")
        except UnsupportedFormatError as e:
            raise UnsupportedFormatError(f"{flags}: {e}") from None
        fmts.append(fmt)
    return QuantCacheConfig(content=fmts[0], rope=fmts[1])


def refuse_calibrated(model_dir) -> None:
    """Refuse a checkpoint `quantmla calibrate` already wrote: new transforms would stack on the fused ones."""
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.errors import QuantMLAError

    with open(os.path.join(model_dir, "config.json")) as f:
        stored = QuantCacheConfig.from_model_config(json.load(f))
    if stored is not None:
        raise QuantMLAError(
            f"{model_dir} is already calibrated ({stored.method}, {stored.describe()}); calibrating it again would "
            "stack new transforms on the fused ones. Calibrate the original (uncalibrated) checkpoint instead"
        )


def add_stream_arguments(p) -> None:
    """The streaming options of ``quantmla calibrate`` (a help group of their own)."""
    g = p.add_argument_group("streaming: models that do not fit in memory (docs/scaling.md)")
    g.add_argument("--stream", action="store_true",
                   help="calibrate layer by layer from the sharded safetensors checkpoint, never holding the whole model; "
                        "resumes a killed run in the same --out")
    g.add_argument("--nproc", type=int, default=1,
                   help="with --stream: processes on this host (gloo on CPU, NCCL with --device cuda); torchrun works too")
    g.add_argument("--activations", default="memory", choices=("memory", "device", "disk"),
                   help="with --stream: where the calibration hidden states live (disk: file-backed, beyond RAM)")
    g.add_argument("--checkpoint-every", type=int, default=1,
                   help="with --stream: save the hidden states every k layers for resuming (0: never)")
    g.add_argument("--checksum", action="store_true", help="with --stream: sha256 of every shard in its done-marker")
    g.add_argument("--stream-report", default=None, help="with --stream: write per-layer time and memory (JSON) here")


def calibration_ids(args):
    """(the checkpoint's tokenizer, the calibration ids [calib_seqs, seq_len]) of the flags."""
    from transformers import AutoTokenizer

    from quantmla.calibration.data import load_calibration_ids
    from quantmla.errors import QuantMLAError

    try:
        tok = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError, TypeError) as e:
        raise QuantMLAError(f"{args.model}: no usable tokenizer ({e}); calibration text is tokenized with the checkpoint's own") from None
    return tok, load_calibration_ids(tok, args.calib, args.seq_len, args.calib_seqs)


def preflight(args, overwrite: bool):
    """The checks every ``quantmla calibrate`` run makes before reading weights; -> (spec, quant):
    an MLA checkpoint with a latent cache, formats that fit its dims, a source not calibrated
    already, and an output directory that can take the result (see calibration/outdir.py)."""
    from quantmla.calibration.outdir import check_output_dir
    from quantmla.model.spec import load_spec

    spec = load_spec(args.model)  # FileNotFoundError / NotMLAError before any weights are read
    spec.require_latent_cache()
    quant = cli_cache_config(args.content_bits, args.rope_bits, args.content_group, args.rope_group, spec,
                             args.content_clip)
    refuse_calibrated(args.model)
    check_output_dir(args.out, overwrite)
    return spec, quant
