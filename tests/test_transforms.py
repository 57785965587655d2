"""Fusible transforms: exact function preservation on every family, RoPE commutation, Hadamard."""

import dataclasses
from unittest import mock

import pytest
import torch

from quantmla.errors import QuantMLAError
from quantmla.model.capture import capture_attention_inputs
from quantmla.model.spec import load_spec, mla_modules
from quantmla.model.tiny import FAMILIES, tiny_model
from quantmla.model.view import MLAView
from quantmla.transforms import (
    ContentTransform, LayerTransform, LearnedRotation, RopeTransform, apply_pairs, fuse_transforms, hadamard,
    pair_channels, random_orthogonal, random_transforms,
)


def _ids(b=2, t=24, seed=0):
    return torch.randint(3, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _parts(model, spec, ids):
    with torch.no_grad(), capture_attention_inputs(model) as rec:
        model(ids)
    out = {}
    for slot, mod in mla_modules(model).items():
        r = rec[slot][0]
        with torch.no_grad():
            out[slot] = MLAView(mod, spec).parts(r["hidden"], r["position_embeddings"])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_random_transforms_reproduce_logits(family):
    model = tiny_model(family)
    spec = load_spec(model)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    before = _parts(model, spec, ids)
    gammas = {s: m.kv_a_layernorm.weight.detach().double().clone() for s, m in mla_modules(model).items()}
    ts = random_transforms(model, torch.Generator().manual_seed(7))
    # the transforms are far from the identity: random rotation, rescales in e^{±1}, phases all around
    for lt in ts.values():
        assert (lt.rope.phase.abs() > 0.5).any() and (lt.rope.scale.log().abs() > 0.5).any()
        assert (lt.content.rotation - torch.eye(spec.d_c, dtype=torch.float64)).abs().max() > 0.1
    fuse_transforms(model, ts)
    with torch.no_grad():
        got = model(ids).logits
    assert _rel(got, ref) <= 1e-5
    # ...while what the cache stores really changed: c' = c·T and k'_R = z ⊙ k_R (cache pair layout)
    after = _parts(model, spec, ids)
    for slot, lt in ts.items():
        t = lt.content.matrix(gammas[slot]).float()
        torch.testing.assert_close(after[slot]["latent"], before[slot]["latent"] @ t, rtol=1e-4, atol=1e-4)
        assert _rel(after[slot]["latent"], before[slot]["latent"]) > 0.1
        kz = apply_pairs(before[slot]["k_rope"].double(), lt.rope.z, spec.rope_cache_layout).float()
        torch.testing.assert_close(after[slot]["k_rope"], kz, rtol=1e-4, atol=1e-4)
        assert _rel(after[slot]["k_rope"], before[slot]["k_rope"]) > 0.1


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "minicpm3"])
def test_each_path_alone_is_exact_and_bias_is_transformed(family):
    # attention_bias=True gives kv_a_proj_with_mqa a bias, which both transforms must move too
    model = tiny_model(family, attention_bias=True)
    mod = next(iter(mla_modules(model).values()))
    assert mod.kv_a_proj_with_mqa.bias is not None
    with torch.no_grad():
        mod.kv_a_proj_with_mqa.bias.normal_()
    ids = _ids(seed=3)
    with torch.no_grad():
        ref = model(ids).logits
    g = torch.Generator().manual_seed(2)
    for content, rope in ((True, False), (False, True)):
        fuse_transforms(model, random_transforms(model, g, content=content, rope=rope))
        with torch.no_grad():
            assert _rel(model(ids).logits, ref) <= 1e-5


@pytest.mark.parametrize("family, interleaved", [("minicpm3", False), ("deepseek_v3", True)])
def test_rope_layout_follows_what_the_family_rotates(family, interleaved):
    """A config with rope_interleave=True: deepseek_v3's attention rotates interleaved pairs, minicpm3's rotates halves
    whatever its config says (read from the config, its spec said interleaved and a RoPE fusion moved logits by
    7.6 %); either way the fused model keeps its logits."""
    model = tiny_model(family, rope_interleave=True)
    assert (load_spec(model).rope_weight_layout == "interleaved") == interleaved
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    fuse_transforms(model, random_transforms(model, torch.Generator().manual_seed(2), content=False))
    with torch.no_grad():
        assert _rel(model(ids).logits, ref) <= 1e-5


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "longcat_flash"])
def test_wrong_pair_layout_breaks_equivalence(family):
    """The check has teeth: fusing the RoPE transform in the other pair layout changes the logits."""
    model = tiny_model(family)
    spec = load_spec(model)
    assert spec.rope_weight_layout == "interleaved"
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    wrong = dataclasses.replace(spec, rope_weight_layout="rotate_half")
    fuse_transforms(model, random_transforms(model, torch.Generator().manual_seed(1), content=False), spec=wrong)
    with torch.no_grad():
        assert _rel(model(ids).logits, ref) > 1e-3


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "deepseek_v3_rotate_half", "kimi_linear"])
def test_rope_transform_commutes_with_rope_at_all_positions(family):
    """RoPE_t(k·M) = z ⊙ RoPE_t(k) for every position t the model supports, and the logits
    q'·k' = q·k for every (query, key) position pair."""
    model = tiny_model(family)
    spec = load_spec(model)
    L = model.config.max_position_embeddings
    ids = torch.randint(3, 128, (1, L), generator=torch.Generator().manual_seed(0))
    mod_slot = spec.mla_layers[0]
    with torch.no_grad(), capture_attention_inputs(model, layers=[mod_slot]) as rec:
        model(ids)
    pe = rec[mod_slot][0]["position_embeddings"]
    view = MLAView(mla_modules(model)[mod_slot], spec)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, L, spec.d_r, generator=g)
    q = torch.randn(1, 2, L, spec.d_r, generator=g)
    rt = RopeTransform.from_polar(torch.rand(spec.num_pairs, generator=g) * 3 + 0.2,
                                  (torch.rand(spec.num_pairs, generator=g) * 2 - 1) * torch.pi)
    m = rt.key_matrix(spec.d_r, spec.rope_weight_layout).float()
    m_q = rt.query_matrix(spec.d_r, spec.rope_weight_layout).float()
    with torch.no_grad():
        q_rot, k_rot = view.rotate(q, k, pe)
        q_rot2, k_rot2 = view.rotate(q @ m_q, k @ m, pe)
    expect = apply_pairs(k_rot.double(), rt.z, spec.rope_cache_layout).float()
    torch.testing.assert_close(k_rot2, expect, rtol=1e-4, atol=1e-4)
    logits = torch.einsum("bhtd,bud->bhtu", q_rot.double(), k_rot.double())
    logits2 = torch.einsum("bhtd,bud->bhtu", q_rot2.double(), k_rot2.double())
    assert _rel(logits2, logits) < 1e-5


def test_pair_scalar_matrices_are_inverse_transposes():
    rt = RopeTransform(torch.tensor([2 + 1j, -0.5 + 0.25j, 1j], dtype=torch.complex128))
    for layout in ("rotate_half", "interleaved", "none"):
        m, mq = rt.key_matrix(6, layout), rt.query_matrix(6, layout)
        torch.testing.assert_close(mq, torch.linalg.inv(m).T)
        x = torch.randn(4, 6, dtype=torch.float64)
        torch.testing.assert_close(x @ m, apply_pairs(x, rt.z, layout))
    ra, im = pair_channels(6, "interleaved")
    assert ra.tolist() == [0, 2, 4] and im.tolist() == [1, 3, 5]
    with pytest.raises(QuantMLAError):
        rt.key_matrix(8, "rotate_half")
    with pytest.raises(QuantMLAError):
        RopeTransform(torch.tensor([1.0, 0.0], dtype=torch.complex128))


@pytest.mark.parametrize("d,block", [(1, None), (2, None), (64, None), (128, None), (96, None), (256, 32), (384, None)])
def test_hadamard_is_orthogonal(d, block):
    h = hadamard(d, block)
    torch.testing.assert_close(h @ h.T, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-12)
    b = block or (d & -d)
    nz = h[h != 0].abs()
    torch.testing.assert_close(nz, torch.full_like(nz, b**-0.5))
    assert int((h != 0).sum()) == d * b  # block-diagonal with b×b blocks
    if b == d and d > 1:  # a full Hadamard mixes every channel into every other
        assert (h != 0).all()


def test_hadamard_rejects_impossible_sizes():
    with pytest.raises(QuantMLAError):
        hadamard(12, block=8)
    with pytest.raises(QuantMLAError):
        hadamard(6, block=3)
    with pytest.raises(QuantMLAError):
        hadamard(7)


def test_learned_rotation_and_content_transform_checks():
    g = torch.Generator().manual_seed(0)
    rot = LearnedRotation(hadamard(16).float())
    torch.testing.assert_close(rot(), hadamard(16).float())
    with torch.no_grad():
        rot.generator.copy_(torch.randn(16, 16, generator=g))
    q = rot().double()
    torch.testing.assert_close(q.T @ q, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-5)
    gamma = torch.rand(16, generator=g, dtype=torch.float64) + 0.5
    ct = ContentTransform(random_orthogonal(16, g), torch.rand(16, generator=g, dtype=torch.float64) + 0.1)
    torch.testing.assert_close(ct.matrix(gamma) @ ct.inverse(gamma), torch.eye(16, dtype=torch.float64))
    had = ContentTransform.hadamard_point(gamma)
    assert torch.allclose(had.gamma, had.gamma[0].expand(16)) and abs(float(had.gamma[0]) - float(gamma.pow(2).mean().sqrt())) < 1e-12
    with pytest.raises(QuantMLAError):
        ContentTransform(torch.randn(16, 16, generator=g, dtype=torch.float64), gamma)  # not orthogonal
    with pytest.raises(QuantMLAError, match="NaN or Inf"):  # NaN passed |QᵀQ − I| > tol: NaN compares false
        ContentTransform(torch.full((16, 16), float("nan"), dtype=torch.float64), gamma)
    with pytest.raises(QuantMLAError):
        ContentTransform(torch.eye(16, dtype=torch.float64), torch.zeros(16, dtype=torch.float64))
    model = tiny_model("minicpm3")
    with pytest.raises(QuantMLAError):
        fuse_transforms(model, {99: LayerTransform()})


def test_block_fp8_weights_are_refused_before_any_fusion_or_capture():
    """A layer whose kv_b_proj is transformers' block-FP8 FP8Linear (e4m3 weights under per-block scales, as official
    DeepSeek-V3 checkpoints load on an FP8 GPU): fusing into it rewrote the codes under their old scales (28 to 56 %
    off); fuse_transforms and calibrate refuse it, naming the way out, before any weight changes or any capture."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from quantmla.cache.config import QuantCacheConfig
    from quantmla.calibration import calibrate

    model = tiny_model("deepseek_v3")
    mods = mla_modules(model)
    kvb = mods[0].kv_b_proj
    fp8 = FP8Linear(kvb.in_features, kvb.out_features, block_size=(16, 16))
    fp8.weight.data.copy_(kvb.weight.data.to(fp8.weight.dtype))
    mods[0].kv_b_proj = fp8
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(QuantMLAError, match="MLA layer 0: kv_b_proj holds torch.float8_e4m3fn weights with per-block "
                                            "scales.*FineGrainedFP8Config\\(dequantize=True\\)"):
        fuse_transforms(model, random_transforms(model))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # not even layer 1 was fused
    ids = torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    with mock.patch("quantmla.calibration.api.capture_calibration_data") as capture:
        with pytest.raises(QuantMLAError, match="kv_b_proj holds torch.float8_e4m3fn"):
            calibrate(model, ids, QuantCacheConfig.of_bits(4, 4, 32, 16), progress=False)
        capture.assert_not_called()
