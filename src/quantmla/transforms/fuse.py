"""Fuse per-layer transforms into a model's weights, in place.

A :class:`LayerTransform` holds an optional content transform (orthogonal rotation + rescale of
the normalized latent) and an optional RoPE transform (one complex scalar per frequency pair).
A TransformSet maps cache slots (``MLASpec.mla_layers``) to LayerTransforms. Fusion is exact in
real arithmetic; it runs in float64 and casts back to each weight's dtype, so an fp32 model keeps
its logits to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from quantmla.errors import QuantMLAError
from quantmla.model.spec import MLASpec, load_spec, mla_modules
from quantmla.model.view import MLAView
from quantmla.transforms.content import ContentTransform, fuse_content, random_orthogonal
from quantmla.transforms.rope import RopeTransform, fuse_rope


@dataclass
class LayerTransform:
    content: ContentTransform | None = None
    rope: RopeTransform | None = None

    def summary(self) -> dict:
        out: dict = {}
        if self.content is not None:
            q = self.content.rotation.double()
            out["content"] = {
                "rotation_distance_from_identity": float((q - torch.eye(q.shape[0], dtype=q.dtype)).norm()),
                "gamma_min": float(self.content.gamma.abs().min()),
                "gamma_max": float(self.content.gamma.abs().max()),
            }
        if self.rope is not None:
            out["rope"] = {"scale": [round(float(s), 5) for s in self.rope.scale],
                           "phase": [round(float(p), 5) for p in self.rope.phase]}
        return out


TransformSet = Mapping[int, LayerTransform]


FUSED_INTO = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "q_b_proj", "q_proj")


def check_fusable(module: torch.nn.Module, slot: int) -> None:
    """QuantMLAError where a weight the transforms fuse into is not plain 16- or 32-bit floats: block-FP8 weights
    (official DeepSeek-V3 and Kimi-K2 checkpoints loaded as transformers' FP8Linear, with per-block scales beside them)
    or other quantized storage would be rewritten under scales that no longer fit them."""
    for name in FUSED_INTO:
        sub = getattr(module, name, None)
        w = getattr(sub, "weight", None)
        if w is None:
            continue
        scaled = hasattr(sub, "weight_scale_inv")
        if not w.is_floating_point() or w.element_size() < 2 or scaled:
            raise QuantMLAError(
                f"MLA layer {slot}: {name} holds {w.dtype} weights{' with per-block scales' if scaled else ''}, "
                "which the transforms cannot be fused into: load the checkpoint dequantized (from_pretrained(..., "
                "quantization_config=FineGrainedFP8Config(dequantize=True)) for block-FP8 checkpoints), or calibrate "
                "it with --stream, which reads FP8 shards itself")


def fuse_transforms(model: torch.nn.Module, transforms: TransformSet, spec: MLASpec | None = None) -> None:
    """Fuse each slot's transforms into its attention module (in place); every module is checked first
    (``check_fusable``), so a refused model is left as it was."""
    spec = spec or load_spec(model)
    mods = mla_modules(model)
    for slot in transforms:
        if slot not in mods:
            raise QuantMLAError(f"transform for cache slot {slot}, but the model's MLA slots are {list(mods)}")
        check_fusable(mods[slot], slot)
    for slot, lt in transforms.items():
        module = mods[slot]
        if lt.content is not None:
            fuse_content(module, spec.d_c, lt.content)
        if lt.rope is not None:
            fuse_rope(module, spec, lt.rope, MLAView(module, spec).q_out_proj)


def random_transforms(model: torch.nn.Module, generator: torch.Generator | None = None,
                      content: bool = True, rope: bool = True) -> dict[int, LayerTransform]:
    """Random transforms of every MLA layer (Haar-random Q, random positive γ', random complex z
    with phases in [−π, π) and scales in [0.25, 4]): for checking fusion is exact."""
    spec = load_spec(model)
    g = generator or torch.Generator().manual_seed(0)
    out = {}
    for slot in spec.mla_layers:
        ct = rt = None
        if content:
            gamma = torch.exp(torch.randn(spec.d_c, generator=g, dtype=torch.float64) * 0.5)
            ct = ContentTransform(random_orthogonal(spec.d_c, g), gamma)
        if rope:
            scale = torch.exp((torch.rand(spec.num_pairs, generator=g, dtype=torch.float64) * 2 - 1) * 1.386)
            phase = (torch.rand(spec.num_pairs, generator=g, dtype=torch.float64) * 2 - 1) * torch.pi
            rt = RopeTransform.from_polar(scale, phase)
        out[slot] = LayerTransform(ct, rt)
    return out
