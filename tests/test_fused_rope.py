"""The RoPE kernel (``kernels.rope``, interpreted here) against the families' own functions, its probe, and the
engine's choice of it."""

import pytest
import torch

from quantmla.kernels.norm import rms_norm
from quantmla.kernels.rope import norm_and_rotate, rope_rotate
from quantmla.model.spec import load_spec, mla_modules
from quantmla.model.tiny import FAMILIES, tiny_model
from quantmla.model.view import MLAView
from quantmla.serving import fused_rope

ROTATING = [f for f in FAMILIES if f != "kimi_linear"]


def _view(model):
    return MLAView(next(iter(mla_modules(model).values())), load_spec(model))


def _pieces(view, n, dtype, seed=0):
    """q_rope [n, H, d_r] and k_rope [n, d_r] as strided as the projections leave them."""
    s, g = view.spec, torch.Generator().manual_seed(seed)
    q = (torch.randn(n, s.num_heads, s.d_n + s.d_r, generator=g) * 3).to(dtype)[..., s.d_n:]
    k = (torch.randn(n, s.d_c + s.d_r, generator=g) * 3).to(dtype)[:, s.d_c:]
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ROTATING)
def test_kernel_is_the_familys_rope_bit_for_bit(family, dtype):
    """Every channel of both pieces equals what the family's own function gives, at positions far apart."""
    model = tiny_model(family, dtype=dtype)
    view = _view(model)
    q, k = _pieces(view, 7, dtype)
    positions = torch.tensor([[0, 1, 3, 64, 999, 4097, 20011]])
    pe = fused_rope.rotary_module(model)(torch.zeros(1, 7, 1, dtype=dtype), positions)
    ref_q, ref_k = view.rotate(q.transpose(0, 1)[None], k[None], pe)
    got_q, got_k = rope_rotate(q, k, *view.rope_tables(pe), view.rope_mode)
    ref_q, ref_k = ref_q[0].transpose(0, 1), ref_k[0]
    assert got_q.is_contiguous() and got_k.is_contiguous() and got_q.dtype == dtype
    assert not torch.equal(got_q, q)  # it rotated something
    if view.rope_mode == "pairs" and dtype == torch.float32:
        # torch's complex product on the CPU rounds (a·c − b·d) its own way: within an fp32 rounding of the values
        for got, ref in ((got_q, ref_q), (got_k, ref_k)):
            assert float((got - ref).abs().max()) <= 2.0**-22 * float(ref.abs().max())
    else:
        assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


def test_probe_passes_every_rotating_family_and_catches_another_convention(monkeypatch):
    for family in ROTATING:
        model = tiny_model(family)
        assert fused_rope.probe(model, _view(model)) is None, family
    kimi = tiny_model("kimi_linear")
    assert "does not rotate" in fused_rope.probe(kimi, _view(kimi))
    model = tiny_model("deepseek_v3")
    view = _view(model)
    assert view.rope_mode == "interleave"
    monkeypatch.setattr(MLAView, "rope_mode", property(lambda self: "half"))  # the wrong channel order
    why = fused_rope.probe(model, view)
    assert why is not None and "differs from the family's function" in why


def test_kernel_refuses_what_it_cannot_rotate():
    q, k = torch.zeros(3, 2, 64), torch.zeros(3, 64)
    cos = sin = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="mode"):
        rope_rotate(q, k, cos, sin, "complex")
    with pytest.raises(ValueError, match="does not match"):
        rope_rotate(q, torch.zeros(2, 64), cos, sin, "half")
    with pytest.raises(ValueError, match=r"should be \[3, 32\]"):
        rope_rotate(q, k, cos, sin, "pairs")
    with pytest.raises(ValueError, match="power of two"):
        rope_rotate(torch.zeros(3, 2, 48), torch.zeros(3, 48), torch.zeros(3, 48), torch.zeros(3, 48), "half")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ROTATING)
def test_latent_norm_in_the_rope_launch_is_both_kernels_bit_for_bit(family, dtype):
    """norm_and_rotate gives exactly rms_norm of the latent and rope_rotate of both RoPE pieces, the latent strided
    as the latent projection leaves it."""
    model = tiny_model(family, dtype=dtype)
    view = _view(model)
    s, g = view.spec, torch.Generator().manual_seed(5)
    q, _ = _pieces(view, 6, dtype)
    ckv = (torch.randn(6, s.d_c + s.d_r, generator=g) * 3).to(dtype)
    latent, k = ckv[:, :s.d_c], ckv[:, s.d_c:]
    w = (1 + 0.1 * torch.randn(s.d_c, generator=g)).to(dtype)
    pe = fused_rope.rotary_module(model)(torch.zeros(1, 6, 1, dtype=dtype), torch.tensor([[0, 2, 5, 77, 1000, 4099]]))
    tables = view.rope_tables(pe)
    got = norm_and_rotate(latent, w, 1e-6, q, k, *tables, view.rope_mode)
    want = (rms_norm(latent, w, 1e-6), *rope_rotate(q, k, *tables, view.rope_mode))
    for a, b in zip(got, want):
        assert a.is_contiguous() and torch.equal(a, b)
    odd = s.d_c - 6  # a latent width that is no power of two: masked as rms_norm masks it
    got = norm_and_rotate(ckv[:, :odd], w[:odd], 1e-6, q, k, *tables, view.rope_mode)[0]
    assert torch.equal(got, rms_norm(ckv[:, :odd], w[:odd], 1e-6))
    with pytest.raises(ValueError, match="norm_and_rotate: weight"):
        norm_and_rotate(latent, w[:-1], 1e-6, q, k, *tables, view.rope_mode)
    with pytest.raises(ValueError, match="tokens of q"):
        norm_and_rotate(latent[:5], w, 1e-6, q, k, *tables, view.rope_mode)


def test_step_pieces_take_the_latent_norm_into_the_rope_launch():
    """Where the engine fuses the latent's RMSNorm module, ``latent_norms`` hands its weight and eps to
    ``step_pieces``, whose pieces then equal those of the module's own (fused) norm and the RoPE kernel; a family
    that scales the latent after its norm keeps the module."""
    import types

    from quantmla.serving import norms

    model = tiny_model("deepseek_v2", dtype=torch.bfloat16)
    mods = mla_modules(model)
    view = MLAView(next(iter(mods.values())), load_spec(model))
    engine, active = types.SimpleNamespace(), [None]
    report = norms.attach(model, engine, lambda: active[0], cpu=True)
    try:
        slots = fused_rope.latent_norms(mods, view.spec, engine)
        assert set(slots) == set(mods) and all(report[n] == "fused" for n in report if "kv_a_layernorm" in n)
        slot = next(iter(mods))
        assert slots[slot][0] is mods[slot].kv_a_layernorm.weight
        hidden = (torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(2)) * 2).to(
            torch.bfloat16)
        pe = fused_rope.rotary_module(model)(hidden, torch.tensor([[3, 4, 5, 6, 900]]))
        active[0] = engine  # inside a step: the module's forward is the fused norm kernel
        got = fused_rope.step_pieces(view, hidden, pe, True, latent_norm=slots[slot])
        want = fused_rope.step_pieces(view, hidden, pe, True)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        from quantmla.serving.merged import MergedLinears

        merged = MergedLinears([view.q_in_proj, view.m.kv_a_proj_with_mqa])  # the latent a strided view of one GEMM
        try:
            for a, b in zip(fused_rope.step_pieces(view, hidden, pe, True, merged, latent_norm=slots[slot]), want):
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # one GEMM instead of two: bf16 roundings
            for a, b in zip(fused_rope.step_pieces(view, hidden, pe, True, merged, latent_norm=slots[slot]),
                            fused_rope.step_pieces(view, hidden, pe, True, merged)):
                assert torch.equal(a, b)
        finally:
            merged.release()
        scaled = types.SimpleNamespace(latent_scale=2.0)
        assert fused_rope.latent_norms(mods, scaled, engine) == {}
        assert fused_rope.latent_norms(mods, view.spec, types.SimpleNamespace()) == {}  # another engine: not fused
    finally:
        norms.detach(model, engine)


def test_engine_says_where_it_fuses_rope():
    from quantmla.serving.engine import Engine, EngineConfig

    model = tiny_model("deepseek_v2")
    with Engine(model, EngineConfig(num_pages=8, page_size=16, backend="triton")) as eng:
        assert eng.rope == "fused"
    with Engine(model, EngineConfig(num_pages=8, page_size=16, backend="torch")) as eng:
        assert eng.rope == "not on a CUDA device"
    with Engine(model, EngineConfig(num_pages=8, page_size=16, backend="triton", fused_rope=False)) as eng:
        assert eng.rope.startswith("off")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "minicpm3"])
def test_engine_on_gpu_fuses_rope_and_matches_generate(family):
    """On CUDA the kernel passes the probe in bf16 and fp32 for each convention ("pairs", "interleave", "half"), and
    greedy outputs with it still equal generate()'s (fp32), graph steps included."""
    from quantmla.serving.engine import BF16_CONFIG, Engine, EngineConfig
    from quantmla_lab.bench.serving.agreement import engine_agreement

    dense = {} if family == "minicpm3" else {"first_k_dense_replace": 2}  # dense MLPs: capturable, no routing flips
    for dtype in (torch.bfloat16, torch.float32):
        model = tiny_model(family, dtype=dtype, **dense).cuda()
        with Engine(model, EngineConfig(quant=BF16_CONFIG, num_pages=8, page_size=16)) as eng:
            assert eng.rope == "fused", (dtype, eng.rope)
            assert set(eng.latent_norms) == set(mla_modules(model))  # each latent norm in the RoPE launch
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 40, 1)]
    rep, st = engine_agreement(model, BF16_CONFIG, prompts, 16, tie_tol=2e-2, num_pages=24, graph_buckets=(1, 2, 4))
    assert st["graph_steps"] > 0 and rep.ok, rep.details


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_latent_norm_in_the_rope_launch_on_gpu_is_both_kernels_bit_for_bit(dtype):
    """On CUDA too (its reductions laid out by the compiler, a [1, d_c] block against rms_norm's [d_c]), the three
    outputs equal rms_norm's and rope_rotate's exactly, the latent a strided slice of a [N, 576] projection."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for mode in ("pairs", "half", "interleave"):
        for n in (1, 7, 300):
            ckv = (torch.randn(n, 576, generator=g, device="cuda") * 3).to(dtype)
            q = (torch.randn(n, 16, 192, generator=g, device="cuda") * 3).to(dtype)[..., 128:]
            w = (1 + 0.1 * torch.randn(512, generator=g, device="cuda")).to(dtype)
            width = 32 if mode == "pairs" else 64
            cos, sin = (torch.randn(n, width, generator=g, device="cuda") for _ in range(2))
            if mode != "pairs":
                cos, sin = cos.to(dtype), sin.to(dtype)
            got = norm_and_rotate(ckv[:, :512], w, 1e-6, q, ckv[:, 512:], cos, sin, mode)
            want = (rms_norm(ckv[:, :512], w, 1e-6), *rope_rotate(q, ckv[:, 512:], cos, sin, mode))
            for a, b in zip(got, want):
                assert torch.equal(a, b), (mode, n)
