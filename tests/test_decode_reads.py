"""A full-precision window read in one forward over doubled keys gives every query its decode step's reading."""

import pytest
import torch

from quantmla.cache.hf_cache import QuantMLALayer
from quantmla.cache.layout import CacheFormat
from quantmla.errors import QuantMLAError
from quantmla.evaluation.configs import named_config
from quantmla.evaluation.decode_reads import decode_logits, doubled_mask, reads_by_steps, reads_doubled
from quantmla.evaluation.harness import RowSpec
from quantmla.model.tiny import tiny_model
from quantmla.quant.format import PathFormat

TOL = dict(atol=2e-5, rtol=1e-5)  # fp32: a forward over T tokens and T one-token forwards differ by ~1e-6


def _model(family: str, attn: str = "eager", dtype: torch.dtype = torch.float32):
    model = tiny_model(family, dtype=dtype)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")  # grouped_mm takes no float64
    model.set_attn_implementation(attn)
    assert model.config._attn_implementation == attn
    return model


def _factory(name: str, window: int, method: str = "rtn", offsets: bool = True):
    """model -> a fresh cache of `name` with a window; RoPE key offsets [d_r] set on every layer (the centring of a
    calibrated checkpoint), the same for every cache of the factory."""
    base = RowSpec(named_config(name, 16, 8), method, kivi_block=8, fp_window=window).cache_factory()
    gen = torch.Generator().manual_seed(1)
    offset = 0.3 * torch.randn(16, generator=gen) if offsets else None

    def make(model):
        cache = base(model)
        for layer in cache.mla_layers():
            layer.rope_offset = offset
        return cache

    return make


def _stepped(model, ids, cache):
    """Logits [B, T, V] of explicit decode steps: one forward a token from an empty cache."""
    with torch.no_grad():
        return torch.cat([model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
                          for t in range(ids.shape[1])], 1)


class _Forwards:
    """Counts the model's forwards and the key tokens each MLA layer's update returns."""

    def __init__(self, model, cache):
        self.calls, self.returned = 0, []
        self.hook = model.register_forward_pre_hook(lambda *a: setattr(self, "calls", self.calls + 1))
        for layer in cache.mla_layers():
            orig = layer.update

            def spy(k, v, *a, _orig=orig, **kw):
                out = _orig(k, v, *a, **kw)
                self.returned.append((out[0].shape[2], out[1].shape[2]))
                return out

            layer.update = spy

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.hook.remove()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "minicpm3", "glm4_moe_lite"])
@pytest.mark.parametrize("name,window,T", [("INT4/INT4", 8, 40), ("INT2/INT4", 8, 37), ("INT4/INT4", 48, 40)])
def test_one_forward_over_doubled_keys_equals_decode_steps(family, attn, name, window, T):
    """A windowed per-token cache: decode_logits takes one forward whose every layer returns 2T keys, and its logits
    equal explicit token-by-token decode steps' (a window as long as the sequence too), `first=` included. One plain
    forward reads otherwise where the window is shorter than the sequence."""
    torch.manual_seed(0)
    model = _model(family, attn)
    ids = torch.randint(3, 128, (2, T))
    factory = _factory(name, window)
    stepped = _stepped(model, ids, factory(model))
    cache = factory(model)
    assert reads_doubled(cache, model) and not reads_by_steps(cache)
    with _Forwards(model, cache) as seen:
        got = decode_logits(model, ids, cache)
    assert seen.calls == 1 and seen.returned == [(2 * T, 2 * T)] * len(cache.mla_layers())
    torch.testing.assert_close(got, stepped, **TOL)
    torch.testing.assert_close(decode_logits(model, ids, factory(model), first=T - 5), stepped[:, T - 5 :], **TOL)
    with torch.no_grad():
        plain = model(ids, past_key_values=factory(model), use_cache=True).logits
    if window < T:
        assert (plain[:, : T - window] - stepped[:, : T - window]).abs().max() > 1e-4
    assert all(not layer._doubled for layer in cache.mla_layers())  # the mode ends with the forward


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
def test_doubled_keys_in_float64_equal_decode_steps_to_rounding(family, attn):
    """In float64 the forwards' rounding noise (~1e-15) moves no code across a rounding boundary: the one forward
    over doubled keys and the decode steps agree to the last bit or so of their float32 logits, where a wrong reading
    of one token differs by 1e-4 or more."""
    torch.manual_seed(0)
    model = _model(family, attn, torch.float64)
    ids = torch.randint(3, 128, (2, 40))
    factory = _factory("INT2/INT4", 8)
    got = decode_logits(model, ids, factory(model))
    assert (got - _stepped(model, ids, factory(model)).float()).abs().max() < 1e-6


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_right_padded_batch_reads_each_sequence_as_alone(attn):
    """Sequences of other lengths right-padded into one batch (a window of 8; one shorter than it): each real query's
    logits equal the sequence's own decode steps."""
    torch.manual_seed(0)
    model = _model("deepseek_v3", attn)
    factory = _factory("INT2/INT4", 8)
    lengths = (40, 27, 13, 6)
    seqs = [torch.randint(3, 128, (n,)) for n in lengths]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, : len(s)] = s
    got = decode_logits(model, ids, factory(model))
    for j, s in enumerate(seqs):
        torch.testing.assert_close(got[j, : len(s)], _stepped(model, s[None], factory(model))[0], **TOL)
    first = 5  # retrieval's queries: the shortest prompt's last position on
    late = decode_logits(model, ids, factory(model), first=first)
    for j, s in enumerate(seqs):
        torch.testing.assert_close(late[j, : len(s) - first], got[j, first : len(s)], **TOL)


def _state(layer):
    return (layer.cumulative_length, layer.content.codes, layer.content.meta, layer.rope.codes, layer.rope.meta,
            *layer.window)


@pytest.mark.parametrize("window,T", [(4, 19), (6, 6), (8, 5)])
def test_doubled_update_stores_and_reads_as_decode_steps(window, T):
    """One layer, its RoPE keys centred: an update of T tokens within doubled_reads leaves the state decode steps
    leave (the same codes, metadata and window), and the keys the doubled mask lets query t read are bit for bit
    the history decode step t reads."""
    torch.manual_seed(0)
    fmt = CacheFormat(PathFormat(4, 16), PathFormat(2, 8))
    offset = torch.randn(16)
    lat, kr = torch.randn(2, 1, T, 32), 3 * torch.randn(2, 1, T, 16)
    doubled = QuantMLALayer(fmt, 32, 16, fp_window=window, layer_idx=0, rope_offset=offset)
    with doubled.doubled_reads():
        c2, r2 = doubled.update(lat, kr)
    assert c2.shape == (2, 1, 2 * T, 32) and r2.shape == (2, 1, 2 * T, 16) and not doubled._doubled
    steps = QuantMLALayer(fmt, 32, 16, fp_window=window, layer_idx=0, rope_offset=offset)
    mask = doubled_mask(2, T, window, torch.float32)
    for t in range(T):
        c, r = steps.update(lat[:, :, t : t + 1], kr[:, :, t : t + 1])
        keys = mask[0, 0, t] == 0
        assert int(keys.sum()) == t + 1
        assert torch.equal(c2[:, :, keys], c) and torch.equal(r2[:, :, keys], r)
    for a, b in zip(_state(doubled), _state(steps)):
        assert (a is None and b is None) or (a == b if isinstance(a, int) else torch.equal(a, b))


def test_cache_after_the_doubled_forward_is_the_decode_steps_cache():
    """After decode_logits' one forward the model's cache holds what decode steps leave: T tokens, the oldest T − W
    stored, the newest W in the window (equal to fp32 noise: the forwards' latents differ by ~1e-6), so decoding goes
    on from it as from the steps' cache."""
    torch.manual_seed(0)
    model = _model("minicpm3")
    ids = torch.randint(3, 128, (2, 41))
    factory = _factory("INT4/INT4", 8)
    doubled, steps = factory(model), factory(model)
    decode_logits(model, ids[:, :40], doubled)
    _stepped(model, ids[:, :40], steps)
    for a, b in zip(doubled.mla_layers(), steps.mla_layers()):
        assert a.cumulative_length == b.cumulative_length == 40 and a.content.length == a.rope.length == 32
        for x, y in ((a.content.codes, b.content.codes), (a.rope.codes, b.rope.codes)):
            assert x.shape == y.shape and (x != y).float().mean() < 1e-3
        torch.testing.assert_close(a.content.meta.float(), b.content.meta.float(), atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(a.window, b.window, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        nxt = [model(ids[:, 40:], past_key_values=c, use_cache=True).logits for c in (doubled, steps)]
    torch.testing.assert_close(nxt[0], nxt[1], atol=1e-4, rtol=1e-4)


def test_other_caches_still_take_a_forward_a_token():
    """Blocked RoPE keys (KIVI-style), a cache already holding tokens, an attention without an additive mask, or
    doubled=False: a forward a token after the exact prefill."""
    torch.manual_seed(0)
    model = _model("deepseek_v3")
    ids = torch.randint(3, 128, (1, 20))
    kivi = _factory("INT2/INT4", 4, method="kivi", offsets=False)
    cache = kivi(model)
    assert not reads_doubled(cache, model) and reads_by_steps(cache)
    with _Forwards(model, cache) as seen:
        got = decode_logits(model, ids, cache)
    assert seen.calls == 20  # exact_prefill 1, then 19 steps
    torch.testing.assert_close(got, _stepped(model, ids, kivi(model)), **TOL)

    rtn = _factory("INT4/INT4", 4)
    cache = rtn(model)
    with _Forwards(model, cache) as seen:
        decode_logits(model, ids, cache, doubled=False)
    assert seen.calls == 1 + 16 and {n for n, _ in seen.returned} == set(range(4, 21))
    assert not reads_doubled(cache, model)  # it holds tokens now
    other = _model("deepseek_v3")
    other.config._attn_implementation = "flash_attention_2"
    assert not reads_doubled(rtn(model), other) and reads_doubled(rtn(model), model)


def test_doubled_reads_need_an_empty_windowed_per_token_layer():
    """doubled_reads refuses a layer without a window and an update into a layer that holds tokens; the mode ends
    when the block ends, on error too."""
    fmt = CacheFormat(PathFormat(4, 16), PathFormat(4, 8))
    with pytest.raises(QuantMLAError, match="window"):
        with QuantMLALayer(fmt, 32, 16, fp_window=0, layer_idx=0).doubled_reads():
            pass
    layer = QuantMLALayer(fmt, 32, 16, fp_window=4, layer_idx=0)
    layer.update(torch.randn(1, 1, 3, 32), torch.randn(1, 1, 3, 16))
    with pytest.raises(QuantMLAError, match="empty"):
        with layer.doubled_reads():
            layer.update(torch.randn(1, 1, 2, 32), torch.randn(1, 1, 2, 16))
    assert not layer._doubled and layer.cumulative_length == 3
    c, _ = layer.update(torch.randn(1, 1, 2, 32), torch.randn(1, 1, 2, 16))
    assert c.shape[2] == 5
