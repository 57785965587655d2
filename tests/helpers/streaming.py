"""Test scaffolding for the streamed calibration: a stand-in fit and fault injection (synthetic
checkpoints: :mod:`quantmla_lab.random_checkpoint`)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.errors import QuantMLAError
from quantmla.model.spec import MLASpec


def standin_fit(module, spec: MLASpec, records: list[dict], quant: QuantCacheConfig, *, method: str, seed: int, **_):
    """A fit with no learning, for tests of the streaming machinery: "random" draws a seeded
    random content + RoPE transform, perturbed by the data (so wrong inputs give a different
    transform); "identity" returns no transform."""
    from quantmla.transforms import ContentTransform, LayerTransform, RopeTransform, random_orthogonal

    if method == "identity":
        return LayerTransform(None, None)
    if method != "random":
        raise QuantMLAError(f"the stand-in fit knows 'random' and 'identity', not {method!r}")
    g = torch.Generator().manual_seed(int(seed))
    h = torch.cat([r["hidden"].reshape(-1, r["hidden"].shape[-1]).double() for r in records])
    gamma = torch.exp(torch.randn(spec.d_c, generator=g, dtype=torch.float64) * 0.3) * (1 + float(h.pow(2).mean()) * 1e-3)
    z = torch.polar(torch.exp(torch.randn(spec.num_pairs, generator=g, dtype=torch.float64) * 0.3),
                    torch.rand(spec.num_pairs, generator=g, dtype=torch.float64) * 6.28 - 3.14)
    return LayerTransform(ContentTransform(random_orthogonal(spec.d_c, g), gamma), RopeTransform(z))


@dataclass(frozen=True)
class KillAt:
    """Fault injection for tests: SIGKILL this process (no cleanup, like the OOM killer) at
    `event` of layer `layer` — "tensor_written" (mid-shard: a partial temporary file is left),
    "shard_renamed" (shard in place, marker not yet written)."""

    layer: int
    event: str = "tensor_written"

    def __call__(self, event: str, layer: int) -> None:
        if event == self.event and layer == self.layer:
            os.kill(os.getpid(), signal.SIGKILL)
