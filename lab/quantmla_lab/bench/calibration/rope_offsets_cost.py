"""What a runtime that ignores ``rope_offsets`` costs, and what fitting without them costs instead.

For each model and cache config, held-out code bits per byte (512-token chunks, every attention
read through the quantized cache) of QuantMLA calibrated three ways:

- centred: the default calibration, read with its RoPE key offsets (what the shipped loaders do);
- offsets stripped: the same checkpoint read by a runtime that ignores ``rope_offsets``;
- no centring: calibrated with ``--no-rope-center`` (``"rope_centring": false``), read as it is.

    python -m quantmla_lab.bench.calibration.rope_offsets_cost --chunks 32 --calib-n 16 \
        --out lab/results/calibration/rope_offsets_cost_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import sys
import time

import torch

from quantmla.cache.hf_cache import QuantMLACache
from quantmla.calibration import calibrate
from quantmla.corpus.datasets import REFERENCE_MODELS, model_path
from quantmla.evaluation.configs import named_config
from quantmla.evaluation.harness import bf16_cache, load_eval_data
from quantmla.model.load import load_model
from quantmla.evaluation.perplexity import bits_per_byte
from quantmla_lab.bench.common import save


def _without_offsets(model, quant):
    """A cache of the calibrated formats whose layers subtract no RoPE offset (a runtime that ignores them)."""
    cache = QuantMLACache(model, quant)
    for layer in cache.mla_layers():
        layer.rope_offset = None
    return cache


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=list(REFERENCE_MODELS))
    p.add_argument("--configs", nargs="+", default=["INT4/INT4", "INT2/INT4"])
    p.add_argument("--chunks", type=int, default=32, help="held-out chunks of 512 tokens")
    p.add_argument("--calib-n", type=int, default=16, help="calibration rows of 512 tokens")
    p.add_argument("--out", default=None, help="JSON output (default: print only)")
    a = p.parse_args(argv)
    rows = []
    for name in a.models:
        path = name if os.path.isdir(name) else str(model_path(name))
        model, tok = load_model(path, dtype=torch.float32)
        ev = load_eval_data(tok, seq_len=512, ppl_chunks=a.chunks, retrieval_n=0, lengths=(), calib_n=a.calib_n)

        def bpb(m, factory):
            with torch.no_grad():
                return bits_per_byte(m, tok, ev.ppl, seq_len=512, cache_factory=factory)["bits_per_byte"]

        base = bpb(model, bf16_cache)
        print(f"{os.path.basename(path)} BF16 {base:.4f}", flush=True)
        for cfg in a.configs:
            quant = named_config(cfg).quant("quantmla")
            row = {"model": os.path.basename(path), "config": cfg, "bf16": base}
            for centre in (True, False):
                m = copy.deepcopy(model)
                t0 = time.time()
                calibrate(m, ev.calib_ids, quant, rope_center=centre, progress=False, verbose=False)
                stored = type(quant).from_model_config(m.config)
                key = "centred" if centre else "no_centring"
                row[key] = bpb(m, lambda mm, q=stored: QuantMLACache(mm, q))
                row[f"{key}_calibration_s"] = round(time.time() - t0, 1)
                if centre:
                    row["offsets_stripped"] = bpb(m, lambda mm, q=stored: _without_offsets(mm, q))
            for k in ("centred", "offsets_stripped", "no_centring"):
                row[f"{k}_pct"] = round(100 * (row[k] / base - 1), 2)
            print(f"{row['model']} {cfg}: " + ", ".join(f"{k} {row[k]:.4f} ({row[k + '_pct']:+.2f} %)"
                                                      for k in ("centred", "offsets_stripped", "no_centring")), flush=True)
            rows.append(row)
    doc = {"question": "bits per byte of QuantMLA with RoPE offsets, with them ignored, and fitted without them",
           "command": "python -m quantmla_lab.bench.calibration.rope_offsets_cost "
                      + " ".join(argv if argv is not None else sys.argv[1:]),
           "device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
           "date": datetime.date.today().isoformat(), "chunks": a.chunks, "calib_rows": a.calib_n, "rows": rows}
    if a.out:
        save(doc, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
