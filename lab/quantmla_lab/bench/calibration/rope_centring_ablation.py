"""RoPE-key centring variants on one reference model (docs/calibration.md, "RoPE key offset"):
QuantMLA at INT4/INT4 with no centring, the plain calibration mean as the offset, the mean over
the model's context (the default), and the default with half / all of the RoPE objective's keys
spread over the context (``--rope-spread``), each scored by held-out bits/byte (512-token chunks)
and retrieval at the given lengths.

    python -m quantmla_lab.bench.calibration.rope_centring_ablation models/qmla-ref-deepseek-v3 --chunks 32 \
        --retrieval-n 20 --lengths 1024 2048 4096 --out lab/results/calibration/rope_centring_ablation_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys

import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.hf_cache import QuantMLACache
from quantmla.calibration import calibrate
from quantmla.evaluation.harness import load_eval_data
from quantmla.model.load import load_model
from quantmla.evaluation.perplexity import bits_per_byte
from quantmla.evaluation.retrieval import retrieval_accuracy
from quantmla_lab.bench.common import save


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--retrieval-n", type=int, default=20)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    model, tok = load_model(a.model, dtype=torch.float32)
    ev = load_eval_data(tok, seq_len=512, ppl_chunks=a.chunks, retrieval_n=a.retrieval_n, lengths=tuple(a.lengths),
                        calib_n=16)
    quant = QuantCacheConfig.of_bits(4, 4, 64, 32)
    with torch.no_grad():
        base = bits_per_byte(model, tok, ev.ppl, seq_len=512,
                             cache_factory=lambda mm: QuantMLACache(mm, QuantCacheConfig.of_bits(16, 16)))["bits_per_byte"]
    print(f"{'BF16':<26} bpb {base:.4f}", flush=True)
    rows = []
    # (name, rope_center, rope_center_context (0: the plain mean of the calibration keys; None: the model's
    # context), rope_spread)
    variants = [("no centring", False, None, 0.0), ("plain calibration mean", True, 0, 0.0),
                ("context mean (default)", True, None, 0.0), ("context mean, spread 0.5", True, None, 0.5),
                ("context mean, spread 1.0", True, None, 1.0)]
    for name, center, context, spread in variants:
        m = copy.deepcopy(model)
        calibrate(m, ev.calib_ids, quant, rope_center=center, rope_center_context=context, rope_spread=spread,
                  progress=False, verbose=False)
        q = QuantCacheConfig.from_model_config(m.config)
        factory = lambda mm, q=q: QuantMLACache(mm, q)
        with torch.no_grad():
            bpb = bits_per_byte(m, tok, ev.ppl, seq_len=512, cache_factory=factory)["bits_per_byte"]
            ret = {L: retrieval_accuracy(m, tok, ev.retrieval[L], cache_factory=factory)["accuracy"] for L in a.lengths}
        rows.append({"variant": name, "bits_per_byte": bpb, "retrieval": ret, "calibration": q.describe()})
        print(f"{name:<26} bpb {bpb:.4f} ({100 * (bpb / base - 1):+.2f} %)  " + "  ".join(f"{L}: {100 * v:.0f} %" for L, v in ret.items()), flush=True)
    if a.out:
        save({"model": a.model, "device": "cpu", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": " ".join(["python"] + sys.argv), "chunks": a.chunks, "retrieval_n": a.retrieval_n,
              "bf16_bits_per_byte": base, "rows": rows}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
