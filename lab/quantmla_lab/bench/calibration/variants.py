"""Calibration measurements on one model: held-out bits/byte of calibration variants.

    python -m quantmla_lab.bench.calibration.variants models/qmla-ref-deepseek-v3 [--device cuda] [--out FILE.json]

Every perplexity figure reads the quantized cache everywhere (QuantMLACache, prefill included).
Variants (content group 64, RoPE group 32 unless told):

- BF16; RTN, Hadamard and QuantMLA at INT4/INT4 and INT2/INT4 (QuantMLA with the attention-weighted
  and with the uniform positional QK objective);
- RoPE path alone (content BF16, RoPE INT4): RTN, each closed-form per-pair rescale forced (pair-RMS
  equalization, pair-max equalization, sqrt(q/k) balance), and the function-aligned searches;
- content path alone (content INT2, RoPE BF16): RTN, Hadamard, learned.

Prints a table and writes JSON (per-variant bits/byte, relative change vs BF16, calibration time
and per-layer held-out objectives).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.hf_cache import QuantMLACache
from quantmla.calibration.api import calibrate, split_sequences
from quantmla.calibration.capture import capture_calibration_data
from quantmla.calibration.rope import closed_forms
from quantmla.model.spec import load_spec
from quantmla.transforms import LayerTransform, RopeTransform, fuse_transforms
from quantmla_lab.bench.common import save


def _bpb(model, tok, chunks, seq_len, quant, batch_size):
    from quantmla.evaluation.perplexity import bits_per_byte

    factory = (lambda m: QuantMLACache(m, quant)) if quant is not None else None
    return bits_per_byte(model, tok, chunks, seq_len=seq_len, cache_factory=factory, batch_size=batch_size)["bits_per_byte"]


def forced_closed_form(model, calib_ids, name: str, seed: int = 0, device=None) -> None:
    """Fuse one closed-form RoPE rescale (computed as calibrate would, on its fit sequences)."""
    spec = load_spec(model)
    g = torch.Generator().manual_seed(seed)
    fit, _ = split_sequences(calib_ids.shape[0], 0.25, g)
    data = capture_calibration_data(model, spec, calib_ids, seed=seed, progress=False, store_device=device)
    ts = {}
    for slot, d in data.items():
        ls = closed_forms(d, fit)[name]
        ts[slot] = LayerTransform(None, RopeTransform.from_polar(ls.double().exp().cpu()))
    fuse_transforms(model, ts, spec)


def layer_summary(report) -> list[dict]:
    out = []
    for l in report.layers:
        row = {"slot": l.slot}
        for k in ("content", "rope", "joint"):
            d = getattr(l, k)
            if d:
                row[k] = {"before": d["before"], "after": d["after"], **({"chosen": d["chosen"]} if "chosen" in d else {})}
                if "candidates" in d:
                    row[k]["candidates"] = d["candidates"]
        out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--chunks", type=int, default=64, help="held-out perplexity chunks")
    p.add_argument("--calib-n", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--only", default=None, help="comma-separated variant names to run")
    p.add_argument("--content-group", type=int, default=64)
    p.add_argument("--rope-group", type=int, default=32)
    p.add_argument("--rope-mode", default="affine", choices=("affine", "symmetric"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from quantmla.evaluation.harness import load_eval_data
    from quantmla.model.load import load_model

    model, tok = load_model(args.model, dtype=torch.float32)
    model.to(args.device).eval()
    ev = load_eval_data(tok, seq_len=args.seq_len, ppl_chunks=args.chunks, retrieval_n=0, lengths=(), calib_n=args.calib_n)
    chunks, calib = ev.ppl, ev.calib_ids
    def q(cb, rb, cg=args.content_group, rg=args.rope_group):
        cfg = QuantCacheConfig.of_bits(cb, rb, cg, rg)
        if rb < 16:
            cfg = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, mode=args.rope_mode))
        return cfg

    cfgs = {"INT4/INT4": q(4, 4), "INT2/INT4": q(2, 4), "BF16/INT4": q(16, 4), "INT2/BF16": q(2, 16)}
    kw = dict(seed=args.seed, steps=args.steps, progress=False, verbose=False, device=args.device)
    Q, U = dict(method="quantmla"), dict(method="quantmla", rope_weighting="uniform")
    variants = [("BF16", None, None),
                ("INT4/INT4 rtn", "INT4/INT4", None), ("INT4/INT4 quantmla", "INT4/INT4", Q),
                ("INT2/INT4 rtn", "INT2/INT4", None), ("INT2/INT4 hadamard", "INT2/INT4", dict(method="hadamard")),
                ("INT2/INT4 quantmla", "INT2/INT4", Q),
                ("BF16/INT4 rtn", "BF16/INT4", None)]
    variants += [(f"BF16/INT4 {n}", "BF16/INT4", {"closed": n}) for n in ("rms_equalize", "max_equalize", "smooth_sqrt_qk")]
    variants += [("BF16/INT4 quantmla-rope", "BF16/INT4", dict(Q, paths=("rope",))),
                 ("BF16/INT4 quantmla-rope-uniform", "BF16/INT4", dict(U, paths=("rope",))),
                 ("BF16/INT4 quantmla-rope-closed+adam", "BF16/INT4", dict(Q, paths=("rope",), rope_searches=("closed", "adam"))),
                 ("INT2/BF16 rtn", "INT2/BF16", None),
                 ("INT2/BF16 hadamard", "INT2/BF16", dict(method="hadamard", paths=("content",))),
                 ("INT2/BF16 quantmla-content", "INT2/BF16", dict(Q, paths=("content",))),
                 ("INT4/INT4 hadamard", "INT4/INT4", dict(method="hadamard")),
                 ("INT4/INT4 quantmla-uniform", "INT4/INT4", U),
                 ("INT2/INT4 quantmla-uniform", "INT2/INT4", U)]
    if args.only:
        keep = set(args.only.split(","))
        variants = [v for v in variants if v[0] in keep or v[0] == "BF16"]
    rows = []
    base_bpb = None
    for name, cfg, how in variants:
        m = copy.deepcopy(model)
        quant = cfgs.get(cfg) if cfg else None
        t0 = time.perf_counter()
        layers = None
        if how and "closed" in how:
            forced_closed_form(m, calib, how["closed"], args.seed, args.device)
        elif how:
            rep = calibrate(m, calib, quant, **{**kw, **how})
            layers = layer_summary(rep)
        t_cal = time.perf_counter() - t0
        if quant is not None:  # a calibrated model reads through its own config (RoPE offsets included)
            quant = QuantCacheConfig.from_model_config(m.config) or quant
        with torch.no_grad():
            bpb = _bpb(m, tok, chunks, args.seq_len, quant if quant is not None else q(16, 16), args.batch_size)
        base_bpb = bpb if name == "BF16" else base_bpb
        row = {"variant": name, "bits_per_byte": bpb, "rel": (bpb / base_bpb - 1) if base_bpb else None,
               "calibration_s": round(t_cal, 1), "layers": layers}
        rows.append(row)
        print(f"{name:<38} bpb {bpb:.4f}  {100 * row['rel']:+6.2f}%  (cal {t_cal:.0f}s)", flush=True)
        if layers:
            for l in layers:
                c, r = l.get("content"), l.get("rope")
                print(f"    slot {l['slot']}: " + (f"content {c['before']:.4g}->{c['after']:.4g} ({c['chosen']})  " if c else "")
                      + (f"rope {r['before']:.4g}->{r['after']:.4g} ({r['chosen']})" if r else ""), flush=True)
        if args.out:  # rewritten after every row, so a cut-short run keeps what it measured
            out = {"model": args.model, "device": args.device, "seq_len": args.seq_len, "chunks": len(chunks),
                   "calib": list(calib.shape), "steps": args.steps,
                   "cache_formats": {k: v.describe() for k, v in cfgs.items()}, "seed": args.seed, "rows": rows}
            save(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
