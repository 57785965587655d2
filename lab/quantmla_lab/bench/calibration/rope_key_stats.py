"""RoPE key statistics behind RoPE-key centring (docs/calibration.md): per layer, each cached RoPE
channel's |mean| / std over calibration tokens, and the mean per-token range before and after the
mean is removed.

    python -m quantmla_lab.bench.calibration.rope_key_stats models/qmla-ref-deepseek-v3
"""

from __future__ import annotations

import sys

import torch

from quantmla.calibration.capture import capture_calibration_data
from quantmla.evaluation.harness import load_eval_data
from quantmla.model.load import load_model
from quantmla.model.spec import load_spec


def main(path: str) -> None:
    model, tok = load_model(path, dtype=torch.float32)
    ev = load_eval_data(tok, seq_len=512, ppl_chunks=0, retrieval_n=0, lengths=(), calib_n=16)
    data = capture_calibration_data(model, load_spec(model), ev.calib_ids, seed=0, progress=False)
    for slot, d in data.items():
        k = d.k_rope[:, 1:].reshape(-1, d.k_rope.shape[-1])  # position 0 (the sink) left out
        ratio = k.mean(0).abs() / k.std(0)
        rng = (k.amax(1) - k.amin(1)).mean()
        kc = k - k.mean(0)
        rngc = (kc.amax(1) - kc.amin(1)).mean()
        print(f"slot {slot} ({d.rope_layout}): max |mean|/std {ratio.max():.1f} (channel {int(ratio.argmax())}); "
              f"per-token range {rng:.2f} -> {rngc:.2f} centred")
        print("   |mean|/std per channel: " + " ".join(f"{x:.1f}" for x in ratio.tolist()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models/qmla-ref-deepseek-v3")
