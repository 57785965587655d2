"""QuantMLACache: a transformers Cache whose every read goes through the quantized format."""

import pytest
import torch
from transformers import DynamicCache

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.hf_cache import QuantMLACache, QuantMLALayer
from quantmla.cache.layout import CacheFormat, TokenLayout
from quantmla.errors import NonFiniteError, QuantMLAError
from quantmla.model.tiny import FAMILIES, tiny_model
from quantmla.quant import BF16, PathFormat, quantize_dequantize

BF16_CFG = QuantCacheConfig.of_bits(16, 16)
CONFIGS = {
    "int8": QuantCacheConfig.of_bits(8, 8, 32, 16),
    "int4": QuantCacheConfig.of_bits(4, 4, 32, 16),
    "int2_int4": QuantCacheConfig.of_bits(2, 4, 32, 16),
}


def _ids(b=2, t=10, seed=0):
    return torch.randint(3, 128, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param)


def test_16bit_logits_equal_dynamic_cache(model):
    ids = _ids()
    with torch.no_grad():
        ref_cache, q_cache = DynamicCache(config=model.config), QuantMLACache(model, BF16_CFG)
        a = model(ids, past_key_values=ref_cache, use_cache=True).logits
        b = model(ids, past_key_values=q_cache, use_cache=True).logits
        assert torch.equal(a, b)
        nxt = a[:, -1:].argmax(-1)
        a2 = model(nxt, past_key_values=ref_cache, use_cache=True).logits
        b2 = model(nxt, past_key_values=q_cache, use_cache=True).logits
        assert torch.equal(a2, b2)


def test_16bit_greedy_generate_equals_dynamic_cache(model):
    ids = _ids(seed=1)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    got = model.generate(ids, past_key_values=QuantMLACache(model, BF16_CFG), **kw)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_low_bit_generate_greedy_and_sampled(model, name):
    ids = _ids(seed=2)
    cfg = CONFIGS[name]
    for sample in (False, True):
        torch.manual_seed(0)
        cache = QuantMLACache(model, cfg)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=5,
                             do_sample=sample, top_k=20, pad_token_id=0)
        assert out.shape == (2, 15)
        n_mla = len(model_spec_layers(cache))
        # 14 tokens cached (the last generated token is never fed back)
        assert cache.nbytes() == 2 * 14 * cache.bytes_per_token() and n_mla >= 1


def model_spec_layers(cache):
    return cache.mla_layers()


def test_low_bit_logits_match_fake_quant_reference():
    """A forward through the cache equals a forward where c and k_R are replaced by their round trip."""
    model = tiny_model("deepseek_v3")
    cfg = CONFIGS["int4"]
    ids = _ids()
    with torch.no_grad():
        got = model(ids, past_key_values=QuantMLACache(model, cfg), use_cache=True).logits

        class FakeQuantDynamic(DynamicCache):
            def update(self, latent, k_rope, layer_idx, *a, **k):
                return super().update(quantize_dequantize(latent, cfg.content), quantize_dequantize(k_rope, cfg.rope), layer_idx)

        ref = model(ids, past_key_values=FakeQuantDynamic(config=model.config), use_cache=True).logits
        full = model(ids).logits
    assert torch.equal(got, ref)
    assert not torch.equal(got, full)


def test_layer_stores_packed_bytes_of_the_layout():
    fmt = CacheFormat(PathFormat(2, 16), PathFormat(4, 8))
    layer = QuantMLALayer(fmt, 32, 16, layer_idx=0)
    c, r = torch.randn(3, 1, 7, 32), torch.randn(3, 1, 7, 16)
    out_c, out_r = layer.update(c, r)
    assert out_c.shape == c.shape and out_r.shape == r.shape
    torch.testing.assert_close(out_c, quantize_dequantize(c, fmt.content))
    assert layer.nbytes() == 3 * 7 * TokenLayout(32, 16, fmt).bytes_per_token
    assert layer.content.codes.dtype == torch.uint8 and layer.content.codes.shape == (3, 7, 8)


def test_full_precision_window():
    fmt = CacheFormat(PathFormat(2, 16), PathFormat(4, 8))
    layer = QuantMLALayer(fmt, 32, 16, fp_window=4, layer_idx=0)
    c, r = torch.randn(1, 1, 10, 32), torch.randn(1, 1, 10, 16)
    out_c, out_r = layer.update(c[:, :, :6], r[:, :, :6])
    out_c, out_r = layer.update(c[:, :, 6:], r[:, :, 6:])
    assert torch.equal(out_c[:, :, 6:], c[:, :, 6:]) and torch.equal(out_r[:, :, 6:], r[:, :, 6:])
    torch.testing.assert_close(out_c[:, :, :6], quantize_dequantize(c[:, :, :6], fmt.content))
    assert layer.get_seq_length() == 10 and layer.content.length == 6


def test_crop_and_batch_ops():
    layer = QuantMLALayer(CacheFormat(PathFormat(4, 16), BF16), 32, 16, fp_window=2, layer_idx=0)
    c, r = torch.randn(3, 1, 9, 32), torch.randn(3, 1, 9, 16)
    full_c, _ = layer.update(c, r)
    layer.crop(-3)
    assert layer.get_seq_length() == 6
    c2, _ = layer._read(torch.float32)
    torch.testing.assert_close(c2[:, 0], full_c[:, 0, :6])
    layer.batch_select_indices(torch.tensor([2, 0]))
    c3, _ = layer._read(torch.float32)
    torch.testing.assert_close(c3[:, 0], full_c[[2, 0], 0, :6])
    layer.crop(8)  # a positive value keeps that many tokens, as transformers' DynamicLayer: none past the length
    assert layer.get_seq_length() == 6
    layer.crop(4)
    assert layer.get_seq_length() == 4
    c4, _ = layer._read(torch.float32)
    torch.testing.assert_close(c4[:, 0], full_c[[2, 0], 0, :4])


def test_only_a_layer_without_full_precision_window_is_croppable():
    """A rollback (crop) cannot bring tokens back into the full-precision window once they were quantized, so a
    layer with a window says it is not croppable; without one a crop leaves exactly the shorter cache."""
    fmt = CacheFormat(PathFormat(4, 16), BF16)
    assert QuantMLALayer(fmt, 32, 16, fp_window=0, layer_idx=0).is_croppable
    windowed = QuantMLALayer(fmt, 32, 16, fp_window=4, layer_idx=0)
    assert not windowed.is_croppable
    c, r = torch.randn(1, 1, 8, 32), torch.randn(1, 1, 8, 16)
    windowed.update(c[:, :, :5], r[:, :, :5])
    windowed.update(c[:, :, 5:], r[:, :, 5:])
    windowed.crop(-3)
    got, _ = windowed._read(torch.float32)
    assert not torch.equal(got[:, 0, 1:5], c[0, :, 1:5])  # token 1 left the window for good: why it is not croppable


@pytest.mark.parametrize("fp_residual", [True, False])
def test_layers_with_per_channel_rope_blocks_are_not_croppable(fp_residual):
    """KIVI's and the per-page RoPE layers quantize whole blocks of tokens together: a crop into a completed block
    keeps its tokens only dequantized, so a rollback reads them otherwise than before the tokens that it drops were
    added. They say they are not croppable (transformers rolls back only croppable caches)."""
    from quantmla.cache.kivi import KIVIFormat, KIVILayer
    from quantmla.cache.rope_channel import RopeChannelFormat, RopeChannelLayer

    torch.manual_seed(0)
    c, r = torch.randn(1, 1, 10, 32), torch.randn(1, 1, 10, 16) * 3
    layers = [lambda: KIVILayer(KIVIFormat(PathFormat(4, 16), rope_bits=4, block=8, fp_residual=fp_residual), 32, 16),
              lambda: RopeChannelLayer(PathFormat(4, 16), RopeChannelFormat(4, page_size=8), 32, 16)]
    for make in layers:
        rolled, short = make(), make()
        assert not rolled.is_croppable
        rolled.update(c[:, :, :5], r[:, :, :5])
        rolled.update(c[:, :, 5:], r[:, :, 5:])
        rolled.crop(-5)
        short.update(c[:, :, :5], r[:, :, :5])
        assert not torch.equal(rolled._read(torch.float32)[1], short._read(torch.float32)[1])  # why: not restored
    assert QuantMLALayer(CacheFormat(PathFormat(4, 16), PathFormat(4, 8)), 32, 16).is_croppable


def test_crop_agrees_with_transformers_dynamic_cache():
    """crop(n) of the whole cache leaves the length a DynamicCache leaves, for a positive (tokens kept) and a negative
    (tokens removed) n, so the layers of a mixed cache never disagree."""
    import warnings

    m = tiny_model("deepseek_v3")
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    for n in (5, -3, 30):
        lengths = []
        for cache in (DynamicCache(config=m.config), QuantMLACache(m, QuantCacheConfig.of_bits(4, 4, 32, 16))):
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m(ids, past_key_values=cache, use_cache=True)
                cache.crop(n)
            lengths.append(cache.get_seq_length())
        assert lengths[0] == lengths[1] == {5: 5, -3: 17, 30: 20}[n], (n, lengths)


def test_mismatched_model_is_a_clear_error():
    small = tiny_model("deepseek_v3")
    other = tiny_model("deepseek_v3", kv_lora_rank=64)
    cache = QuantMLACache(small, CONFIGS["int4"])
    with pytest.raises(QuantMLAError, match="does not match this model"):
        other(_ids(), past_key_values=cache, use_cache=True)


def test_nan_activations_are_a_clear_error():
    model = tiny_model("minicpm3")
    with torch.no_grad():
        model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="layer 0"):
        model(_ids(), past_key_values=QuantMLACache(model, CONFIGS["int4"]), use_cache=True)


def test_missing_config_and_bad_overrides_are_clear_errors():
    model = tiny_model("deepseek_v2")
    with pytest.raises(QuantMLAError, match="no quantization_config"):
        QuantMLACache(model)
    with pytest.raises(QuantMLAError, match="MLA slots"):
        QuantMLACache(model, QuantCacheConfig(layer_overrides={7: CacheFormat()}))
    with pytest.raises(QuantMLAError, match="group_size 64 does not divide"):
        QuantMLACache(model, QuantCacheConfig.of_bits(4, 4, 64, 16))


def test_config_round_trip_and_per_layer_override():
    cfg = QuantCacheConfig(content=PathFormat(2, 16), rope=PathFormat(4, 8),
                           layer_overrides={1: CacheFormat(PathFormat(8, 32), PathFormat(8, 16))}, fp_window=3)
    assert QuantCacheConfig.from_dict(cfg.to_dict()) == cfg
    model = tiny_model("deepseek_v3")
    model.config.quantization_config = cfg.to_dict()
    cache = QuantMLACache(model)  # picks the config up from the model
    assert cache.layers[1].fmt.content.bits == 8 and cache.layers[0].fmt.content.bits == 2
    with pytest.raises(QuantMLAError, match="quant_method"):
        QuantCacheConfig.from_dict({"quant_method": "gptq"})
    from quantmla.cache.config import check_matches

    check_matches(QuantCacheConfig(content=PathFormat(4, 16), rope=PathFormat(16, 32)),  # 16-bit: groups mean nothing
                  QuantCacheConfig(content=PathFormat(4, 16), rope=BF16))
    with pytest.raises(QuantMLAError, match="calibrated"):
        check_matches(QuantCacheConfig(content=PathFormat(4, 16), rope=PathFormat(4, 8)),
                      QuantCacheConfig(content=PathFormat(4, 16), rope=BF16))
    misspelt = {("layer_override" if k == "layer_overrides" else k): v for k, v in cfg.to_dict().items()}
    with pytest.raises(QuantMLAError, match=r"unknown fields \['layer_override'\]"):  # never read as "no overrides"
        QuantCacheConfig.from_dict(misspelt)


def test_quantization_config_survives_save_and_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("glm4_moe_lite")
    cfg = QuantCacheConfig.of_bits(2, 4, 32, 16, method="quantmla")
    cfg.attach(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert QuantCacheConfig.from_model_config(loaded.config) == cfg
    cache = QuantMLACache(loaded)  # formats come from the checkpoint
    assert cache.layers[0].fmt.content.bits == 2
    ids = _ids()
    with torch.no_grad():
        a = model(ids, past_key_values=QuantMLACache(model, cfg), use_cache=True).logits
        b = loaded(ids, past_key_values=cache, use_cache=True).logits
    assert torch.equal(a, b)


def test_a_store_read_back_piece_by_piece_equals_one_read_of_every_token():
    """A store that keeps its read-back (decode reads a forward a token) dequantizes only the tokens appended since its
    last read: every read, after crops and batch reorders too, equals dequantizing all stored codes at once. A store
    keeps nothing by default (no dequantized copy of the history beside the codes)."""
    from quantmla.cache.hf_cache import _PathStore
    from quantmla.quant.groupwise import Quantized, dequantize

    fmt = PathFormat(4, 16)
    store = _PathStore(fmt, 32)
    store.keep_read_back = True
    torch.manual_seed(0)
    for step, n in enumerate((5, 1, 1, 3, 1)):
        store.append(torch.randn(2, n, 32))
        if step == 3:
            store.crop(6)
        if step == 4:
            store.index_batch(lambda t: t[[1, 0]])
        for dtype in (torch.float32, torch.bfloat16):
            full = dequantize(Quantized(store.codes, store.meta), fmt, 32, dtype)
            assert torch.equal(store.read(dtype), full), (step, dtype)
    plain = _PathStore(fmt, 32)
    plain.append(torch.randn(2, 4, 32))
    plain.read(torch.float32)
    assert plain._read_back is None
