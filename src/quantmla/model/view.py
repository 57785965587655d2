"""The MLA view of one transformers attention module: its dual-path pieces as tensors.

Shapes: hidden [B, S, hidden]; per-head queries [B, H, S, ·]; latent [B, S, d_c];
RoPE key [B, S, d_r]. Everything here reads the module's own weights, so a view stays valid
after transforms are fused into them.
"""

from __future__ import annotations

import sys

import torch

from quantmla.model.spec import MLASpec


class MLAView:
    def __init__(self, module: torch.nn.Module, spec: MLASpec):
        self.m, self.spec = module, spec
        self._modeling = sys.modules[type(module).__module__]

    # -- weights ---------------------------------------------------------------------------------
    def _kv_b(self) -> torch.Tensor:
        s = self.spec
        return self.m.kv_b_proj.weight.view(s.num_heads, s.d_n + s.d_v, s.d_c)

    @property
    def w_uk(self) -> torch.Tensor:
        """[H, d_n, d_c]: k^C_i = latent · w_uk[i]ᵀ."""
        return self._kv_b()[:, : self.spec.d_n]

    @property
    def w_uv(self) -> torch.Tensor:
        """[H, d_v, d_c]: v_i = latent · w_uv[i]ᵀ."""
        return self._kv_b()[:, self.spec.d_n :]

    @property
    def q_out_proj(self) -> torch.nn.Linear:
        """The linear whose outputs are the per-head queries (q_proj or q_b_proj)."""
        return self.m.q_proj if getattr(self.m, "q_lora_rank", None) is None and hasattr(self.m, "q_proj") else self.m.q_b_proj

    # -- activations -----------------------------------------------------------------------------
    @property
    def q_in_proj(self) -> torch.nn.Linear:
        """The linear that reads the hidden states on the query path (q_proj, or q_a_proj with q_lora)."""
        return self.m.q_proj if self.q_out_proj is not getattr(self.m, "q_b_proj", None) else self.m.q_a_proj

    def project_query(self, hidden: torch.Tensor, q_in: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q_nope [B, H, S, d_n], q_rope before rotation [B, H, S, d_r]). `q_in`: ``q_in_proj(hidden)`` when
        already computed (a block of a stacked product, ``serving/merged.py``)."""
        s, m = self.spec, self.m
        B, S, _ = hidden.shape
        if q_in is None:
            q_in = self.q_in_proj(hidden)
        q = m.q_b_proj(m.q_a_layernorm(q_in)) if self.q_out_proj is getattr(m, "q_b_proj", None) else q_in
        q = q.view(B, S, s.num_heads, s.d_n + s.d_r).transpose(1, 2)
        if s.query_scale != 1.0:
            q = q * s.query_scale
        return q[..., : s.d_n], q[..., s.d_n :]

    def position_query_scale(self, positions: torch.Tensor) -> torch.Tensor | None:
        """mistral4's query scale at integer `positions` [...]: 1 + β·log(1 + ⌊p / scaled_query_from⌋), fp32 [...],
        the family's own arithmetic (it multiplies the rotated query by it in the model's dtype); None where the
        family scales no query by position."""
        s = self.spec
        if not s.scaled_query_from:
            return None
        return 1 + s.query_scale_beta * torch.log(1 + torch.floor(positions / s.scaled_query_from))

    def scale_queries(self, positions: torch.Tensor, *queries: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`queries` [..., S, H, d] (rows at `positions` [..., S]) times :meth:`position_query_scale`, each in its
        own dtype as the family multiplies; unchanged where the family scales no query."""
        f = self.position_query_scale(positions)
        if f is None:
            return queries
        return tuple(q * f[..., None, None].to(q.dtype) for q in queries)

    def project_kv(self, hidden: torch.Tensor, ckv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (latent [B, S, d_c] as cached, RoPE key before rotation [B, S, d_r]). `ckv`:
        ``kv_a_proj_with_mqa(hidden)`` when already computed."""
        s, m = self.spec, self.m
        if ckv is None:
            ckv = m.kv_a_proj_with_mqa(hidden)
        latent = m.kv_a_layernorm(ckv[..., : s.d_c])
        if s.latent_scale != 1.0:
            latent = latent * s.latent_scale
        return latent, ckv[..., s.d_c :]

    def rotate(self, q_rope: torch.Tensor, k_rope: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the family's own RoPE. q_rope [B, H, S, d_r], k_rope [B, S, d_r] -> same shapes."""
        B, S, _ = k_rope.shape
        k4 = k_rope.view(B, 1, S, self.spec.d_r)
        fam, mod = self.spec.family, self._modeling
        if self.spec.rope_weight_layout == "none":
            q, k = q_rope, k4
        elif fam == "deepseek_v2":
            q, k = mod.apply_rotary_emb(q_rope, k4, position_embeddings.to(q_rope.device))
        elif self.spec.rope_weight_layout == "interleaved":
            q, k = mod.apply_rotary_pos_emb_interleave(q_rope, k4, *position_embeddings)
        else:
            q, k = mod.apply_rotary_pos_emb(q_rope, k4, *position_embeddings)
        return q, k.view(B, S, self.spec.d_r)

    @property
    def rope_mode(self) -> str | None:
        """How :meth:`rotate` turns channels, in ``kernels.rope``'s terms ("pairs", "half", "interleave"), or None
        where it does not rotate."""
        if self.spec.rope_weight_layout == "none":
            return None
        if self.spec.family == "deepseek_v2":
            return "pairs"
        return "interleave" if self.spec.rope_weight_layout == "interleaved" else "half"

    def rope_tables(self, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's position embeddings of one sequence (batch 1) as per-token tables for ``kernels.rope``:
        cos, sin [S, d_r / 2] fp32 views of deepseek_v2's complex freqs_cis ("pairs"), else the module's cos and
        sin [S, d_r] as they are."""
        if self.rope_mode == "pairs":
            cs = torch.view_as_real(position_embeddings[0])
            return cs[..., 0], cs[..., 1]
        cos, sin = position_embeddings
        return cos[0], sin[0]

    def parts(self, hidden: torch.Tensor, position_embeddings) -> dict[str, torch.Tensor]:
        """The four dual-path tensors of a forward: q_nope, q_rope (rotated), latent, k_rope (rotated)."""
        q_nope, q_rope = self.project_query(hidden)
        latent, k_rope = self.project_kv(hidden)
        q_rope, k_rope = self.rotate(q_rope, k_rope, position_embeddings)
        return {"q_nope": q_nope, "q_rope": q_rope, "latent": latent, "k_rope": k_rope}

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """Absorbed query q̃_i = q_i^C · W_UK^(i): [B, H, S, d_n] -> [B, H, S, d_c]."""
        return torch.einsum("bhsn,hnc->bhsc", q_nope, self.w_uk.to(q_nope.dtype))

    def values(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Per-head values from latent-space outputs: [B, S, H, d_c] -> [B, S, H, d_v]."""
        return torch.einsum("bshc,hvc->bshv", o_latent, self.w_uv.to(o_latent.dtype))

    def absorb_rows(self, q_nope: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`absorb` of N rows, q_nope [N, H, d_n] (may be strided) -> [N, H, d_c], written into `out` when
        given: one batched product per head whose output cuBLAS writes through the transposed view, so the rows
        land in the layout the decode kernels read, without a copy. Inference only (no autograd through ``out=``)."""
        if out is None:
            out = q_nope.new_empty((q_nope.shape[0], self.spec.num_heads, self.spec.d_c))
        torch.bmm(q_nope.transpose(0, 1), self.w_uk.to(q_nope.dtype), out=out.transpose(0, 1))
        return out

    def values_rows(self, o_latent: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`values` of N rows, o_latent [N, H, d_c] -> [N, H, d_v], written into `out` when given (as
        :meth:`absorb_rows`: no copy, the layout ``o_proj`` reads)."""
        if out is None:
            out = o_latent.new_empty((o_latent.shape[0], self.spec.num_heads, self.spec.d_v))
        torch.bmm(o_latent.transpose(0, 1), self.w_uv.to(o_latent.dtype).transpose(1, 2), out=out.transpose(0, 1))
        return out

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Attention-block output from latent-space outputs: [B, S, H, d_c] -> [B, S, hidden]."""
        return self.project_out(self.values(o_latent))

    def project_out(self, v: torch.Tensor) -> torch.Tensor:
        """Attention-block output from per-head values: [B, S, H, d_v] -> [B, S, hidden]."""
        return self.m.o_proj(v.reshape(*v.shape[:2], -1).to(self.m.o_proj.weight.dtype))
