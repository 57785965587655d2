"""Where does a model's two-bit content error sit? Per MLA layer, on the evaluation's calibration
sequences: the relative attention-output error (after o_proj) with the content path RTN at a width,
the same with the first 1 and 4 tokens of every sequence exact (is it an attention sink?), how sharp
the layer's attention is (mean largest probability; median effective tokens, exp of the entropy), the
relative squared error of the RTN latent itself, and the gain from latent to output error: the output
error of Gaussian noise at 1 % of each token's squared norm, divided by 0.01.

    PYTHONPATH=src:lab python -m quantmla_lab.bench.calibration.layer_content_error models/qmla-ref-deepseek-v2
"""

from __future__ import annotations

import argparse

import torch

from quantmla.calibration.capture import capture_calibration_data
from quantmla.calibration.objectives import OutputDistortion, content_dequant, rope_logits
from quantmla.evaluation.harness import load_eval_data
from quantmla.model.load import load_model
from quantmla.model.spec import load_spec
from quantmla.quant import PathFormat


def _keep_first(fmt: PathFormat, n: int):
    def fn(lat: torch.Tensor) -> torch.Tensor:
        q = content_dequant(lat, None, None, fmt)
        q[:, :n] = lat[:, :n]
        return q
    return fn


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a checkpoint directory")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--group", type=int, default=32)
    a = ap.parse_args()
    model, tok = load_model(a.model)
    data = load_eval_data(tok, ppl_chunks=1, retrieval_n=1)
    caps = capture_calibration_data(model, load_spec(model), data.calib_ids, progress=False)
    fmt = PathFormat(a.bits, a.group)
    print(f"{a.model}: content {fmt.describe()} RTN, {len(data.calib_ids)} calibration sequences")
    print("slot  output error  first token exact  first 4 exact  max prob  effective tokens  latent error  noise gain")
    g = torch.Generator().manual_seed(0)
    for slot, d in caps.items():
        dist = OutputDistortion(d, torch.arange(d.latent.shape[0]))
        errs = [dist(_keep_first(fmt, n)) for n in (0, 1, 4)]
        seqs = torch.arange(min(8, d.latent.shape[0]))
        q = d.q_latent[seqs]
        b, s_q, h, d_c = q.shape
        s = torch.baddbmm(rope_logits(d, seqs, d.k_rope[seqs]), q.reshape(b, s_q * h, d_c),
                          d.latent[seqs].transpose(1, 2), alpha=d.scale)
        p = torch.softmax(s, -1)
        n_eff = (-(p.clamp_min(1e-12).log() * p).sum(-1)).exp()
        lat = d.latent
        lat_err = float((content_dequant(lat, None, None, fmt) - lat).pow(2).sum() / lat.pow(2).sum())

        def noisy(x: torch.Tensor) -> torch.Tensor:
            z = torch.randn(x.shape, generator=g).to(x)
            return x + 0.1 * z * x.norm(dim=-1, keepdim=True) / z.norm(dim=-1, keepdim=True)

        gain = dist(noisy) / 0.01
        print(f"{slot:>4}  {errs[0]:12.3f}  {errs[1]:17.3f}  {errs[2]:13.3f}  {float(p.max(-1).values.mean()):8.2f}"
              f"  {float(n_eff.median()):16.1f}  {lat_err:12.3f}  {gain:10.2f}")


if __name__ == "__main__":
    main()
