"""Function-aligned objectives on captured full-precision activations (one layer at a time).

Content path — attention-output reconstruction. With cached latent ``c`` quantized in the
transformed basis, ``ĉ = Q_b(c·T)·T⁻¹`` is what the fused model effectively attends with (the
transformed query and W_UV absorb T), so

    D_content = Σ ‖Attn(q, ĉ, k_R) − Attn(q, c, k_R)‖² / Σ ‖Attn(q, c, k_R)‖²

over sampled queries, where Attn is the attention block's output *after* o_proj:
``Σ_h softmax(s_h)·ĉ·W_UV^(h)·W_O^(h)``. After o_proj because that is what the residual stream
(and every later layer) receives: it weights each head's error by how much o_proj passes on and lets
errors of different heads cancel or add as they really do; before o_proj every head's value error
would count equally, including directions o_proj suppresses. It costs one [d_c → hidden] product
per head. Matching (scores) and aggregation (values) errors are both in it, coupled as in the model.

RoPE path — positional QK reconstruction, as a quadratic form per kept key u (see capture.py):

    D_rope = Σ_u e(u)ᵀ A(u) e(u) / Σ_u k_R(u)ᵀ A(u) k_R(u),   e(u) = Q_b(k_R(u)·M)·M⁻¹ − k_R(u)

i.e. the mean squared RoPE logit error relative to the mean squared RoPE logit.
"""

from __future__ import annotations

import torch

from quantmla.calibration.capture import LayerData
from quantmla.calibration.fakequant import fake_quant_lsq
from quantmla.quant import PathFormat
from quantmla.transforms.rope import apply_pairs


def rope_logits(data: LayerData, seqs: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """scale·q^R·k_R of the sampled queries of `seqs` against k_rope [b, L, d_r], with the causal mask
    applied (−inf): [b, S_q·H, L]."""
    b, L = k_rope.shape[:2]
    q_r = data.q_rope[seqs]  # [b, S_q, H, d_r]
    S_q, H = q_r.shape[1:3]
    s = torch.bmm(q_r.reshape(b, S_q * H, -1), k_rope.transpose(1, 2)) * data.scale
    masked = torch.arange(L, device=s.device)[None, None, :] > data.q_pos[seqs][:, :, None]  # [b, S_q, L]
    s.view(b, S_q, H, L).masked_fill_(masked[:, :, None], float("-inf"))
    return s


def attention_output(data: LayerData, seqs: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor | None = None,
                     before_o_proj: bool = False, rope_logits_: torch.Tensor | None = None) -> torch.Tensor:
    """Attention-block output of the sampled queries of sequences `seqs`, attending over
    latent [b, L, d_c] and k_rope [b, L, d_r] (or precomputed :func:`rope_logits`): [b, S_q, hidden]
    (or [b, S_q, H, d_c] latent-space head outputs when before_o_proj)."""
    q_lat = data.q_latent[seqs]  # [b, S_q, H, d_c]
    b, S_q, H, d_c = q_lat.shape
    if rope_logits_ is None:
        rope_logits_ = rope_logits(data, seqs, k_rope)
    s = torch.baddbmm(rope_logits_, q_lat.reshape(b, S_q * H, d_c), latent.transpose(1, 2), alpha=data.scale)
    o = torch.bmm(torch.softmax(s, -1), latent)  # [b, S_q·H, d_c]
    if before_o_proj:
        return o.view(b, S_q, H, d_c)
    return o.reshape(b, S_q, H * d_c) @ data.out_proj.reshape(H * d_c, -1)


def content_dequant(latent: torch.Tensor, t: torch.Tensor | None, t_inv: torch.Tensor | None, fmt: PathFormat) -> torch.Tensor:
    """ĉ = Q_b(c·T)·T⁻¹ (T None: plain round trip), differentiable in T through the LSQ fake quantizer."""
    if t is None:
        return fake_quant_lsq(latent, fmt)
    return fake_quant_lsq(latent @ t, fmt) @ t_inv


def rope_dequant(k_rope: torch.Tensor, z: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None,
                 fmt: PathFormat, layout: str) -> torch.Tensor:
    """k̂_R = Q_b(k_R·M)·M⁻¹ with M the per-pair scalars z = (re, im) or complex (None: identity)."""
    return _through_pairs(k_rope, z, layout, lambda k: fake_quant_lsq(k, fmt))


def _through_pairs(k_rope: torch.Tensor, z, layout: str, quantize) -> torch.Tensor:
    """quantize(k_R·M)·M⁻¹ with M the per-pair scalars z = (re, im) or complex (None: quantize(k_R))."""
    if z is None:
        return quantize(k_rope)
    zr, zi = (z.real, z.imag) if torch.is_tensor(z) and torch.is_complex(z) else z
    zr, zi = zr.float().to(k_rope.device), zi.float().to(k_rope.device)
    n2 = zr * zr + zi * zi
    return apply_pairs(quantize(apply_pairs(k_rope, (zr, zi), layout)), (zr / n2, -zi / n2), layout)


def rope_page_dequant(k_rope: torch.Tensor, z, page, layout: str) -> torch.Tensor:
    """k̂_R = Q_pages(k_R·M)·M⁻¹ for keys stored per channel per page (``cache.rope_channel``; any
    length, the unfinished page as the cache quantizes it), z as in :func:`rope_dequant`; no gradient."""
    from quantmla.cache.rope_channel import quantize_pages

    return _through_pairs(k_rope, z, layout, lambda k: quantize_pages(k, page))


class OutputDistortion:
    """Relative attention-output error on a set of sequences, with cached references."""

    def __init__(self, data: LayerData, seqs: torch.Tensor, chunk: int = 4, before_o_proj: bool = False):
        self.data, self.seqs, self.chunk, self.before = data, seqs, chunk, before_o_proj
        with torch.no_grad():
            self.rope = [rope_logits(data, c, data.k_rope[c]) for c in self.chunks()]
            self.ref = [attention_output(data, c, data.latent[c], before_o_proj=self.before, rope_logits_=r)
                        for c, r in zip(self.chunks(), self.rope)]
        self.energy = sum(float(r.pow(2).sum()) for r in self.ref)

    def chunks(self):
        return [self.seqs[i : i + self.chunk] for i in range(0, len(self.seqs), self.chunk)]

    @torch.no_grad()
    def __call__(self, content_fn=None, rope_fn=None) -> float:
        """content_fn(latent) -> ĉ, rope_fn(k_rope) -> k̂_R (None: full precision)."""
        err = 0.0
        for c, ref, rl in zip(self.chunks(), self.ref, self.rope):
            lat = self.data.latent[c]
            lat = content_fn(lat) if content_fn else lat
            if rope_fn is not None:
                rl = rope_logits(self.data, c, rope_fn(self.data.k_rope[c]))
            err += float((attention_output(self.data, c, lat, before_o_proj=self.before, rope_logits_=rl) - ref).pow(2).sum())
        return err / max(self.energy, 1e-30)


def page_fake_quant(k: torch.Tensor, fmt) -> torch.Tensor:
    """k [..., T, d_r] through per-channel per-page codes (``cache.rope_channel.RopeChannelFormat`` `fmt`,
    pages from token 0, T a multiple of the page size), differentiable through the LSQ fake quantizer:
    forward equal to ``cache.rope_channel.quantize_pages``."""
    T, d_r = k.shape[-2], k.shape[-1]
    P = fmt.page_size
    if T % P:
        raise ValueError(f"page fake-quant needs whole pages: {T} tokens, pages of {P}")
    pages = k.float().reshape(*k.shape[:-2], T // P, P, d_r).transpose(-1, -2)  # [..., n, d_r, P]
    return fake_quant_lsq(pages, fmt.page_format).transpose(-1, -2).reshape(k.shape)


class RopePageQK:
    """The positional QK reconstruction objective of :class:`RopeQK` for RoPE keys stored per channel
    per page (``cache.rope_channel``): a kept key's error depends on every key of its page, so the
    round trip runs over whole sequences k_rope [n, L, d_r] (L a multiple of the page) and the
    errors of the kept keys (positions `key_pos` [K] in every sequence, A [n·K, d_r, d_r] in the
    same order as :attr:`LayerData.keys`) enter the same quadratic form:

        D = Σ_u e(u)ᵀ A(u) e(u) / Σ_u k_R(u)ᵀ A(u) k_R(u),   e = Q_pages(k_R·M)·M⁻¹ − k_R  at the kept u.

    Under affine per-channel codes the pair *scales* cancel (a channel's step scales with it) up to
    the fp16 rounding of the metadata; the pair *phases* decide how each pair's spread within a page
    splits between its two channels."""

    def __init__(self, k_rope: torch.Tensor, key_pos: torch.Tensor, A: torch.Tensor, fmt, layout: str,
                 ref: torch.Tensor | None = None):
        self.k_rope, self.key_pos, self.A, self.fmt, self.layout = k_rope.float(), key_pos.to(k_rope.device), A, fmt, layout
        L = k_rope.shape[1]
        self.L = L - L % fmt.page_size  # whole pages only (the unfinished page of a calibration row is dropped)
        self.keep = self.key_pos < self.L  # [K]
        K = key_pos.numel()
        self.sel = self.keep.repeat(k_rope.shape[0])  # [n·K]
        keys = k_rope[:, self.key_pos].reshape(-1, k_rope.shape[-1])
        r = keys if ref is None else ref
        r, A_ = r[self.sel], A[self.sel]
        self.A_kept = A_
        self.energy = float(torch.einsum("kd,kde,ke->", r, A_, r).clamp_min(1e-30))
        assert A.shape[0] == k_rope.shape[0] * K

    def _error(self, k_hat: torch.Tensor) -> torch.Tensor:
        """k_hat [..., n, L', d_r] -> Σ eᵀAe / energy over the kept keys."""
        pos = self.key_pos[self.keep]
        e = (k_hat[..., pos, :] - self.k_rope[:, pos]).flatten(-3, -2)  # [..., n·K', d_r]
        ea = torch.einsum("...kd,kde->...ke", e, self.A_kept)
        return (ea * e).sum(dim=(-1, -2)) / self.energy

    def __call__(self, z=None) -> torch.Tensor:
        k = self.k_rope[:, : self.L]
        if z is None:
            return self._error(page_fake_quant(k, self.fmt))
        zr, zi = (z.real, z.imag) if torch.is_tensor(z) and torch.is_complex(z) else z
        zr, zi = zr.float().to(k.device), zi.float().to(k.device)
        n2 = zr * zr + zi * zi
        k_hat = apply_pairs(page_fake_quant(apply_pairs(k, (zr, zi), self.layout), self.fmt), (zr / n2, -zi / n2), self.layout)
        return self._error(k_hat)

    @torch.no_grad()
    def batch(self, zr: torch.Tensor, zi: torch.Tensor) -> torch.Tensor:
        """Objective of G candidates at once: zr, zi [G, P] -> [G]."""
        out = []
        k = self.k_rope[:, : self.L]
        for g in range(0, zr.shape[0], 8):
            r, i = zr[g : g + 8, None, None, :], zi[g : g + 8, None, None, :]
            n2 = r * r + i * i
            kh = apply_pairs(page_fake_quant(apply_pairs(k.unsqueeze(0), (r, i), self.layout), self.fmt),
                             (r / n2, -i / n2), self.layout)
            out.append(self._error(kh))
        return torch.cat(out)


class RopeQK:
    """The positional QK reconstruction objective on a set of kept keys (one weighting)."""

    def __init__(self, keys: torch.Tensor, A: torch.Tensor, fmt: PathFormat, layout: str, ref: torch.Tensor | None = None):
        """ref: keys whose logit energy normalizes the error (default `keys`; centred keys pass the
        uncentred ones, so objectives with and without centring compare)."""
        self.keys, self.A, self.fmt, self.layout = keys, A, fmt, layout
        r = keys if ref is None else ref
        self.energy = float(torch.einsum("kd,kde,ke->", r, A, r).clamp_min(1e-30))

    def error(self, e: torch.Tensor) -> torch.Tensor:
        """e [..., K, d_r] -> Σ_u eᵀAe / energy, over the leading dims."""
        ea = torch.einsum("...kd,kde->...ke", e, self.A)
        return (ea * e).sum(dim=(-1, -2)) / self.energy

    def __call__(self, z=None) -> torch.Tensor:
        k_hat = rope_dequant(self.keys, z, self.fmt, self.layout)
        return self.error(k_hat - self.keys)

    @torch.no_grad()
    def batch(self, zr: torch.Tensor, zi: torch.Tensor) -> torch.Tensor:
        """Objective of G candidates at once: zr, zi [G, P] -> [G]."""
        out = []
        for g in range(0, zr.shape[0], 16):
            r, i = zr[g : g + 16, None, :], zi[g : g + 16, None, :]
            n2 = r * r + i * i
            k = self.keys.unsqueeze(0)
            kh = apply_pairs(fake_quant_lsq(apply_pairs(k, (r, i), self.layout), self.fmt), (r / n2, -i / n2), self.layout)
            out.append(self.error(kh - k))
        return torch.cat(out)
