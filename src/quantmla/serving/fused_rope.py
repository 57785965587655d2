"""An MLA layer's step pieces with its RoPE in one kernel (``kernels.rope``) inside engine steps.

The family's own RoPE function (``MLAView.rotate``) is six small kernels a layer in a decode step (each piece cast
to fp32 and back around its products); the kernel reads both pieces, strided as the projections leave them, and
writes them contiguous, as the attention kernels read them. An engine uses it where a probe at construction shows
that it gives what the family's function gives (the same dtype, and values within one rounding of that dtype) on
position embeddings from the model's own rotary module; ``Engine.rope`` says "fused" or why not.
"""

from __future__ import annotations

import torch
from torch import nn

from quantmla.model.view import MLAView

# the largest |kernel - family| over a probe, relative to its largest |value|: a rounding of the dtype, not a
# different convention (a wrong pairing or sign is off by the values' own size)
_TOL = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def rotary_module(model: nn.Module) -> nn.Module | None:
    """The model's rotary embedding module (``model.model.rotary_emb`` in the transformers MLA families)."""
    return next((m for name, m in model.named_modules() if name.split(".")[-1] == "rotary_emb"), None)


def probe(model: nn.Module, view: MLAView) -> str | None:
    """Why the kernel does not reproduce ``view.rotate`` on a probe, or None."""
    from quantmla.kernels.rope import rope_rotate

    mode, rot = view.rope_mode, rotary_module(model)
    if mode is None:
        return "the family does not rotate its RoPE pieces"
    if rot is None:
        return "the model has no rotary_emb module to take position embeddings from"
    s, w = view.spec, view.m.kv_a_proj_with_mqa.weight
    positions = torch.tensor([[0, 1, 2, 17, 255, 1000, 4097, 30001]], device=w.device)
    g = torch.Generator(device=w.device).manual_seed(0)
    n = positions.shape[1]
    q = (torch.randn(1, n, s.num_heads, s.d_n + s.d_r, generator=g, device=w.device) * 3).to(w.dtype)[..., s.d_n:]
    k = (torch.randn(1, n, s.d_c + s.d_r, generator=g, device=w.device) * 3).to(w.dtype)[..., s.d_c:]
    with torch.no_grad():
        pe = rot(torch.zeros(1, n, 1, dtype=w.dtype, device=w.device), positions)
        ref_q, ref_k = view.rotate(q.transpose(1, 2), k, pe)
        try:
            got_q, got_k = rope_rotate(q[0], k[0], *view.rope_tables(pe), mode)
        except (ValueError, RuntimeError, TypeError, IndexError) as e:
            return f"the kernel cannot take these pieces: {str(e).splitlines()[0]}"
    ref_q, ref_k = ref_q[0].transpose(0, 1), ref_k[0]
    if (ref_q.dtype, ref_q.shape, ref_k.shape) != (got_q.dtype, got_q.shape, got_k.shape):
        return (f"the family's function gives {ref_q.dtype} {tuple(ref_q.shape)}/{tuple(ref_k.shape)}, the kernel "
                f"{got_q.dtype} {tuple(got_q.shape)}/{tuple(got_k.shape)}")
    err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in ((got_q, ref_q), (got_k, ref_k)))
    tol = _TOL.get(w.dtype, 2.0**-7)
    return None if err <= tol else f"the kernel differs from the family's function by {err:.2g} (relative)"


def latent_norms(modules: dict[int, nn.Module], spec, engine) -> dict[int, tuple[torch.Tensor, float]]:
    """slot -> (weight, eps) of each MLA module whose latent RMSNorm (``kv_a_layernorm``) `engine` runs as the fused
    norm kernel (``serving/norms.py``, probed against the module there): that arithmetic can then run in the RoPE
    kernel's launch (``kernels.rope.norm_and_rotate``). Not where the family scales the latent after its norm."""
    from quantmla.serving.norms import fused_in

    if spec.latent_scale != 1.0:
        return {}
    out = {}
    for slot, m in modules.items():
        n = getattr(m, "kv_a_layernorm", None)
        if n is not None and fused_in(n, engine):
            out[slot] = (n.weight, n.variance_epsilon)
    return out


def step_pieces(view: MLAView, hidden: torch.Tensor, position_embeddings, fused: bool, merged=None,
                latent_norm: tuple[torch.Tensor, float] | None = None):
    """The four dual-path pieces of a step's N tokens (hidden [1, N, h]): q_nope [N, H, d_n] (a strided view),
    q_rope [N, H, d_r], latent [N, d_c], k_rope [N, d_r], both RoPE pieces rotated (by the kernel where `fused`).
    `merged`: the layer's ``q_in_proj`` and ``kv_a_proj_with_mqa`` as one product (``serving/merged.py``), used
    while both weights are still its views. `latent_norm` (with `fused`; from :func:`latent_norms`): the latent's
    RMSNorm (weight, eps) runs in the RoPE kernel's launch instead of its module's own."""
    q_in = ckv = None
    if merged is not None and merged.current():
        q_in, ckv = merged(hidden)
    q_nope, q_rope = view.project_query(hidden, q_in)
    if fused and latent_norm is not None:
        from quantmla.kernels.rope import norm_and_rotate

        ckv = view.m.kv_a_proj_with_mqa(hidden) if ckv is None else ckv
        d_c = view.spec.d_c
        latent, q_rope, k_rope = norm_and_rotate(ckv[0, :, :d_c], *latent_norm, q_rope[0].transpose(0, 1),
                                                 ckv[0, :, d_c:], *view.rope_tables(position_embeddings), view.rope_mode)
        return q_nope[0].transpose(0, 1), q_rope, latent, k_rope
    latent, k_rope = view.project_kv(hidden, ckv)
    if not fused:
        q_rope, k_rope = view.rotate(q_rope, k_rope, position_embeddings)
        return q_nope[0].transpose(0, 1), q_rope[0].transpose(0, 1), latent[0], k_rope[0]
    from quantmla.kernels.rope import rope_rotate

    q_rope, k_rope = rope_rotate(q_rope[0].transpose(0, 1), k_rope[0], *view.rope_tables(position_embeddings),
                                 view.rope_mode)
    return q_nope[0].transpose(0, 1), q_rope, latent[0], k_rope
