"""RoPE-path calibration: per-pair complex scalars z_j by positional QK reconstruction.

The space has d_r real parameters per layer (scale and phase of each pair), so we try several
searches and keep the one that wins on held-out calibration keys:

- closed forms (the docs/design.md §6 baselines): equalize pair RMS, equalize pair maxima, the
  SmoothQuant-style balance ``|z_j| = sqrt(rms(q_j) / rms(k_j))`` — phase 0;
- ``grid``: coordinate descent over (log-scale, phase) per pair on the fit keys, from the best
  closed form, shrinking the grid each sweep;
- ``adam``: gradient descent on (log-scale, phase) through the LSQ-style fake quantizer, from the
  best point found so far.

The identity (RTN) is always a candidate, so the kept point is never worse than RTN on the
held-out keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from quantmla.calibration.capture import LayerData
from quantmla.calibration.objectives import RopePageQK, RopeQK
from quantmla.quant import PathFormat
from quantmla.transforms.rope import RopeTransform, pair_channels

SEARCHES = ("closed", "grid", "adam")
MAX_LOG_SCALE = math.log(64.0)  # keep |z| in [1/64, 64]: scales stay far from fp16 metadata limits


@dataclass
class RopeFit:
    transform: RopeTransform
    chosen: str
    heldout: dict[str, float]  # candidate -> held-out objective
    fit: dict[str, float] = field(default_factory=dict)  # candidate -> fit objective


def _pair_mag(k: torch.Tensor, layout: str) -> torch.Tensor:
    ra, im = pair_channels(k.shape[-1], layout)
    return (k[..., ra].pow(2) + k[..., im].pow(2)).sqrt()  # [..., P]


def _normalized(log_s: torch.Tensor) -> torch.Tensor:
    return (log_s - log_s.mean()).clamp(-MAX_LOG_SCALE, MAX_LOG_SCALE)


def closed_forms(data: LayerData, fit_seqs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-pair log-scales of the closed-form baselines (phase 0), from the fit sequences."""
    k = data.k_rope[fit_seqs.to(data.k_rope.device)].reshape(-1, data.k_rope.shape[-1])
    mag = _pair_mag(k, data.rope_layout)  # [T, P]
    rms_k = mag.pow(2).mean(0).sqrt().clamp_min(1e-12)
    max_k = mag.amax(0).clamp_min(1e-12)
    ra, im = pair_channels(k.shape[-1], data.rope_layout)
    q_sq = data.q_pair_sq
    rms_q = ((q_sq[ra] + q_sq[im]) / max(1, data.n_queries)).sqrt().clamp_min(1e-12)
    return {
        "rms_equalize": _normalized(-rms_k.log()),
        "max_equalize": _normalized(-max_k.log()),
        "smooth_sqrt_qk": _normalized(0.5 * (rms_q.log() - rms_k.log())),
    }


def _z(log_s: torch.Tensor, phase: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = log_s.exp()
    return s * torch.cos(phase), s * torch.sin(phase)


def grid_search(obj: RopeQK, log_s: torch.Tensor, phase: torch.Tensor, sweeps: int = 3,
                n_scale: int = 9, n_phase: int = 8) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Coordinate descent over each pair's (log-scale, phase) on a product grid around the current
    point; the grid's range shrinks 4× per sweep."""
    log_s, phase = log_s.clone().float(), phase.clone().float()
    dev = log_s.device
    best = float(obj.batch(*[t[None] for t in _z(log_s, phase)])[0])
    span_s, span_p = math.log(4.0), math.pi
    for _ in range(sweeps):
        ds = torch.linspace(-span_s, span_s, n_scale, device=dev)
        dp = torch.arange(n_phase, device=dev) * (2 * span_p / n_phase) - (span_p if span_p < math.pi else 0.0)
        grid = torch.cartesian_prod(ds, dp)  # [G, 2]
        for j in range(log_s.shape[0]):
            ls = log_s.expand(len(grid), -1).clone()
            ph = phase.expand(len(grid), -1).clone()
            ls[:, j] = (ls[:, j] + grid[:, 0]).clamp(-MAX_LOG_SCALE, MAX_LOG_SCALE)
            ph[:, j] = ph[:, j] + grid[:, 1]
            vals = obj.batch(*_z(ls, ph))
            i = int(vals.argmin())
            if float(vals[i]) < best:
                best, log_s, phase = float(vals[i]), ls[i].clone(), ph[i].clone()
        span_s, span_p = span_s / 4, span_p / 4
    return log_s, phase, best


def adam_search(obj: RopeQK, log_s: torch.Tensor, phase: torch.Tensor, steps: int = 200, lr: float = 0.03
                ) -> tuple[torch.Tensor, torch.Tensor, float]:
    ls = torch.nn.Parameter(log_s.clone().float())
    ph = torch.nn.Parameter(phase.clone().float())
    opt = torch.optim.Adam([ls, ph], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(1, steps))))
    best = (float("inf"), ls.detach().clone(), ph.detach().clone())
    for _ in range(steps + 1):
        loss = obj(_z(ls, ph))
        if float(loss.detach()) < best[0]:  # the objective at the current (pre-step) point
            best = (float(loss.detach()), ls.detach().clone(), ph.detach().clone())
        if _ == steps:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            ls.clamp_(-MAX_LOG_SCALE, MAX_LOG_SCALE)
    return best[1], best[2], best[0]


def rope_objective(data: LayerData, fmt: PathFormat, seqs: torch.Tensor, weighting: str, page=None):
    """The positional QK objective on the kept keys of sequences `seqs` (sorted): per-token groups of
    `fmt` (:class:`RopeQK`), or, with `page` (a ``cache.rope_channel.RopeChannelFormat``), the keys
    stored per channel per page (:class:`RopePageQK`)."""
    dev = data.keys.device
    m = torch.isin(data.key_seq, seqs.to(dev))
    A = data.A[weighting]
    ref = None if data.key_ref is None else data.key_ref[m]
    if page is None:
        return RopeQK(data.keys[m], A[m], fmt, data.rope_layout, ref)
    if data.key_pos is None:
        raise ValueError("a per-page RoPE objective needs the kept keys' positions (LayerData.key_pos)")
    return RopePageQK(data.k_rope[seqs.to(data.k_rope.device)], data.key_pos, A[m], page, data.rope_layout, ref)


def fit_rope(data: LayerData, fmt: PathFormat, fit_seqs: torch.Tensor, held_seqs: torch.Tensor, *,
             weighting: str = "attention", searches: tuple[str, ...] = SEARCHES, steps: int = 200,
             grid_sweeps: int = 2, pbar=None, page=None) -> RopeFit:
    """page: a ``cache.rope_channel.RopeChannelFormat``: fit for RoPE keys stored per channel per page
    instead of the per-token groups of `fmt` (whose bits, mode and meta dtype it shares)."""
    P = data.k_rope.shape[-1] // 2
    dev = data.keys.device
    obj_fit = rope_objective(data, fmt, fit_seqs, weighting, page)
    obj_held = rope_objective(data, fmt, held_seqs, weighting, page)
    zero = torch.zeros(P, device=dev)
    points: dict[str, tuple[torch.Tensor, torch.Tensor]] = {"rtn": (zero, zero)}
    if fmt.quantized:
        if "closed" in searches:
            points.update({k: (v, zero) for k, v in closed_forms(data, fit_seqs).items()})
        fit_vals = {k: float(obj_fit(_z(*v))) for k, v in points.items()}
        start = min(fit_vals, key=fit_vals.get)
        if "grid" in searches:
            ls, ph, _ = grid_search(obj_fit, *points[start], sweeps=grid_sweeps)
            points["grid"] = (ls, ph)
            if pbar is not None:
                pbar.update(1)
        fit_vals = {k: float(obj_fit(_z(*v))) for k, v in points.items()}
        start = min(fit_vals, key=fit_vals.get)
        if "adam" in searches and steps > 0:
            ls, ph, _ = adam_search(obj_fit, *points[start], steps=steps)
            points["adam"] = (ls, ph)
    with torch.no_grad():
        fit_vals = {k: float(obj_fit(_z(*v))) for k, v in points.items()}
        heldout = {k: float(obj_held(_z(*v))) for k, v in points.items()}
    chosen = min(heldout, key=heldout.get)
    ls, ph = points[chosen]
    return RopeFit(RopeTransform.from_polar(ls.double().exp().cpu(), ph.double().cpu()), chosen, heldout, fit_vals)
