"""Per-page per-channel RoPE codes (cache.rope_channel): round trip, bytes, folding the scale into the query."""

import itertools

import pytest
import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.kivi import KIVIFormat, KIVILayout
from quantmla.cache.layout import CacheFormat, TokenLayout
from quantmla.cache.rope_channel import (
    RopeChannelCache,
    RopeChannelFormat,
    RopeChannelLayer,
    RopeChannelLayout,
    quantize_pages,
    rope_scores_from_codes,
)
from quantmla.errors import QuantMLAError, UnsupportedFormatError
from quantmla.evaluation.harness import (
    CALIBRATED,
    ROPE_CHANNEL,
    EvalData,
    RowSpec,
    calibration_key,
    evaluate_row,
    named_config,
)
from quantmla.model.tiny import tiny_model
from quantmla.quant import PathFormat, quantize_dequantize, unpack
from quantmla.quant.groupwise import quantize


def _keys(T=150, d_r=16, seed=0):
    """RoPE-like keys: a few channels with large, slowly varying values (a low-frequency pair)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, d_r, generator=g, dtype=torch.float64)
    t = torch.arange(T, dtype=torch.float64)
    k[:, 0] = 30 * torch.cos(0.01 * t) + 0.3 * k[:, 0]
    k[:, 8] = 30 * torch.sin(0.01 * t) + 0.3 * k[:, 8]
    return k


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_round_trip_error_within_half_a_channel_step(bits):
    """Against fp64: each value is within half its own channel's step of its page (plus the fp16
    rounding of the stored scale and zero), however large the other channels are."""
    P = 32
    fmt = RopeChannelFormat(bits, P)
    k = _keys()
    got = quantize_pages(k.float(), fmt).double()
    T = k.shape[0]
    for p0 in range(0, T, P):
        page = k[p0 : p0 + P]
        lo, hi = page.amin(0), page.amax(0)
        step = (hi - lo) / (2**bits - 1)
        bound = 0.5 * step * (1 + 2**-5) + 2**-10 * torch.maximum(lo.abs(), hi.abs()) + 1e-6
        assert ((got[p0 : p0 + P] - page).abs() <= bound).all()
    # per-token groups put the large channels' range on every channel: far outside that bound
    tok = quantize_dequantize(k.float(), PathFormat(bits, 16)).double()
    assert ((tok - k).abs()[:, 1:8] > 0.5 * (k[:, 1:8].amax(0) - k[:, 1:8].amin(0)) / (2**bits - 1) + 0.05).any()


def test_cache_layer_stores_centred_keys_per_page_any_chunking():
    """The layer subtracts the slot's offset, then quantizes per channel per page from token 0; the
    unfinished page is quantized over the tokens it holds. Equal to quantize_pages for any chunking."""
    d_c, d_r, P = 32, 16, 8
    fmt = RopeChannelFormat(4, P)
    offset = torch.linspace(-3, 3, d_r)
    k = _keys(37, d_r).float()
    lat = torch.randn(1, 1, 37, d_c)
    want = quantize_pages(k - offset, fmt)
    for cuts in ((0, 37), (0, 5, 6, 19, 37), (0, 16, 17, 18, 37)):
        layer = RopeChannelLayer(PathFormat(4, 16), fmt, d_c, d_r, rope_offset=offset)
        for a, b in itertools.pairwise(cuts):
            _, r = layer.update(lat[:, :, a:b], k[None, None, a:b])
        assert r.shape == (1, 1, 37, d_r)
        torch.testing.assert_close(r[0, 0], want, rtol=0, atol=0)
    # with a full-precision window the newest tokens are read as they are (centred), the rest as before
    layer = RopeChannelLayer(PathFormat(4, 16), fmt, d_c, d_r, fp_window=5, rope_offset=offset)
    _, r = layer.update(lat, k[None, None])
    torch.testing.assert_close(r[0, 0, :32], quantize_pages(k[:32] - offset, fmt), rtol=0, atol=0)
    torch.testing.assert_close(r[0, 0, 32:], k[32:] - offset, rtol=0, atol=0)


def test_bytes_per_token():
    d_c, d_r = 128, 32
    content = PathFormat(4, 64)
    lay = RopeChannelLayout(d_c, d_r, content, RopeChannelFormat(4, 64))
    # content 64 codes + 2 groups x (scale, zero) x 2 B; RoPE 16 codes + 32 channels x 2 fields x 2 B / 64 tokens
    assert lay.bytes_per_token == (64 + 8) + (16 + 2)
    assert lay.field_bytes["rope_meta"] == 2
    # fewer bytes than per-token RoPE groups of 32 and KIVI-style blocks of 32 tokens (both 92), equal to KIVI at 64
    assert lay.bytes_per_token < TokenLayout(d_c, d_r, CacheFormat(content, PathFormat(4, 32))).bytes_per_token == 92
    assert lay.bytes_per_token < KIVILayout(d_c, d_r, KIVIFormat(content, 4, 32)).bytes_per_token == 92
    assert lay.bytes_per_token == KIVILayout(d_c, d_r, KIVIFormat(content, 4, 64)).bytes_per_token
    # symmetric codes: one field, 1 byte a token of metadata
    assert RopeChannelLayout(d_c, d_r, content, RopeChannelFormat(4, 64, "symmetric")).bytes_per_token == 72 + 16 + 1
    # an unfinished page costs its codes plus a whole page's metadata
    assert lay.bytes_per_token_at(100) == pytest.approx(72 + (100 * 16 + 2 * 128) / 100)
    assert lay.bytes_per_token_at(128) == lay.bytes_per_token
    assert lay.bytes_per_token_at(1) == 72 + 16 + 128
    # what the cache stores agrees with the layout, page boundaries and batches included
    model = tiny_model("deepseek_v3")
    fmt = RopeChannelFormat(4, 8)
    for n in (5, 8, 21):
        cache = RopeChannelCache(model, QuantCacheConfig.of_bits(4, 4, 16, 8), fmt)
        with torch.no_grad():
            model(torch.randint(3, 128, (2, n)), past_key_values=cache, use_cache=True)
        per_layer = RopeChannelLayout(cache.spec.d_c, cache.spec.d_r, PathFormat(4, 16), fmt)
        assert cache.nbytes() == pytest.approx(2 * n * per_layer.bytes_per_token_at(n) * len(cache.mla_layers()))
        assert cache.bytes_per_token() == per_layer.bytes_per_token * len(cache.mla_layers())
    with pytest.raises(UnsupportedFormatError):
        RopeChannelFormat(4, 48)  # pages of a power of two tokens
    with pytest.raises(UnsupportedFormatError):
        RopeChannelFormat(8, 64, "fp8")
    for bad in (lambda: RopeChannelFormat(16, 64), lambda: KIVIFormat(content, 16, 32)):  # nothing to quantize
        with pytest.raises(UnsupportedFormatError, match="stores them as"):
            bad()
    # fp32 metadata: the KIVI layout counts 4 bytes a field, as its store keeps them
    from quantmla.cache.kivi import _ChannelBlockStore

    f32 = KIVIFormat(PathFormat(4, 32), rope_bits=4, block=32, meta_dtype="float32")
    store = _ChannelBlockStore(f32, 16)
    store.append(torch.randn(1, 64, 16))
    stored = (store.codes.numel() * store.codes.element_size() + store.meta.numel() * store.meta.element_size()) / 64
    field = KIVILayout(32, 16, f32).field_bytes
    assert field["rope_codes"] + field["rope_meta"] == stored == 12


@pytest.mark.parametrize("P", [8, 16, 64])
def test_path_format_is_the_paged_cache_format_at_its_page(P):
    """Pages of P tokens here are blocks of P in the paged cache's 64-token page (the whole page at 64): the
    same format and the same bytes a token."""
    from quantmla.cache.layout import PageLayout

    fmt = RopeChannelFormat(4, P, "symmetric")
    assert fmt.path_format == PathFormat(4, 1, "symmetric", grouping="page", block=0 if P == 64 else P)
    lay = PageLayout(TokenLayout(128, 32, CacheFormat(PathFormat(4, 64), fmt.path_format)), 64)
    per_token = RopeChannelLayout(128, 32, PathFormat(4, 64), fmt).field_bytes
    assert per_token["rope_meta"] == lay.page_field_bytes["rope_page_meta"] / 64 == 32 * 2 / P
    assert fmt.bytes_per_token(32) == fmt.path_format.bytes_per_token(32, 64) == 16 + 64 / P


def _codes_and_meta(k: torch.Tensor, fmt: RopeChannelFormat):
    """Integer codes [T, d_r] and scale, zero [n_pages, d_r] of keys k [T, d_r] (T a multiple of the page)."""
    T, d_r = k.shape
    P = fmt.page_size
    pages = k.reshape(T // P, P, d_r).transpose(1, 2).contiguous()  # [n, d_r, P]
    q = quantize(pages, fmt.page_format)
    codes = unpack(q.codes, fmt.bits, P).transpose(1, 2).reshape(T, d_r)
    meta = q.meta.double()[..., 0, :]  # [n, d_r, fields]
    return codes, meta[..., 0], (meta[..., 1] if fmt.mode == "affine" else None)


@pytest.mark.parametrize("mode", ["affine", "symmetric"])
def test_scale_folded_into_the_query_equals_dequantized_keys(mode):
    """q·(s ⊙ codes) == (q ⊙ s)·codes bit for bit in fp64 (fp32 queries, fp16 scales, small integer
    codes: every product is exact), and the affine zero term adds q·z per page."""
    fmt = RopeChannelFormat(4, 16, mode)
    k = _keys(64, 16, seed=3).float()
    codes, scale, zero = _codes_and_meta(k, fmt)
    q = torch.randn(8, 16, generator=torch.Generator().manual_seed(4)).double()  # fp32 values in fp64
    q = q.float().double()
    page = torch.arange(64) // 16
    c = codes.double() - (2 ** (fmt.bits - 1) if mode == "symmetric" else 0)
    code_part = (q[:, None, :] * (scale[page] * c)[None]).sum(-1)  # q · (s ⊙ codes): the scale on the keys
    folded = rope_scores_from_codes(q, codes, scale, zero, fmt)  # (q ⊙ s) · codes (+ q · z): on the query
    # the dequantized keys the cache reads
    k_hat = quantize_pages(k, fmt).double()
    if mode == "symmetric":
        assert torch.equal(folded, code_part)
        assert torch.equal(k_hat, scale[page] * c)
    else:
        assert torch.equal(folded - (q @ zero.T)[:, page], code_part)
        torch.testing.assert_close(folded, q @ k_hat.T, rtol=1e-12, atol=1e-12)
    # a scale applied on the wrong page is caught
    wrong = rope_scores_from_codes(q, codes, scale.roll(1, 0), zero, fmt)
    assert not torch.allclose(wrong, q @ k_hat.T, rtol=1e-6, atol=1e-6)


def test_harness_rows_wire_the_cache_and_share_a_calibration():
    """quantmla-rope-channel reads QuantMLA's calibrated model (same calibration as the quantmla row)
    through a RopeChannelCache that carries the slot offsets; its bytes per token are the layout's."""
    model = tiny_model("deepseek_v3")
    data = EvalData(ppl=torch.randint(3, 128, (1, 16)), calib_ids=torch.randint(3, 128, (4, 16)), seq_len=16)
    calls, caches = [], []

    def calib_fn(m, ids, quant, *, method, paths, seed, rope_page=0):
        calls.append((method, tuple(paths), rope_page))
        from dataclasses import replace

        offs = {s: tuple(float(i) for i in range(m.config.qk_rope_head_dim)) for s in range(m.config.num_hidden_layers)}
        replace(quant, method=method, rope_offsets=offs if "rope" in paths else {}).attach(m)

    def ppl_fn(m, tok, chunks, *, seq_len, cache_factory):
        caches.append(cache_factory(m))
        return {"bits_per_byte": 1.0, "tokens": 15}

    cfg = named_config("INT4/INT4", 16, 8)
    prepared = {}
    rows = {}
    methods = ("quantmla", "quantmla-rope-channel", "quantmla-rope-channel-pagefit", "quantmla-content-rope-channel")
    for method in methods:
        rows[method] = evaluate_row(model, None, RowSpec(cfg, method, rope_page=16), data, ppl_fn=ppl_fn,
                                    retrieval_fn=lambda *a, **k: None, calibrate_fn=calib_fn, prepared=prepared)
    # quantmla-rope-channel reads the quantmla row's model; pagefit calibrates for its page; the ablation without RoPE
    assert calls == [("quantmla", ("content", "rope"), 0), ("quantmla", ("content", "rope"), 16),
                     ("quantmla", ("content",), 0)]
    assert prepared[calibration_key(RowSpec(cfg, "quantmla"))][0] is prepared[
        calibration_key(RowSpec(cfg, "quantmla-rope-channel"))][0]
    plain, chan, pagefit, content_only = caches
    assert type(plain) is not RopeChannelCache and isinstance(chan, RopeChannelCache)
    assert isinstance(content_only, RopeChannelCache) and isinstance(pagefit, RopeChannelCache)
    layer = chan.mla_layers()[0]
    assert isinstance(layer, RopeChannelLayer) and layer.rope_channel == RopeChannelFormat(4, 16)
    cache_dr = chan.spec.d_r
    assert torch.equal(layer.rope_offset, torch.arange(cache_dr, dtype=torch.float32))
    assert content_only.mla_layers()[0].rope_offset is None
    want = RopeChannelLayout(chan.spec.d_c, cache_dr, PathFormat(4, 16), RopeChannelFormat(4, 16))
    assert rows["quantmla-rope-channel"]["bytes_per_token"] == want.bytes_per_token
    assert rows["quantmla-rope-channel"]["bytes_per_token"] < rows["quantmla"]["bytes_per_token"]
    assert rows["quantmla-rope-channel"]["bytes_per_token_at"]["16"] == want.bytes_per_token_at(16)
    assert "ch·page16" in rows["quantmla-rope-channel"]["format"]
    assert set(ROPE_CHANNEL) <= set(CALIBRATED)
    with pytest.raises(QuantMLAError, match="integer RoPE"):
        RowSpec(named_config("INT4/BF16"), "quantmla-rope-channel")


def test_page_objective_matches_the_cache_round_trip():
    """RopePageQK's forward is the quadratic form of the errors quantize_pages gives the kept keys; it
    is blind to the pair scales (up to the fp16 metadata) but not to their phases."""
    from quantmla.calibration.objectives import RopePageQK, page_fake_quant

    fmt = RopeChannelFormat(4, 16)
    n, L, d_r = 3, 48, 16
    g = torch.Generator().manual_seed(5)
    k = torch.stack([_keys(L, d_r, seed=s).float() for s in range(n)])
    key_pos = torch.tensor([0, 3, 17, 40, 47])
    B = torch.randn(n * 5, d_r, d_r, generator=g)
    A = B @ B.transpose(1, 2)
    torch.testing.assert_close(page_fake_quant(k, fmt), quantize_pages(k, fmt), rtol=0, atol=0)
    obj = RopePageQK(k, key_pos, A, fmt, "rotate_half")
    e = (quantize_pages(k, fmt) - k)[:, key_pos].reshape(-1, d_r)
    keys = k[:, key_pos].reshape(-1, d_r)
    want = torch.einsum("kd,kde,ke->", e, A, e) / torch.einsum("kd,kde,ke->", keys, A, keys)
    torch.testing.assert_close(obj(), want)
    P = d_r // 2
    one = (torch.ones(P), torch.zeros(P))
    torch.testing.assert_close(obj(one), want)
    scaled = (torch.linspace(0.5, 4, P), torch.zeros(P))
    torch.testing.assert_close(obj(scaled), want, rtol=2e-2, atol=0)
    turned = (torch.cos(torch.full((P,), 0.7)), torch.sin(torch.full((P,), 0.7)))
    assert abs(float(obj(turned)) - float(want)) > 1e-3 * float(want)
    zr = torch.stack([one[0], scaled[0], turned[0]])
    zi = torch.stack([one[1], scaled[1], turned[1]])
    torch.testing.assert_close(obj.batch(zr, zi), torch.stack([obj(one), obj(scaled), obj(turned)]))


def test_calibration_fits_the_rope_path_for_pages():
    """calibrate(..., rope_page=P) fits, chooses and reports the RoPE path under per-page codes; the
    fused model keeps its function; bad pages are refused up front."""
    from quantmla.calibration import calibrate

    model = tiny_model("deepseek_v3")
    ids = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    ref = model(ids).logits
    quant = QuantCacheConfig.of_bits(4, 4, 16, 8)
    rep = calibrate(model, ids, quant, rope_page=8, steps=3, progress=False).to_dict()
    for layer in rep["layers"]:
        assert layer["joint"]["rope_page"] == 8
        assert layer["rope"]["after"] <= layer["rope"]["before"]
    torch.testing.assert_close(model(ids).logits, ref, rtol=1e-4, atol=1e-4)
    for bad in (12, -8):
        with pytest.raises(QuantMLAError, match="rope_page"):
            calibrate(tiny_model("deepseek_v3"), ids, quant, rope_page=bad, progress=False)


def test_cache_without_a_rope_format_keeps_each_layers_rope_settings():
    """RopeChannelCache(model, quant) with no `rope`: every layer's per-page codes take that layer's RoPE bits, mode
    and metadata dtype (its override included), as the harness, calibration and the engine build them; stored
    metadata is in that dtype. An explicit `rope` serves every layer."""
    model = tiny_model("deepseek_v3")
    quant = QuantCacheConfig(content=PathFormat(4, 16), rope=PathFormat(4, 8, "symmetric", "float32"),
                             layer_overrides={1: CacheFormat(PathFormat(4, 16), PathFormat(8, 8))})
    cache = RopeChannelCache(model, quant)
    got = {l.layer_idx: l.rope_channel for l in cache.mla_layers()}
    assert (got[0].bits, got[0].mode, got[0].meta_dtype) == (4, "symmetric", "float32")
    assert (got[1].bits, got[1].mode, got[1].meta_dtype) == (8, "affine", "float16")
    with torch.no_grad():
        model(torch.randint(3, 100, (1, 70)), past_key_values=cache, use_cache=True)
    assert cache.mla_layers()[0].rope.meta.dtype == torch.float32
    one = RopeChannelFormat(4, page_size=32)
    assert all(l.rope_channel == one for l in RopeChannelCache(model, quant, one).mla_layers())
