"""How much the reading of the cache moves bits per byte: one forward a chunk (what a prefill reads) against decode
reads (every query as a decode step reads the cache, ``quantmla.evaluation.decode_reads``), for the rows whose two
readings differ: a full-precision window, and RoPE keys per channel over blocks of tokens (KIVI-style).

    python -m quantmla_lab.bench.eval_reads models/qmla-ref-deepseek-v3 --rows INT4/INT4:kivi:32/16 \\
        INT4/INT4:rtn:64/32 --windows 0 64 --ppl-chunks 16 --seq-len 512 --out lab/results/eval/reads_deepseek_v3.json

Rows of rtn and kivi only (nothing fused into the weights); Δ is against BF16 on the same chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from quantmla.corpus import datasets as DS
from quantmla.corpus.chunks import token_chunks
from quantmla.evaluation.configs import named_config
from quantmla.evaluation.harness import RowSpec
from quantmla.evaluation.perplexity import bits_per_byte
from quantmla.model.load import load_model
from quantmla_lab.bench.common import cache_row, parse_fresh, record

UNCALIBRATED = ("rtn", "kivi")  # rows whose cache needs nothing fused into the weights


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--rows", nargs="+", required=True, metavar="CONFIG:METHOD:C/R")
    p.add_argument("--windows", type=int, nargs="+", default=[0])
    p.add_argument("--ppl-chunks", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--kind", default="code")
    p.add_argument("--out", default=None)
    args = parse_fresh(p)
    rows = [cache_row(r, UNCALIBRATED) for r in args.rows]
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    chunks = list(token_chunks(tok, DS.load_texts(args.kind), args.seq_len, args.ppl_chunks))
    kw = dict(seq_len=args.seq_len, max_chunks=args.ppl_chunks)
    base = bits_per_byte(model, tok, chunks, **kw)["bits_per_byte"]
    out = record(model=os.path.basename(os.path.normpath(args.model)), kind=args.kind, chunks=len(chunks),
                 seq_len=args.seq_len, bf16_bits_per_byte=base, rows=[])  # device, date, command, commit first
    print(f"BF16 {base:.5f} bits/byte, {len(chunks)} chunks of {args.seq_len}")
    for config, method, c, r in rows:
        for w in args.windows:
            spec = RowSpec(named_config(config, c, r), method, kivi_block=r, fp_window=w)
            res = {"config": config, "method": method, "groups": f"{c}/{r}", "fp_window": w}
            for reads in ("prefill", "decode"):
                t0 = time.perf_counter()
                bpb = bits_per_byte(model, tok, chunks, cache_factory=spec.cache_factory(), reads=reads, **kw)
                res[reads] = {"bits_per_byte": bpb["bits_per_byte"],
                              "delta_pct": 100 * (bpb["bits_per_byte"] / base - 1), "seconds": time.perf_counter() - t0}
            out["rows"].append(res)
            print(f"{config} {method} {c}/{r} window {w}: Δ {res['prefill']['delta_pct']:+.3f} % one forward a chunk, "
                  f"{res['decode']['delta_pct']:+.3f} % as decode steps read", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
