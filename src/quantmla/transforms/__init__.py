"""Fusible transforms of MLA's two cache paths (docs/design.md §3).

Content: ``c' = c · diag(1/γ) · Q · diag(γ')`` (orthogonal Q, nonzero γ'), fused into
kv_a_proj_with_mqa, kv_a_layernorm and kv_b_proj. RoPE: one complex scalar per frequency pair on
the key and its inverse conjugate on every head's query, fused into kv_a_proj_with_mqa and the
query projection. Both leave the full-precision function unchanged.
"""

from quantmla.transforms.content import (
    ContentTransform, LearnedRotation, fuse_content, hadamard, identity_rotation, random_orthogonal,
)
from quantmla.transforms.fuse import LayerTransform, TransformSet, fuse_transforms, random_transforms
from quantmla.transforms.rope import RopeTransform, apply_pairs, fuse_rope, pair_channels

__all__ = [
    "ContentTransform", "LearnedRotation", "fuse_content", "hadamard", "identity_rotation", "random_orthogonal",
    "LayerTransform", "TransformSet", "fuse_transforms", "random_transforms",
    "RopeTransform", "apply_pairs", "fuse_rope", "pair_channels",
]
