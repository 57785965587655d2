"""RoPE key centring: a per-slot offset subtracted from every cached RoPE key.

Softmax ignores a constant key offset (each query's logits all move by q_R·c), so attention is
unchanged exactly; calibration picks c = the mean calibration key, which shrinks the per-token
quantization range of the RoPE path.
"""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.hf_cache import QuantMLACache
from quantmla.calibration.api import calibrate, centre_rope_keys
from quantmla.calibration.checkpoint import load_quantized, save_quantized
from quantmla.errors import QuantMLAError
from quantmla.model.spec import load_spec
from quantmla.model.tiny import FAMILIES, tiny_model
from quantmla.serving.check import compare
from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.scheduler import SamplingParams
from quantmla.transforms.rope import apply_pairs


def _offsets(spec, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {s: tuple((scale * torch.randn(spec.d_r, generator=g)).tolist()) for s in spec.mla_layers}


@pytest.mark.parametrize("family", FAMILIES)
def test_offsets_leave_attention_unchanged(family):
    """16-bit cache with large random offsets: logits equal DynamicCache's to fp32 rounding, for every family."""
    model = tiny_model(family)
    spec = load_spec(model)
    if spec.d_r == 0:
        pytest.skip("no RoPE key")
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    q = dataclasses.replace(QuantCacheConfig.of_bits(16, 16), rope_offsets=_offsets(spec))
    with torch.no_grad():
        ref_c, c = DynamicCache(config=model.config), QuantMLACache(model, q)
        a = model(ids, past_key_values=ref_c, use_cache=True).logits
        b = model(ids, past_key_values=c, use_cache=True).logits
        nxt = a[:, -1:].argmax(-1)
        a2 = model(nxt, past_key_values=ref_c, use_cache=True).logits
        b2 = model(nxt, past_key_values=c, use_cache=True).logits
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b2, a2, rtol=1e-4, atol=1e-4)
    # the offset is really applied: the stored keys are shifted
    lay = c.mla_layers()[0]
    assert lay.rope_offset is not None and not torch.allclose(lay.rope.read(torch.float32), ref_c.layers[spec.mla_layers[0]].values[:, 0])


def test_offsets_round_trip_and_clear_errors(tmp_path):
    model = tiny_model("deepseek_v3")
    spec = load_spec(model)
    q = dataclasses.replace(QuantCacheConfig.of_bits(4, 4, 32, 16), rope_offsets=_offsets(spec))
    back = QuantCacheConfig.from_dict(q.to_dict())
    assert back == q and "centred" in back.describe()
    assert "rope_offsets" not in QuantCacheConfig.of_bits(4, 4).to_dict()  # plain configs unchanged on disk
    bad = dataclasses.replace(q, rope_offsets={spec.mla_layers[0]: (1.0, 2.0)})
    with pytest.raises(QuantMLAError, match="rope_offsets of cache slot"):
        QuantMLACache(model, bad)
    # calibrated checkpoint: offsets survive save / load and set up the cache
    ids = torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(0))
    calibrate(model, ids, QuantCacheConfig.of_bits(4, 4, 32, 16), steps=3, progress=False, verbose=False)
    stored = QuantCacheConfig.from_model_config(model.config)
    assert set(stored.rope_offsets) <= set(spec.mla_layers)
    save_quantized(model, None, tmp_path / "q")
    loaded, _, q_loaded = load_quantized(tmp_path / "q")
    assert q_loaded == stored and QuantCacheConfig.from_model_config(loaded.config) == stored
    # asking for the same formats explicitly keeps the checkpoint's offsets
    assert load_quantized(tmp_path / "q", QuantCacheConfig.of_bits(4, 4, 32, 16))[2].rope_offsets == stored.rope_offsets
    assert [l.rope_offset is not None for l in QuantMLACache(loaded).mla_layers()] == \
        [s in stored.rope_offsets for s in spec.mla_layers]


def test_centring_is_the_transformed_mean_key_and_lowers_the_rope_objective():
    """On the shipped deepseek-v3-like reference: every slot gets an offset equal to its fit keys' mean
    (times the fitted pair scalars) and the held-out RoPE objective ends below plain RTN's."""
    from quantmla.evaluation.datasets import DEFAULT_MODEL, model_path
    from quantmla.evaluation.harness import load_eval_data, load_model

    path = model_path(DEFAULT_MODEL)
    if not path.exists():
        pytest.skip("reference model not shipped")
    model, tok = load_model(str(path), dtype=torch.float32)
    ev = load_eval_data(tok, seq_len=256, ppl_chunks=0, retrieval_n=0, lengths=(), calib_n=8)
    quant = QuantCacheConfig.of_bits(16, 4, 64, 32)
    rep = calibrate(model, ev.calib_ids, quant, paths=("rope",), steps=20, progress=False, verbose=False)
    stored = QuantCacheConfig.from_model_config(model.config)
    assert len(stored.rope_offsets) == len(rep.layers)
    for l in rep.layers:
        assert l.rope["after"] < l.rope["before"], l.rope
        assert l.rope["chosen"].endswith("+centred") and l.rope_offset is not None
    # the helper itself: mean over the fit sequences only, keys and sampled keys both shifted
    from quantmla.calibration.capture import capture_calibration_data

    d = capture_calibration_data(model, load_spec(model), ev.calib_ids[:3], progress=False)[0]
    fit = torch.tensor([0, 2])
    dc, mu = centre_rope_keys(d, fit)
    torch.testing.assert_close(mu, d.k_rope[fit].reshape(-1, d.k_rope.shape[-1]).mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dc.keys, d.keys - mu)
    assert dc.k_rope[fit].reshape(-1, d.k_rope.shape[-1]).mean(0).abs().max() < 1e-4
    z = torch.polar(torch.rand(d.k_rope.shape[-1] // 2, dtype=torch.float64) + 0.5,
                    torch.rand(d.k_rope.shape[-1] // 2, dtype=torch.float64))
    # an offset in cache channels is the transformed mean: mean(z·k) = z·mean(k)
    torch.testing.assert_close(apply_pairs(d.k_rope.double(), z, d.rope_layout).reshape(-1, d.k_rope.shape[-1]).mean(0),
                               apply_pairs(d.k_rope.double().reshape(-1, d.k_rope.shape[-1]).mean(0)[None], z,
                                           d.rope_layout)[0])


def test_engine_applies_the_offsets_like_the_transformers_cache():
    """Paged engine vs generate() with QuantMLACache, both centred: token for token (fp32, torch backend)."""
    model = tiny_model("deepseek_v3")
    spec = load_spec(model)
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 19, 33)]
    for base in (QuantCacheConfig.of_bits(16, 16), QuantCacheConfig.of_bits(4, 4, 32, 16)):
        quant = dataclasses.replace(base, rope_offsets=_offsets(spec, scale=1.0))
        eng = Engine(model, EngineConfig(quant=quant, num_pages=48, page_size=16, max_num_batched_tokens=24,
                                         backend="torch", keep_logits=True))
        assert set(eng.rope_offsets) == set(spec.mla_layers)
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
        eng.close()
        rep = compare(model, quant, prompts, [o.output_ids for o in outs], 8, tie_tol=1e-4)
        assert rep.exact == len(prompts), rep.details
