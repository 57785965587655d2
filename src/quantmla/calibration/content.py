"""Content-path calibration: learn (Q, γ') by attention-output reconstruction.

Candidates: RTN (identity), the Hadamard point (Q = H, γ' = rms(γ)·1) and, for the "quantmla"
method, a learned point — ``Q = Q₀·exp(A − Aᵀ)`` and ``γ' = exp(g)``, initialized at the Hadamard
point (or at RTN where that fits the calibration data better) and trained with Adam on the relative attention-output error (after o_proj) under the
LSQ-style fake quantizer. The candidate with the lowest error on held-out calibration sequences
is kept, so the result is never worse than its starting point on data it was not fitted on.

A clipped range (``PathFormat.clip``) is part of the format: the fake quantizer applies it as the cache
does, so the transform is fitted under it; this fit does not choose it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from quantmla.calibration.capture import LayerData
from quantmla.calibration.objectives import OutputDistortion, attention_output, content_dequant, rope_logits
from quantmla.errors import QuantMLAError
from quantmla.quant import PathFormat
from quantmla.transforms.content import ContentTransform, LearnedRotation


@dataclass
class ContentFit:
    transform: ContentTransform
    chosen: str
    heldout: dict[str, float]  # candidate -> held-out relative output error
    curve: list[float] = field(default_factory=list)  # training loss every few steps


def content_fn(transform: ContentTransform, gamma_old: torch.Tensor, fmt: PathFormat):
    """latent -> ĉ = Q_b(latent·T)·T⁻¹ for this transform (on the latent's device)."""
    gamma_old = gamma_old.detach().cpu()
    t = transform.matrix(gamma_old).float()
    t_inv = transform.inverse(gamma_old).float()
    return lambda lat: content_dequant(lat, t.to(lat.device), t_inv.to(lat.device), fmt)


def _learn(data: LayerData, fmt: PathFormat, init: ContentTransform, fit_seqs: torch.Tensor, *, steps: int,
           lr: float, batch_size: int, generator: torch.Generator, pbar=None) -> tuple[ContentTransform, list[float]]:
    gamma = data.gamma.float()
    dev = gamma.device
    rot = LearnedRotation(init.rotation.float()).to(dev)
    sign = torch.sign(init.gamma.float()).to(dev)
    log_g = torch.nn.Parameter(init.gamma.float().abs().log().to(dev))
    opt = torch.optim.Adam([{"params": [rot.generator], "lr": lr}, {"params": [log_g], "lr": 5 * lr}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(1, steps))))
    with torch.no_grad():  # the FP RoPE logits and reference outputs of every fit sequence, computed once
        rl_all = torch.cat([rope_logits(data, c, data.k_rope[c]) for c in fit_seqs.split(4)])  # [n_fit, S_q·H, L]
        ref = torch.cat([attention_output(data, c, data.latent[c], rope_logits_=rl_all[i : i + len(c)])
                         for i, c in zip(range(0, len(fit_seqs), 4), fit_seqs.split(4))])  # [n_fit, S_q, hidden]
    pos = {int(s): i for i, s in enumerate(fit_seqs)}
    curve = []
    for step in range(steps):
        pick = torch.randperm(len(fit_seqs), generator=generator)[:batch_size]
        seqs = fit_seqs[pick]
        q = rot()
        g_new = sign * log_g.exp()
        t = (1.0 / gamma)[:, None] * q * g_new[None, :]
        t_inv = (1.0 / g_new)[:, None] * q.T * gamma[None, :]
        lat = content_dequant(data.latent[seqs], t, t_inv, fmt)
        rows = torch.tensor([pos[int(s)] for s in seqs])
        out = attention_output(data, seqs, lat, rope_logits_=rl_all[rows])
        r = ref[rows]
        loss = (out - r).pow(2).sum() / r.pow(2).sum().clamp_min(1e-30)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 10 == 0 or step == steps - 1:
            curve.append(float(loss.detach()))
        if pbar is not None:
            pbar.update(1)
    with torch.no_grad():
        q = rot().double().cpu()
        # re-orthogonalize in float64 (matrix_exp in fp32 leaves ~1e-6 drift)
        u, _, vh = torch.linalg.svd(q)
        learned = ContentTransform(u @ vh, (sign * log_g.exp()).double().cpu())
    return learned, curve


def fit_content(data: LayerData, fmt: PathFormat, fit_seqs: torch.Tensor, held_seqs: torch.Tensor, *,
                method: str = "quantmla", steps: int = 200, lr: float = 1e-2, batch_size: int = 4,
                generator: torch.Generator | None = None, pbar=None) -> ContentFit:
    generator = generator or torch.Generator().manual_seed(0)
    gamma_old = data.gamma.double().cpu()
    held = OutputDistortion(data, held_seqs)
    cands: dict[str, ContentTransform] = {"rtn": ContentTransform.identity(gamma_old)}
    if method in ("hadamard", "quantmla"):
        try:
            cands["hadamard"] = ContentTransform.hadamard_point(gamma_old)
        except QuantMLAError:
            if method == "hadamard":
                raise
    curve: list[float] = []
    if method == "quantmla" and fmt.quantized and steps > 0:
        # start from the better of the RTN and Hadamard points on the fit sequences (usually Hadamard)
        fit = OutputDistortion(data, fit_seqs)
        start = min(cands, key=lambda n: fit(content_fn(cands[n], gamma_old, fmt)))
        init = cands[start]
        cands["learned"], curve = _learn(data, fmt, init, fit_seqs, steps=steps, lr=lr, batch_size=batch_size,
                                         generator=generator, pbar=pbar)
    heldout = {name: held(content_fn(t, gamma_old, fmt)) for name, t in cands.items()}
    if method == "rtn" or not fmt.quantized:
        chosen = "rtn"
    elif method == "hadamard":
        chosen = "hadamard"
    else:
        chosen = min(heldout, key=heldout.get)
    return ContentFit(cands[chosen], chosen, heldout, curve)
