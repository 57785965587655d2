"""Forwards over expanded keys give every query its decode step's reading: a full-precision window (every token
quantized and unquantized) and RoPE keys per channel over blocks of tokens (KIVI-style, per page: each block's
prefixes as the earlier decode steps read them), alone or together."""

from dataclasses import replace

import pytest
import torch

from quantmla.cache.hf_cache import QuantMLALayer, expanded_key_count, expanded_keys
from quantmla.cache.kivi import KIVICache, KIVIFormat, KIVILayer
from quantmla.cache.layout import CacheFormat
from quantmla.cache.rope_channel import RopeChannelFormat, RopeChannelLayer
from quantmla.errors import QuantMLAError
from quantmla.evaluation.configs import named_config
from quantmla.evaluation.decode_reads import (
    decode_logits,
    expanded_mask,
    expanded_spans,
    reads_by_steps,
    reads_expanded,
)
from quantmla.evaluation.harness import RowSpec
from quantmla.model.tiny import tiny_model
from quantmla.quant.format import PathFormat

TOL = dict(atol=2e-5, rtol=1e-5)  # fp32: a forward over T tokens and T one-token forwards differ by ~1e-6

BLOCKED = {  # caches whose RoPE keys are quantized per channel over blocks of tokens (tiny models: d_r 16)
    "kivi8": dict(method="kivi", block=8),
    "kivi8-fp-residual": dict(method="kivi", block=8, fp_residual=True),
    "rope-channel16": dict(method="quantmla-rope-channel", block=16),
}


def _model(family: str, attn: str = "eager", dtype: torch.dtype = torch.float32):
    model = tiny_model(family, dtype=dtype)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")  # grouped_mm takes no float64
    model.set_attn_implementation(attn)
    assert model.config._attn_implementation == attn
    return model


def _factory(name: str, window: int, method: str = "rtn", offsets: bool | None = None, block: int = 8,
             fp_residual: bool = False):
    """model -> a fresh cache of `name` with a window (kivi: RoPE blocks of `block` tokens, fp_residual as asked;
    ROPE_CHANNEL methods: pages of `block` tokens); RoPE key offsets [d_r] set on every layer (the centring of a
    calibrated checkpoint; by default on all but kivi, which has none), the same for every cache of the factory."""
    row = RowSpec(named_config(name, 16, 8), method, kivi_block=block, fp_window=window, rope_page=block)
    base = row.cache_factory()
    if fp_residual:
        fmt = replace(row.kivi_format(), fp_residual=True)
        base = lambda model: KIVICache(model, fmt, fp_window=window)  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    offset = 0.3 * torch.randn(16, generator=gen) if (method != "kivi" if offsets is None else offsets) else None

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
    assert reads_expanded(cache, model) and not reads_by_steps(cache)
    with _Forwards(model, cache) as seen:
        got = decode_logits(model, ids, cache)
    assert seen.calls == 1 and seen.returned == [(2 * T, 2 * T)] * len(cache.mla_layers())
    torch.testing.assert_close(got, stepped, **TOL)
    torch.testing.assert_close(decode_logits(model, ids, factory(model), first=T - 5), stepped[:, T - 5 :], **TOL)
    with torch.no_grad():
        plain = model(ids, past_key_values=factory(model), use_cache=True).logits
    if window < T:
        assert (plain[:, : T - window] - stepped[:, : T - window]).abs().max() > 1e-4
    assert all(not layer._expanded for layer in cache.mla_layers())  # the mode ends with the forward


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("case", sorted(BLOCKED))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
def test_one_forward_over_expanded_keys_equals_decode_steps(family, attn, case, window):
    """RoPE keys per channel over blocks (43 tokens: the last block unfinished), with and without a window:
    decode_logits takes one forward whose every layer returns the expanded keys (history, unquantized tokens, block
    prefixes), and its logits equal explicit decode steps', `first=` included. One plain forward reads otherwise."""
    T = 43
    torch.manual_seed(0)
    model = _model(family, attn)
    ids = torch.randint(3, 128, (2, T))
    factory = _factory("INT4/INT4", window, **BLOCKED[case])
    stepped = _stepped(model, ids, factory(model))
    cache = factory(model)
    assert reads_expanded(cache, model) and not reads_by_steps(cache, model)
    block = BLOCKED[case]["block"]
    n_keys = expanded_key_count(0, T, window, block)
    assert n_keys > T * (1 + (window > 0)) + T * (block - 1) // 4  # the prefixes are there
    with _Forwards(model, cache) as seen:
        got = decode_logits(model, ids, cache)
    assert seen.calls == 1 and seen.returned == [(n_keys, n_keys)] * len(cache.mla_layers())
    torch.testing.assert_close(got, stepped, **TOL)
    torch.testing.assert_close(decode_logits(model, ids, factory(model), first=T - 7), stepped[:, T - 7 :], **TOL)
    with torch.no_grad():
        plain = model(ids, past_key_values=factory(model), use_cache=True).logits
    assert (plain - stepped).abs().max() > 1e-4
    assert all(not layer._expanded for layer in cache.mla_layers())


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
@pytest.mark.parametrize("case,window", [("kivi8", 8), ("rope-channel16", 0), (None, 8)])
def test_expanded_keys_in_float64_equal_decode_steps_to_rounding(family, case, window, attn):
    """In float64 the forwards' rounding noise moves no code across a rounding boundary: the one forward over
    expanded keys and the decode steps agree to the last bit or so of their float32 logits, where a wrong reading of
    one token differs by 1e-4 or more. (Eager attention takes its softmax in float32: its noise, ~1e-7, moves no code
    of these 43 tokens, but can on longer real sequences, where sdpa in float64 still agrees bit for bit.)"""
    torch.manual_seed(0)
    model = _model(family, attn, torch.float64)
    ids = torch.randint(3, 128, (2, 43))
    factory = _factory("INT2/INT4", window, **(BLOCKED[case] if case else {}))
    got = decode_logits(model, ids, factory(model))
    assert (got - _stepped(model, ids, factory(model)).float()).abs().max() < 1e-6


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case,window", [(None, 8), ("kivi8", 8), ("rope-channel16", 0)])
def test_right_padded_batch_reads_each_sequence_as_alone(attn, case, window):
    """Sequences of other lengths right-padded into one batch (one shorter than the window and the block): each real
    query's logits equal the sequence's own decode steps, `first=` included."""
    torch.manual_seed(0)
    model = _model("deepseek_v3", attn)
    factory = _factory("INT2/INT4", window, **(BLOCKED[case] if case else {}))
    lengths = (43, 27, 13, 6)
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


@pytest.mark.parametrize("start,end,window,block", [(0, 43, 0, 8), (0, 43, 8, 8), (0, 43, 8, 1), (0, 5, 8, 4),
                                                    (13, 29, 3, 4), (17, 18, 8, 16), (40, 43, 0, 16), (9, 40, 50, 8)])
def test_expanded_keys_give_each_query_its_decode_reading(start, end, window, block):
    """Every query i of an update of tokens start..end − 1 reads each token 0..i once, in the version its decode step
    reads: unquantized where i − window < j, else the stored history's version where j's block is complete by
    s = i − window (or i is the last query), else the prefix of its block up to s; every (block, prefix) is read by
    exactly one query. The key count's closed form agrees."""
    keys = expanded_keys(start, end, window, block)
    assert len(keys) == expanded_key_count(start, end, window, block)
    n_raw, n_prefix = keys.n_raw, len(keys) - end - keys.n_raw
    allowed = expanded_mask(keys, 1, torch.float32)[0, 0] == 0  # [queries, keys]
    for i in range(start, end):
        read = allowed[i - start].nonzero().flatten()
        assert sorted(keys.tokens[read].tolist()) == list(range(i + 1))
        s = i - window
        for k in read.tolist():
            j = int(keys.tokens[k])
            if j > s:
                assert end <= k < end + n_raw  # unquantized
            elif (j // block + 1) * block <= s + 1 or i == end - 1:
                assert k == j  # the history after the update
            else:
                assert k >= end + n_raw  # a prefix ending at s
                assert int(keys.prefix_first[keys.prefix_len.cumsum(0) > k - end - n_raw][0]) == s // block * block
    readers = allowed[:, end + n_raw :].sum(0)
    assert n_prefix == 0 or (readers == 1).all()
    pairs = list(zip(keys.prefix_first.tolist(), keys.prefix_len.tolist()))
    assert len(set(pairs)) == len(pairs) and int(keys.prefix_len.sum()) == n_prefix
    assert all(0 < p < block for _, p in pairs)


def _state(layer):
    return (layer.cumulative_length, layer.content.codes, layer.content.meta, layer.rope.codes, layer.rope.meta,
            getattr(layer.rope, "residual", None), *(layer.window or (None, None)))


def _layer(kind: str, window: int, offset: torch.Tensor) -> QuantMLALayer:
    content = PathFormat(4, 16)
    if kind == "per-token":
        return QuantMLALayer(CacheFormat(content, PathFormat(2, 8)), 32, 16, window, 0, rope_offset=offset)
    if kind == "rope-channel":
        return RopeChannelLayer(content, RopeChannelFormat(2, 8), 32, 16, window, 0, rope_offset=offset)
    layer = KIVILayer(KIVIFormat(content, 2, 4, fp_residual=kind == "kivi-fp-residual"), 32, 16, window, 0)
    layer.rope_offset = offset
    return layer


@pytest.mark.parametrize("kind", ["per-token", "kivi", "kivi-fp-residual", "rope-channel"])
@pytest.mark.parametrize("window,splits", [(4, (19,)), (6, (6,)), (8, (5,)), (0, (23,)), (3, (5, 1, 11, 8)),
                                           (0, (9, 14, 1))])
def test_expanded_update_stores_and_reads_as_decode_steps(kind, window, splits):
    """One layer, its RoPE keys centred: updates of `splits` tokens within expanded_reads (the first into the empty
    layer, the later ones into the layer as the earlier left it) leave the state decode steps leave (the same codes,
    metadata, residual and window, bit for bit), and the keys the expanded mask lets query t read are bit for bit
    the history decode step t reads, in order of their tokens."""
    torch.manual_seed(0)
    offset = torch.randn(16)
    T = sum(splits)
    lat, kr = torch.randn(2, 1, T, 32), 3 * torch.randn(2, 1, T, 16)
    expanded, steps = _layer(kind, window, offset), _layer(kind, window, offset)
    if kind == "per-token" and not window:
        with pytest.raises(QuantMLAError, match="window"):
            with expanded.expanded_reads():
                pass
        return
    t = 0
    for n in splits:
        keys = expanded.expanded_keys(n)
        with expanded.expanded_reads():
            c2, r2 = expanded.update(lat[:, :, t : t + n], kr[:, :, t : t + n])
        assert c2.shape == (2, 1, len(keys), 32) and r2.shape == (2, 1, len(keys), 16) and not expanded._expanded
        allowed = expanded_mask(keys, 2, torch.float32)[0, 0] == 0
        for i in range(t, t + n):
            c, r = steps.update(lat[:, :, i : i + 1], kr[:, :, i : i + 1])
            read = allowed[i - t].nonzero().flatten()
            read = read[keys.tokens[read].argsort()]
            assert torch.equal(c2[:, :, read], c) and torch.equal(r2[:, :, read], r)
        t += n
    for a, b in zip(_state(expanded), _state(steps), strict=True):
        assert (a is None and b is None) or (a == b if isinstance(a, int) else torch.equal(a, b))


def test_expanded_spans_fit_the_budget_and_fall_back_to_steps():
    """Spans cover the queries from 0 in order, each within the budget and as long as it allows; where the budget
    leaves one query a forward they end, and with no room for two queries there are none."""
    for T, window, block, budget in [(43, 8, 8, 3000), (512, 0, 32, 1 << 17), (4096, 64, 64, 1 << 17),
                                     (300, 0, 16, 4000)]:
        spans = expanded_spans(T, window, block, budget)
        assert spans[0][0] == 0 and all(a1 == b0 for (_, b0), (a1, _) in zip(spans, spans[1:]))
        for a, b in spans:
            assert b - a >= 2 and (b - a) * expanded_key_count(a, b, window, block) <= budget
            assert b == T or (b + 1 - a) * expanded_key_count(a, b + 1, window, block) > budget
        assert spans[-1][1] == T or 2 * expanded_key_count(spans[-1][1], spans[-1][1] + 2, window, block) > budget
    assert expanded_spans(43, 8, 8, 1) == []
    whole = 43 * expanded_key_count(0, 43, 0, 8)
    assert expanded_spans(43, 0, 8, whole) == [(0, 43)] and len(expanded_spans(43, 0, 8, whole - 1)) == 2


def test_score_budget_grows_with_the_sequence_on_cpu(monkeypatch):
    """The default budget: 2^7 scores a token and at least 2^17 on CPU, 2^25 on a GPU; decode_logits reads with it
    (its spans, counted as forwards, are those of score_budget's value, not of the constant)."""
    from quantmla.evaluation import decode_reads

    assert decode_reads.score_budget(512, cuda=False) == 1 << 17
    assert decode_reads.score_budget(4096, cuda=False) == 1 << 19
    assert decode_reads.score_budget(100_000, cuda=True) == decode_reads.MAX_SCORES_CUDA == 1 << 25
    monkeypatch.setattr(decode_reads, "MAX_SCORES", 1)  # the floor out of the way: 2^7 a token alone
    monkeypatch.setattr(decode_reads, "SCORES_PER_TOKEN", 25)
    torch.manual_seed(0)
    model = _model("deepseek_v3")
    ids = torch.randint(3, 128, (1, 43))
    factory = _factory("INT4/INT4", 8, **BLOCKED["kivi8"])
    spans = expanded_spans(43, 8, 8, 25 * 43)
    assert 1 < len(spans) < 43
    cache = factory(model)
    with _Forwards(model, cache) as seen:
        decode_logits(model, ids, cache)
    done = spans[-1][1]
    assert seen.calls == len(spans) + 43 - done


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_spans_read_as_decode_steps_and_leave_the_steps_cache(attn):
    """A budget that splits 43 queries into several forwards over expanded keys, each update starting from the cache
    as the span before left it: the logits equal decode steps', the cache ends as the steps leave it (to fp32
    noise), and decoding goes on from it as from the steps' cache. A budget that leaves single queries steps from
    there; one with no room for two queries steps throughout."""
    torch.manual_seed(0)
    model = _model("deepseek_v3", attn)
    ids = torch.randint(3, 128, (2, 44))
    factory = _factory("INT4/INT4", 8, **BLOCKED["kivi8"])
    steps = factory(model)
    stepped = _stepped(model, ids[:, :43], steps)
    budget = 1000
    spans = expanded_spans(43, 8, 8, budget)
    assert len(spans) == 4 and spans[-1][1] == 43
    cache = factory(model)
    with _Forwards(model, cache) as seen:
        got = decode_logits(model, ids[:, :43], cache, max_scores=budget)
    n_layers = len(cache.mla_layers())
    assert seen.calls == len(spans)
    assert seen.returned == [(n, n) for a, b in spans for n in [expanded_key_count(a, b, 8, 8)] * n_layers]
    torch.testing.assert_close(got, stepped, **TOL)
    torch.testing.assert_close(decode_logits(model, ids[:, :43], factory(model), first=20, max_scores=budget),
                               stepped[:, 20:], **TOL)
    for a, b in zip(cache.mla_layers(), steps.mla_layers()):
        assert a.cumulative_length == b.cumulative_length == 43 and a.rope.length == b.rope.length == 35
        for x, y in ((a.content.codes, b.content.codes), (a.rope.codes, b.rope.codes)):
            assert x.shape == y.shape and (x != y).float().mean() < 1e-3
        torch.testing.assert_close(a.rope.residual, b.rope.residual, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.window, b.window, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        nxt = [model(ids[:, 43:], past_key_values=c, use_cache=True).logits for c in (cache, steps)]
    torch.testing.assert_close(nxt[0], nxt[1], atol=1e-4, rtol=1e-4)

    for budget, n_spans in ((90, 12), (1, 0)):  # single queries from some span on; from the start
        spans = expanded_spans(43, 8, 8, budget)
        done = spans[-1][1] if spans else 1  # without spans a forward of one token, then steps
        assert len(spans) == n_spans and done < 43
        cache = factory(model)
        with _Forwards(model, cache) as seen:
            got = decode_logits(model, ids[:, :43], cache, max_scores=budget)
        assert seen.calls == len(spans) + 43 - done + (not spans)
        steps_returned = [n for n, _ in seen.returned[len(spans) * n_layers :: n_layers]]
        assert steps_returned == list(range(done + bool(spans), 44))  # the history: no expanded keys
        torch.testing.assert_close(got, stepped, **TOL)


def test_other_caches_still_take_a_forward_a_token():
    """A cache already holding tokens, an attention without an additive mask, or expanded=False: a forward a token
    after the exact prefill."""
    torch.manual_seed(0)
    model = _model("deepseek_v3")
    ids = torch.randint(3, 128, (1, 20))
    kivi = _factory("INT2/INT4", 4, **BLOCKED["kivi8"])
    cache = kivi(model)
    with _Forwards(model, cache) as seen:
        got = decode_logits(model, ids, cache, expanded=False)
    assert seen.calls == 20  # exact_prefill 1, then 19 steps
    torch.testing.assert_close(got, _stepped(model, ids, kivi(model)), **TOL)

    rtn = _factory("INT4/INT4", 4)
    cache = rtn(model)
    with _Forwards(model, cache) as seen:
        decode_logits(model, ids, cache, expanded=False)
    assert seen.calls == 1 + 16 and {n for n, _ in seen.returned} == set(range(4, 21))
    assert not reads_expanded(cache, model) and reads_by_steps(cache, model)  # it holds tokens now
    other = _model("deepseek_v3")
    other.config._attn_implementation = "flash_attention_2"
    for factory in (rtn, kivi):
        assert not reads_expanded(factory(model), other) and reads_by_steps(factory(model), other)
        assert reads_expanded(factory(model), model)
    assert not reads_expanded(_factory("INT4/INT4", 0)(model), model)  # per-token codes, no window: a plain forward


def test_expanded_reads_need_a_window_or_blocks_and_the_steps_window():
    """expanded_reads refuses a per-token layer without a window, and an update into a layer whose window no longer
    holds its newest tokens (after a crop); the mode ends when the block ends, on error too. Into a layer as decode
    steps leave it, an update within the mode starts where its tokens are."""
    fmt = CacheFormat(PathFormat(4, 16), PathFormat(4, 8))
    with pytest.raises(QuantMLAError, match="window"):
        with QuantMLALayer(fmt, 32, 16, fp_window=0, layer_idx=0).expanded_reads():
            pass
    layer = QuantMLALayer(fmt, 32, 16, fp_window=4, layer_idx=0)
    layer.update(torch.randn(1, 1, 6, 32), torch.randn(1, 1, 6, 16))
    layer.crop(-1)
    with pytest.raises(QuantMLAError, match="window"):
        with layer.expanded_reads():
            layer.update(torch.randn(1, 1, 2, 32), torch.randn(1, 1, 2, 16))
    assert not layer._expanded and layer.cumulative_length == 5
    c, _ = layer.update(torch.randn(1, 1, 2, 32), torch.randn(1, 1, 2, 16))
    assert c.shape[2] == 7
    with layer.expanded_reads():
        c, _ = layer.update(torch.randn(1, 1, 3, 32), torch.randn(1, 1, 3, 16))
    assert c.shape[2] == expanded_key_count(7, 10, 4, 1) == 10 + 4 + 3


@pytest.mark.parametrize("method,window", [("kivi", 0), ("quantmla-rope-channel", 0), ("kivi", 64)])
def test_expanded_reads_equal_decode_steps_on_a_shipped_model_in_float64(method, window):
    """A shipped reference model (qmla-ref-deepseek-v3, d_c 128, d_r 32) in float64: KIVI-style and per-channel RoPE
    blocks of 32, with and without a 64-token window, read over expanded keys give a forward a token's logits bit for
    bit (in fp32 rounding can move a code and a logit with it, so the claim is made in float64)."""
    from quantmla.corpus.datasets import model_path
    from quantmla.model.load import load_model

    model, _ = load_model(str(model_path("qmla-ref-deepseek-v3")), dtype=torch.float64)
    model.set_experts_implementation("eager")  # grouped_mm takes no float64
    ids = torch.randint(3, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    make = RowSpec(named_config("INT4/INT4", 64, 32), method, kivi_block=32, fp_window=window,
                   rope_page=32).cache_factory()
    assert reads_expanded(make(model), model)
    got = decode_logits(model, ids, make(model))
    want = decode_logits(model, ids, make(model), expanded=False)
    assert torch.equal(got, want)
