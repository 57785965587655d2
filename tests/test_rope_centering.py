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
from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.scheduler import SamplingParams
from quantmla_lab.bench.serving.agreement import compare


def _offsets(spec, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {s: tuple((scale * torch.randn(spec.d_r, generator=g)).tolist()) for s in spec.mla_layers}


def _with_rope(family):
    """(tiny model, spec) of a family; skips a family without a RoPE key."""
    model = tiny_model(family)
    spec = load_spec(model)
    if spec.d_r == 0:
        pytest.skip("no RoPE key")
    return model, spec


@pytest.mark.parametrize("family", FAMILIES)
def test_offsets_leave_attention_unchanged(family):
    """16-bit cache with large random offsets: logits equal DynamicCache's to fp32 rounding, for every family."""
    model, spec = _with_rope(family)
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
    assert stored.rope_offsets and set(stored.rope_offsets) <= set(spec.mla_layers)  # something to round-trip
    save_quantized(model, None, tmp_path / "q")
    loaded, _, q_loaded = load_quantized(tmp_path / "q")
    assert q_loaded == stored and QuantCacheConfig.from_model_config(loaded.config) == stored
    # asking for the same formats explicitly keeps the checkpoint's offsets
    assert load_quantized(tmp_path / "q", QuantCacheConfig.of_bits(4, 4, 32, 16))[2].rope_offsets == stored.rope_offsets
    assert [l.rope_offset is not None for l in QuantMLACache(loaded).mla_layers()] == \
        [stored.rope_offsets.get(s) is not None for s in spec.mla_layers]


def test_centring_lowers_the_rope_objective_and_is_the_context_mean_key():
    """On the shipped deepseek-v3-like reference: the held-out RoPE objective never ends above plain
    RTN's, and the slots with large common RoPE-key components get an offset."""
    from quantmla.corpus.datasets import DEFAULT_MODEL, model_path
    from quantmla.evaluation.harness import load_eval_data
    from quantmla.model.load import load_model

    path = model_path(DEFAULT_MODEL)
    if not path.exists():
        pytest.skip("reference model not shipped")
    model, tok = load_model(str(path), dtype=torch.float32)
    ev = load_eval_data(tok, seq_len=256, ppl_chunks=0, retrieval_n=0, lengths=(), calib_n=8)
    quant = QuantCacheConfig.of_bits(16, 4, 64, 32)
    rep = calibrate(model, ev.calib_ids, quant, paths=("rope",), steps=20, progress=False, verbose=False)
    stored = QuantCacheConfig.from_model_config(model.config)
    assert set(stored.rope_offsets) == {l.slot for l in rep.layers} and stored.centred
    for l in rep.layers:  # never worse than RTN on held-out keys; a non-zero offset exactly where centring was chosen
        assert l.rope["after"] <= l.rope["before"], l.rope
        assert (stored.rope_offsets.get(l.slot) is not None) == l.rope["chosen"].endswith("+centred") == (l.rope_offset is not None)
    # the layers whose RoPE keys the error model flags (1 and 2: large low-frequency means) are centred
    assert {1, 2} <= {s for s, c in stored.rope_offsets.items() if c is not None}
    # the helper itself, on keys that are a constant pre-rotation vector m turned by the family's RoPE:
    # the de-rotated mean is m, and the offset is m averaged over the context's rotations
    from quantmla.calibration.capture import capture_calibration_data
    from quantmla.transforms.rope import pair_channels

    d = capture_calibration_data(model, load_spec(model), ev.calib_ids[:3], progress=False)[0]
    L, d_r = d.k_rope.shape[1], d.k_rope.shape[2]
    ra, im = pair_channels(d_r, d.rope_layout)
    m = torch.complex(torch.randn(d_r // 2, dtype=torch.float64), torch.randn(d_r // 2, dtype=torch.float64))
    z = d.rope_phase[:L] * m  # [L, P]
    k = torch.zeros(L, d_r, dtype=torch.float64)
    k[:, ra], k[:, im] = z.real, z.imag
    d.k_rope = k.float().expand(3, L, d_r).clone()
    fit = torch.tensor([0, 2])
    for context in (L, 8 * L):
        dc, c = centre_rope_keys(d, fit, context=context)
        theta = torch.angle(d.rope_phase[1])
        avg = torch.stack([torch.polar(torch.ones_like(theta), s * theta) for s in map(float, range(context))]).mean(0)
        want = m * avg
        torch.testing.assert_close(torch.complex(c[ra].double(), c[im].double()), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dc.keys, d.keys - c)
    # the high-frequency pairs turn many times over a long context: their offset vanishes; the slowest keeps most of m
    assert abs(want[0]) < 0.05 * abs(m[0]) and abs(want[-1]) > 0.5 * abs(m[-1])
    # a context of 0 (calibrate's rope_center_context=0), or no RoPE phase: the plain mean of the fit keys
    plain = d.k_rope[fit].reshape(-1, d_r).mean(0)
    torch.testing.assert_close(centre_rope_keys(d, fit, context=0)[1], plain, rtol=1e-5, atol=1e-6)
    d.rope_phase = None
    _, c = centre_rope_keys(d, fit)
    torch.testing.assert_close(c, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_phase_is_the_familys_rotation(family):
    """The captured phase turns each cache pair by position × the model's inverse frequency."""
    from quantmla.calibration.capture import capture_calibration_data

    model, spec = _with_rope(family)
    d = next(iter(capture_calibration_data(model, spec, torch.randint(3, 100, (2, 9)), progress=False).values()))
    assert d.rope_phase.shape == (9, spec.d_r // 2) and d.max_positions == model.config.max_position_embeddings
    torch.testing.assert_close(d.rope_phase.abs(), torch.ones(9, spec.d_r // 2, dtype=torch.float64))
    inv = next((b for n, b in model.named_buffers() if n.endswith("inv_freq")), None)
    if spec.rope_weight_layout == "none":  # NoPE layers
        assert torch.equal(d.rope_phase, torch.ones_like(d.rope_phase))
        return
    pos = torch.arange(9, dtype=torch.float64)[:, None]
    torch.testing.assert_close(d.rope_phase, torch.polar(torch.ones(9, spec.d_r // 2, dtype=torch.float64),
                                                           pos * inv.double()[None]), rtol=1e-5, atol=1e-5)


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


def test_spreading_keys_over_the_context_keeps_every_logit():
    """Keys moved to random context positions, with their quadratic forms: the logit energy kᵀAk of
    every kept key and the error of any key perturbation are unchanged, the keys themselves are not."""
    from quantmla.calibration.api import spread_key_positions
    from quantmla.calibration.capture import capture_calibration_data
    from quantmla.transforms.rope import pair_channels

    model = tiny_model("deepseek_v3")
    spec = load_spec(model)
    d = next(iter(capture_calibration_data(model, spec, torch.randint(3, 100, (3, 16)), progress=False).values()))
    s = spread_key_positions(d, torch.Generator().manual_seed(0), context=4096, fraction=1.0)
    assert s.keys.shape == d.keys.shape and not torch.allclose(s.keys, d.keys)
    for w in d.A:
        e0 = torch.einsum("kd,kde,ke->k", d.keys.double(), d.A[w].double(), d.keys.double())
        e1 = torch.einsum("kd,kde,ke->k", s.keys.double(), s.A[w].double(), s.keys.double())
        torch.testing.assert_close(e1, e0, rtol=1e-4, atol=1e-6)
    ra, im = pair_channels(spec.d_r, d.rope_layout)
    torch.testing.assert_close(s.keys[:, ra] ** 2 + s.keys[:, im] ** 2, d.keys[:, ra] ** 2 + d.keys[:, im] ** 2,
                               rtol=1e-4, atol=1e-5)  # each pair only turns
    assert spread_key_positions(d, torch.Generator(), context=16) is d  # no longer context than the rows
    half = spread_key_positions(d, torch.Generator().manual_seed(0), context=4096, fraction=0.5)
    moved = (half.keys - d.keys).abs().amax(-1) > 1e-6
    assert 0 < int(moved.sum()) < d.keys.shape[0]  # some keys stay at their own positions
    with pytest.raises(QuantMLAError, match="rope_spread"):
        calibrate(model, torch.randint(3, 100, (3, 16)), QuantCacheConfig.of_bits(4, 4, 32, 16), rope_spread=1.5,
                  progress=False)


def test_sweep_scores_a_calibrated_variant_with_its_own_offsets(monkeypatch, tmp_path):
    """calibration.sweep must read the cache through the calibrated config (RoPE offsets included)."""
    from quantmla.corpus.datasets import DEFAULT_MODEL, model_path
    from quantmla_lab.bench.calibration import variants as sweep

    path = model_path(DEFAULT_MODEL)
    if not path.exists():
        pytest.skip("reference model not shipped")
    seen = []
    monkeypatch.setattr(sweep, "_bpb", lambda m, tok, chunks, L, quant, bs: seen.append(quant) or 1.0)
    sweep.main([str(path), "--chunks", "1", "--calib-n", "4", "--steps", "2", "--only", "INT4/INT4 quantmla",
                "--out", str(tmp_path / "s.json")])
    assert len(seen) == 2  # BF16, then the calibrated variant
    assert seen[1].rope_offsets, "the calibrated variant was scored without its RoPE offsets"


@pytest.mark.parametrize("options", [{"rope_center": False}, {"method": "rtn"}, {"method": "hadamard"},
                                     {"paths": ("content",)}])
def test_calibration_without_offsets_is_marked(options, tmp_path):
    """A calibration that does not centre the RoPE keys says so in its quantization_config
    ("rope_centring": false, no rope_offsets), so a loader can tell it from offsets that went missing;
    a centring one carries an offset for every slot (zeros where centring did not help)."""
    from quantmla.model.tiny import tiny_model

    ids = torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(0))
    quant = QuantCacheConfig.of_bits(4, 4, 32, 16)
    model = tiny_model("deepseek_v3")
    calibrate(model, ids, quant, steps=2, rope_searches=("closed",), progress=False, verbose=False, **options)
    d = model.config.quantization_config
    assert d["rope_centring"] is False and "rope_offsets" not in d
    save_quantized(model, None, tmp_path / "q")
    assert load_quantized(tmp_path / "q")[2].centred is False
    centred = tiny_model("deepseek_v3")
    calibrate(centred, ids, quant, steps=2, rope_searches=("closed",), progress=False, verbose=False)
    d = centred.config.quantization_config
    assert "rope_centring" not in d and sorted(map(int, d["rope_offsets"])) == list(load_spec(centred).mla_layers)
