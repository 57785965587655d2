"""The absorbed-MLA reference equals transformers' own attention output for every family."""

import pytest
import torch

from quantmla.model.capture import capture_attention_inputs
from quantmla.model.spec import load_spec, mla_modules
from quantmla.model.tiny import FAMILIES, tiny_model
from quantmla.model.view import MLAView
from quantmla.reference import absorbed_attention


@pytest.mark.parametrize("family", FAMILIES)
def test_absorbed_equals_hf_attention(family):
    model = tiny_model(family)  # fp32: the MoE grouped matmul has no fp64 kernel
    spec = load_spec(model)
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad(), capture_attention_inputs(model, outputs=True) as rec:
        model(ids)
    for slot, module in mla_modules(model).items():
        r = rec[slot][0]
        view = MLAView(module, spec)
        with torch.no_grad():
            p = view.parts(r["hidden"], r["position_embeddings"])
            q_lat = view.absorb(p["q_nope"]).transpose(1, 2)  # [B, S, H, d_c]
            o, lse = absorbed_attention(q_lat, p["q_rope"].transpose(1, 2), p["latent"], p["k_rope"], spec.softmax_scale)
            out = view.output(o)
        # transformers' eager attention runs its softmax in fp32, so agreement is at fp32 level
        torch.testing.assert_close(out, r["output"], rtol=1e-4, atol=1e-5)
        assert torch.isfinite(lse).all()


def test_reference_masks_lengths_and_mtp_queries():
    torch.manual_seed(1)
    B, S, H, dc, dr, T = 3, 3, 2, 8, 4, 7
    qc, qr = torch.randn(B, S, H, dc), torch.randn(B, S, H, dr)
    c, kr = torch.randn(B, T, dc), torch.randn(B, T, dr)
    lens = torch.tensor([7, 2, 0])
    o, lse = absorbed_attention(qc, qr, c, kr, 0.5, lens)
    # sequence 0, last query sees all 7 tokens; first query sees 5
    s = 0.5 * (c[0] @ qc[0, 0, 0].double().float() + kr[0] @ qr[0, 0, 0])
    p = torch.softmax(s[:5].double(), 0)
    torch.testing.assert_close(o[0, 0, 0], (p[:, None] * c[0, :5].double()).sum(0))
    # sequence 1 (length 2): query 0 sees nothing -> o = 0, lse = -inf
    assert torch.isinf(lse[1, 0]).all() and (o[1, 0] == 0).all()
    assert torch.isinf(lse[2]).all() and (o[2] == 0).all()


def test_row_products_equal_the_batched_ones_in_place():
    """absorb_rows / values_rows (the serving engine's) give absorb / values (the reference's) on rows, from a
    strided q_nope, written into the given output without changing its layout."""
    model = tiny_model("deepseek_v3", dtype=torch.float64)
    view = MLAView(next(iter(mla_modules(model).values())), load_spec(model))
    s = view.spec
    q = torch.randn(5, s.num_heads, s.d_n + s.d_r, dtype=torch.float64)[..., : s.d_n]  # strided, as from q_proj
    out = torch.full((5, s.num_heads, s.d_c), float("nan"), dtype=torch.float64)
    with torch.no_grad():  # out= products: inference only, as the engine runs them
        got = view.absorb_rows(q, out=out)
        ref = view.absorb(q.transpose(0, 1)[None])[0].transpose(0, 1)
    assert got.data_ptr() == out.data_ptr() and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    o = torch.randn(5, s.num_heads, s.d_c, dtype=torch.float64)
    vals = torch.full((7, s.num_heads, s.d_v), float("nan"), dtype=torch.float64)
    with torch.no_grad():
        view.values_rows(o, out=vals[:5])
        ref_v = view.values(o[None])[0]
    torch.testing.assert_close(vals[:5], ref_v, rtol=1e-12, atol=1e-12)
    assert vals[5:].isnan().all()  # only its rows written
