"""Content bits per layer at a fixed byte budget, chosen by the error model.

Every MLA layer stores its content path at one of two widths, ``low`` or ``high`` (for example INT2 and
INT4 at the same groups). A budget of ``avg_bits`` content bits per value on average gives
``n_high = round((avg_bits − low.bits) / (high.bits − low.bits) · L)`` of the L layers the high width.
Which layers: those whose attention output gains most from it, by the content path's error model
(``calibration.objectives.OutputDistortion``: the relative attention-output error after o_proj, on the
calibration sequences, content quantized RTN at each width, RoPE key full precision):

    gain(l) = D_l(low) − D_l(high)

The layers with the largest gain get ``high`` (ties: the lower slot). The result is a
``QuantCacheConfig.layer_overrides`` mapping, so the cache, calibration and evaluation read it as they
read any per-layer format.

    sens = content_sensitivity(model, calib_ids, PathFormat(2, 32), PathFormat(4, 32))
    overrides = allocate_content_bits(sens, 3.0, PathFormat(2, 32), PathFormat(4, 32), rope_fmt)
"""

from __future__ import annotations

import torch

from quantmla.cache.layout import CacheFormat
from quantmla.calibration.capture import capture_calibration_data
from quantmla.calibration.objectives import OutputDistortion, content_dequant
from quantmla.errors import QuantMLAError
from quantmla.model.spec import load_spec
from quantmla.quant import PathFormat


def check_widths(low: PathFormat, high: PathFormat, avg_bits: float | None = None) -> None:
    """Two integer content formats, low narrower than high; avg_bits (if given) between them."""
    for f in (low, high):
        if not f.quantized or f.mode == "fp8":
            raise QuantMLAError(f"per-layer content bits choose between integer formats, got {f.describe()}")
    if low.bits >= high.bits:
        raise QuantMLAError(f"the low width ({low.bits} bits) must be below the high width ({high.bits} bits)")
    if avg_bits is not None and not low.bits < avg_bits < high.bits:
        raise QuantMLAError(f"an average of {avg_bits} content bits is not between {low.bits} and {high.bits}; "
                            "use a uniform format for an endpoint")


@torch.no_grad()
def content_sensitivity(model: torch.nn.Module, calib_ids: torch.Tensor, low: PathFormat, high: PathFormat, *,
                        queries_per_seq: int = 64, batch_size: int = 4, seed: int = 0,
                        progress: bool = False) -> dict[int, tuple[float, float]]:
    """slot -> (D(low), D(high)): each MLA layer's relative attention-output error with its content path
    quantized RTN at `low` and at `high` (RoPE key full precision), on every sequence of calib_ids [N, L]."""
    check_widths(low, high)
    spec = load_spec(model)
    data = capture_calibration_data(model, spec, torch.as_tensor(calib_ids), queries_per_seq=queries_per_seq,
                                    batch_size=batch_size, seed=seed, progress=progress)
    out = {}
    for slot, d in data.items():
        dist = OutputDistortion(d, torch.arange(d.latent.shape[0]))
        out[slot] = tuple(dist(lambda lat, f=f: content_dequant(lat, None, None, f)) for f in (low, high))
    return out


def allocate_content_bits(sensitivity: dict[int, tuple[float, float]], avg_bits: float, low: PathFormat,
                          high: PathFormat, rope: PathFormat) -> dict[int, CacheFormat]:
    """The layer overrides that give `high` to the layers gaining most from it, for an average of
    `avg_bits` content bits per value over the layers of `sensitivity` (the others keep `low`, the
    config's default content format). Returns {slot: CacheFormat(high, rope)}."""
    check_widths(low, high, avg_bits)
    if not sensitivity:
        raise QuantMLAError("no MLA layers to allocate content bits to")
    n = len(sensitivity)
    n_high = round((avg_bits - low.bits) / (high.bits - low.bits) * n)
    gain = sorted(sensitivity, key=lambda s: (-(sensitivity[s][0] - sensitivity[s][1]), s))
    return {s: CacheFormat(high, rope) for s in sorted(gain[:n_high])}
