"""The content scales a model's latent norm allows (serving/latent_range.py), and the engine keeping latents whose
scales the tokens-as-M decode kernel cannot hold off that kernel."""

import dataclasses
import math
import os

import pytest
import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout, preset
from quantmla.quant import BF16, PathFormat
from quantmla.quant.groupwise import group_scales, grouped
from quantmla.serving import latent_range

D = 64
FORMATS = {"int4": PathFormat(4, 32), "int2": PathFormat(2, 16), "int4-sym": PathFormat(4, 32, "symmetric"),
           "fp8": PathFormat(8, 32, "fp8", "float32")}


def _norm(kind: str, g: torch.Generator) -> torch.nn.Module:
    """An RMSNorm, or a LayerNorm with a bias, of width D with weights of both signs and magnitudes 0.1 to 40."""
    norm = torch.nn.RMSNorm(D, eps=1e-12) if kind == "rms" else torch.nn.LayerNorm(D, eps=1e-12)
    with torch.no_grad():
        norm.weight.copy_((torch.rand(D, generator=g) * 40 + 0.1) * torch.sign(torch.randn(D, generator=g)))
        if kind == "layer":
            norm.bias.copy_(torch.randn(D, generator=g) * 3)
    return norm.double()


def _scales(norm: torch.nn.Module, x: torch.Tensor, fmt: PathFormat) -> torch.Tensor:
    """The scales a cache of `fmt` stores for the latents norm(x) [n, D] (fp32 metadata: unrounded)."""
    with torch.no_grad():
        c = norm(x.double()).float()
    exact = PathFormat(fmt.bits, fmt.group_size, fmt.mode, "float32")
    return group_scales(grouped(c, exact), exact)[0]


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_content_scale_bound_holds_for_any_tokens_and_is_reached(kind, name):
    """No latent the norm writes, random or built to stretch a group, stores a scale past the bound; the latent that
    puts the unit direction on the group's two largest weights with opposite signs (affine) or on its largest weight
    (symmetric, FP8) reaches it, for an RMSNorm (bound exact) and a LayerNorm with a bias (bias terms added)."""
    g = torch.Generator().manual_seed(7)
    norm, fmt = _norm(kind, g), FORMATS[name]
    bound = latent_range.content_scale_bound(norm, fmt, D)
    x = torch.cat([torch.randn(2000, D, generator=g) * torch.rand(2000, 1, generator=g) * 50,
                   torch.randn(200, D, generator=g).pow(5)])  # heavy tails: a few channels hold the energy
    assert float(_scales(norm, x, fmt).max()) <= bound * (1 + 1e-6)
    if kind == "layer":
        return  # (the bias terms' share is an upper bound, not reached by one token)
    w = norm.weight.detach()
    gs = fmt.group_size
    best = 0.0
    for start in range(0, D, gs):  # every group's extreme latent
        wg = w[start:start + gs].abs()
        x = torch.zeros(1, D)
        if fmt.mode == "affine":
            a, b = wg.topk(2).indices.tolist()
            x[0, start + a] = w[start + a].abs() * torch.sign(w[start + a])
            x[0, start + b] = -w[start + b].abs() * torch.sign(w[start + b])
        else:
            x[0, start + int(wg.argmax())] = 1.0
        best = max(best, float(_scales(norm, x, fmt)[0, start // gs]))  # (a group of zeros stores scale 1)
    assert best == pytest.approx(bound, rel=1e-5)


def test_rounding_slack_covers_a_bf16_norm_and_fp16_metadata():
    """A bf16 model's norm (HF's: the normed latent rounded to bf16, then times γ in bf16) and fp16 metadata lift a
    stored scale above the exact bound, by less than ROUNDING_SLACK: weights of 88.5 and 144 in a group of 128 at
    d_c 512 (INT4) bound the scale at 254.97 and store 256 for the extreme latent, inside 254.97·(1 + 2^-6); the
    layer is flagged (the kernel's own limit is 255.875)."""
    from quantmla.kernels.cuda.tokens_m import TM_MAX_CONTENT_SCALE

    class HFNorm(torch.nn.Module):  # transformers' DeepseekV3RMSNorm arithmetic
        def __init__(self, w):
            super().__init__()
            self.weight = torch.nn.Parameter(w)

        def forward(self, x):
            v = x.float()
            v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight * v.to(x.dtype)

    fmt, d_c = PathFormat(4, 128), 512
    g = torch.Generator().manual_seed(3)
    worst = 0.0
    for trial in range(40):
        w = (torch.rand(d_c, generator=g) * 4 + 1).bfloat16()
        if trial == 0:
            w[0], w[1] = 88.5, 144.0
        else:
            w[:128] = (torch.rand(128, generator=g) * 150).bfloat16()
        norm = HFNorm(w)
        bound = latent_range.content_scale_bound(norm, fmt, d_c)
        a, b = w[:128].float().abs().topk(2).indices.tolist()
        for jitter in torch.linspace(0.97, 1.03, 13):
            x = torch.zeros(1, d_c)
            x[0, a], x[0, b] = float(w[a]) * float(jitter), -float(w[b])
            with torch.no_grad():
                c = norm(x.bfloat16())
            stored = float(group_scales(grouped(c, fmt), fmt)[0][0, 0])
            worst = max(worst, stored / bound)
            assert stored <= bound * (1 + latent_range.ROUNDING_SLACK)
        if trial == 0:
            assert bound < 255 and bound * (1 + latent_range.ROUNDING_SLACK) >= TM_MAX_CONTENT_SCALE
    assert worst > 1.0  # rounding does lift some stored scales past the exact bound


def test_bound_is_none_where_no_scale_a_token_is_stored():
    norm = torch.nn.RMSNorm(D)
    assert latent_range.content_scale_bound(norm, BF16, D) is None
    assert latent_range.content_scale_bound(norm, PathFormat(4, 32, grouping="page"), D) is None
    assert latent_range.content_scale_bound(norm, FORMATS["int4"], 2 * D) is None  # not the latent's width
    assert latent_range.content_scale_bound(torch.nn.RMSNorm(D, elementwise_affine=False), FORMATS["int4"], D) is None
    assert latent_range.content_scale_bound(norm, FORMATS["int4"], D, latent_scale=3.0) == pytest.approx(
        3 * latent_range.content_scale_bound(norm, FORMATS["int4"], D))


def test_wide_layers_are_those_past_the_tokens_m_kernels_scale(monkeypatch):
    """A tiny DeepSeek-V3 whose layer-1 latent norm weighs w: INT4 groups of 32 over d_c channels reach a scale of
    sqrt(d_c)·sqrt(2)·w / 15, named from the kernel's limit on (rounding slack included); INT2's /3 reaches it five
    times sooner; a latent scale multiplies the bound; layouts the tokens-as-M kernel does not read (BF16 here, and
    every layout where tokens_m_reason gives a reason) are never named."""
    from quantmla.kernels.cuda import tokens_m
    from quantmla.kernels.cuda.tokens_m import TM_MAX_CONTENT_SCALE
    from quantmla.model.spec import mla_modules
    from quantmla.model.tiny import tiny_model

    model = tiny_model("deepseek_v3")
    mods = mla_modules(model)
    d_c = mods[1].kv_a_layernorm.weight.numel()

    def lays(content):
        return {s: PageLayout(TokenLayout(d_c, 16, CacheFormat(content, PathFormat(4, 16))), 16) for s in mods}

    int4, int2 = lays(PathFormat(4, 32)), lays(PathFormat(2, 32))
    bf16 = {s: PageLayout(TokenLayout(d_c, 16, CacheFormat(BF16, BF16)), 16) for s in mods}
    reads = lambda lay, rows: None if lay.token.fmt.content.quantized else "BF16"  # noqa: E731  (tiny d_c)
    monkeypatch.setattr(tokens_m, "tokens_m_reason", reads)
    edge = TM_MAX_CONTENT_SCALE / (1 + latent_range.ROUNDING_SLACK) * 15 / (math.sqrt(d_c) * math.sqrt(2))
    with torch.no_grad():
        mods[1].kv_a_layernorm.weight.fill_(edge * 0.99)
        assert latent_range.wide_layers(mods, int4, 16) == {}
        assert set(latent_range.wide_layers(mods, int2, 16)) == {1}
        assert set(latent_range.wide_layers(mods, int4, 16, latent_scale=1.02)) == {1}
        mods[1].kv_a_layernorm.weight.fill_(edge * 1.01)
        wide = latent_range.wide_layers(mods, int4, 16)
        assert set(wide) == {1} and wide[1] == pytest.approx(edge * 1.01 * math.sqrt(2 * d_c) / 15, rel=1e-4)
        assert latent_range.wide_layers(mods, bf16, 16) == {}
        monkeypatch.setattr(tokens_m, "tokens_m_reason", lambda lay, rows: "not read")
        assert latent_range.wide_layers(mods, int4, 16) == {}


def test_default_config_leaves_the_tokens_m_kernel_out_or_votes_when_asked(monkeypatch):
    """default_config(allow_tokens_m=False) asks the CUDA config for the built tile only, and that config never plans
    the tokens-as-M kernel; by default it may; default_config(scale_vote=True) asks for its SCALE_VOTE build (the CUDA
    device, nvcc and the builds mocked: only the plans asked for are checked here). wide_latents_config gives the
    voting config for layouts whose bound stays under TM_VOTE_MAX_CONTENT_SCALE, the built tile's past it, and None
    (the default) for others."""
    from quantmla.kernels import cuda, schedule
    from quantmla.kernels.cuda import build

    planned = []
    monkeypatch.setattr(schedule, "interpreting", lambda: False)
    monkeypatch.setattr(cuda, "warpgroup_reason", lambda layout, rows: "not at 16 rows")
    monkeypatch.setattr(build, "nvcc", lambda: "/usr/bin/true")
    monkeypatch.setattr(cuda, "decode_plan", lambda *a, tokens_m=None, scale_vote=False, **kw: planned.append(
        (bool(tokens_m), scale_vote)))
    int4 = PageLayout(TokenLayout(512, 64, CacheFormat(PathFormat(4, 128), PathFormat(4, 64))), 64)
    fp8 = PageLayout(TokenLayout(512, 64, preset("fp8")), 64)
    bf16 = PageLayout(TokenLayout(512, 64, CacheFormat(BF16, BF16)), 64)
    schedule.default_config(16, int4, "cuda")
    assert planned == [(True, False), (False, False)]  # the tokens-as-M kernel first, the built tile after it
    planned.clear()
    schedule.default_config(16, int4, "cuda", allow_tokens_m=False)
    assert planned == [(False, False)]
    planned.clear()
    schedule.default_config(16, int4, "cuda", scale_vote=True)
    assert planned == [(True, True), (False, False)]
    planned.clear()
    edge = cuda.TM_VOTE_MAX_CONTENT_SCALE / (1 + latent_range.ROUNDING_SLACK)
    wide = latent_range.wide_latents_config({int4: 0.999 * edge, fp8: edge})
    assert wide.wide == {int4, fp8} and wide.voting == {int4}
    wide(16, int4, "cuda")
    assert planned == [(True, True), (False, False)]
    planned.clear()
    wide(16, fp8, "cuda")
    assert planned == [(False, False)] and wide(16, bf16, "cuda") is None and planned == [(False, False)]


def test_wide_layouts_and_what_the_engine_says_of_them():
    """by_layout keeps each layout's largest bound over its layers; wide_warning names the layers and the largest bound,
    says where they decode (and how many layouts decode off the kernel past TM_VOTE_MAX_CONTENT_SCALE), or, for a
    decode_config of the caller's own, what it must do; the config (a frozen WideLatentsConfig) declares that the API's
    unit-length rules apply to it, a plain function does not."""
    from quantmla.kernels.cuda import TM_VOTE_MAX_CONTENT_SCALE
    from quantmla.serving.triton_backend import follows_units

    int4 = PageLayout(TokenLayout(512, 64, CacheFormat(PathFormat(4, 128), PathFormat(4, 64))), 64)
    fp8 = PageLayout(TokenLayout(512, 64, preset("fp8")), 64)
    layouts = {0: int4, 1: int4, 2: fp8}
    wide = {0: 300.0, 1: 900.0, 2: 2 * TM_VOTE_MAX_CONTENT_SCALE}
    assert latent_range.by_layout(wide, layouts) == {int4: 900.0, fp8: 2 * TM_VOTE_MAX_CONTENT_SCALE}
    cfg = latent_range.wide_latents_config(latent_range.by_layout(wide, layouts))
    assert isinstance(cfg, latent_range.WideLatentsConfig) and cfg.voting == {int4} and cfg.wide == {int4, fp8}
    assert follows_units(cfg) and latent_range.WideLatentsConfig.follows_units is True
    assert not follows_units(None) and not follows_units(lambda rows, layout, device: None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.voting = frozenset()
    given = latent_range.WideLatentsConfig(wide={int4, fp8}, voting=[int4])  # any iterables, held as frozensets
    assert given == cfg and hash(given) == hash(cfg) and isinstance(given.voting, frozenset)
    said = latent_range.wide_warning(wide, cfg)
    assert said.startswith("the latent norms of layers [0, 1, 2] allow content-group scales up to 1.31e+05")
    assert "255.875" in said and said.endswith("decode on its SCALE_VOTE build; 1 cache layout(s) past 65504 decode "
                                               "off it, on the other kernels")
    only = latent_range.wide_latents_config(latent_range.by_layout({0: 300.0}, layouts))
    assert latent_range.wide_warning({0: 300.0}, only).endswith("decode on its SCALE_VOTE build")
    must = ("EngineConfig.decode_config must decode them on its SCALE_VOTE build or off it "
            "(latent_range.wide_latents_config)")
    assert latent_range.wide_warning(wide, None).endswith(must)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton backend on the CPU: TRITON_INTERPRET=1")
def test_engine_decodes_wide_latents_on_the_scale_vote(v3, monkeypatch):
    """An engine over a model whose layer-0 latent norm allows content scales past the kernel's default builds takes
    its decode configs from wide_latents_config for that layer's layout (the SCALE_VOTE build), and says so; with a
    decode_config of its own it keeps it and says what it must do; the torch backend, which has no such kernel, and a
    model within the bound say nothing (tokens_m_reason mocked: the tiny model's d_c is not the kernel's)."""
    import warnings

    from quantmla.kernels.cuda import tokens_m
    from quantmla.model.spec import mla_modules
    from quantmla.serving.engine import Engine, EngineConfig
    from quantmla.serving.triton_backend import follows_units

    monkeypatch.setattr(tokens_m, "tokens_m_reason", lambda lay, rows: None)
    int2 = QuantCacheConfig.of_bits(2, 4, 32, 16)
    norm = mla_modules(v3)[0].kv_a_layernorm
    saved = norm.weight.detach().clone()
    cfg = {"quant": int2, "num_pages": 8, "backend": "triton", "cuda_graphs": False}
    try:
        with torch.no_grad():
            norm.weight.fill_(500.0)
        with pytest.warns(UserWarning, match=r"layers \[0\].*decode on its SCALE_VOTE build$"):
            eng = Engine(v3, EngineConfig(**cfg))
        keep = eng.backend.decode_config
        assert isinstance(keep, latent_range.WideLatentsConfig) and follows_units(keep)
        assert keep.wide == keep.voting == {eng.backend.layouts[0]}
        mine = lambda rows, layout, device: None  # noqa: E731
        with pytest.warns(UserWarning, match="decode_config must decode them on its SCALE_VOTE build or off it"):
            kept = Engine(v3, EngineConfig(**cfg, decode_config=mine)).backend.decode_config
        assert kept is mine and not follows_units(kept)  # a caller's function: its configs as given
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Engine(v3, EngineConfig(**{**cfg, "backend": "torch"}))
            with torch.no_grad():
                norm.weight.copy_(saved)
            assert Engine(v3, EngineConfig(**cfg)).backend.decode_config is None
    finally:
        with torch.no_grad():
            norm.weight.copy_(saved)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["int4/int4", "int2/int4"])
def test_wide_latents_decode_on_the_config_the_engine_takes(name):
    """Latents uniform in ±2500 store content scales of about 330 (INT4/INT4) and 1650 (INT2/INT4), past the
    tokens-as-M kernel's TM_MAX_CONTENT_SCALE (checked on the cache's dequantized groups), in a layout the API's
    default decodes on that kernel. On the config wide_latents_config gives that layout (the one the engine takes for
    it: the kernel's SCALE_VOTE build), and on the built tile it gives past TM_VOTE_MAX_CONTENT_SCALE, they decode
    within the usual tolerance of the fp32 oracle, the outputs NaN-poisoned first, at lengths 5000, 1, 700 and 64."""
    from helpers.gpu_decode import FORMATS, check_decode, make_cache
    from quantmla.cache.paged import gather_sequences
    from quantmla.kernels.cuda import TM_MAX_CONTENT_SCALE, TM_VOTE_MAX_CONTENT_SCALE
    from quantmla.kernels.schedule import default_config

    fmt = FORMATS[name]
    lay, pages, bt, sl = make_cache(fmt, [5000, 1, 700, 64], seed=31, latent_range=(-2500.0, 2500.0))
    lat, _ = gather_sequences(pages, lay, bt, sl)
    g = lat[0, :5000].reshape(5000, -1, fmt.content.group_size)
    least = (g.amax(-1) - g.amin(-1)) / (2**fmt.content.bits - 1)  # a group's stored scale is at least this
    assert least.median() > 1.2 * TM_MAX_CONTENT_SCALE
    cuda = torch.device("cuda")
    assert default_config(16, lay, cuda).describe().startswith("cuda/tm/ws ")
    cfg = latent_range.wide_latents_config({lay: 2 * float(least.max())})(16, lay, cuda)
    assert cfg.describe().startswith("cuda/tm/wsv "), cfg.describe()
    md = check_decode(lay, pages, bt, sl, 16, 1, seed=5, config=cfg, lse_rel=True)
    assert md.variant.startswith("cuda/f16/tm/") and "v" in md.variant.split("/")[3], md.variant
    off = latent_range.wide_latents_config({lay: TM_VOTE_MAX_CONTENT_SCALE})(16, lay, cuda)
    assert not off.describe().startswith("cuda/tm"), off.describe()
    md = check_decode(lay, pages, bt, sl, 16, 1, seed=5, config=off, lse_rel=True)
    assert not md.variant.startswith("cuda/f16/tm/"), md.variant


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["int4/int4", "int2/int4"])
@pytest.mark.parametrize("specialized", [False, True], ids=["4warps", "warps_apart"])
def test_wide_latents_on_the_tokens_m_kernel_with_the_scale_vote(name, specialized):
    """SCALE_VOTE (the tokens-as-M kernel's `scale_vote` build): P is also held under 65504 / its token's largest
    content scale, so the wide latents above decode on the tokens-as-M kernel itself within the oracle's tolerance,
    with 4 warps and with the warps apart, and the launch ran that build ("v" in its name)."""
    from helpers.gpu_decode import FORMATS, check_decode, make_cache, tokens_m_config

    lay, pages, bt, sl = make_cache(FORMATS[name], [5000, 1, 700, 64], seed=37, latent_range=(-2500.0, 2500.0))
    cfg = tokens_m_config(lay, 16, {"specialized": specialized, "scale_vote": True})
    md = check_decode(lay, pages, bt, sl, 16, 1, seed=7, config=cfg, lse_rel=True)
    assert md.variant.startswith("cuda/f16/tm/") and ("ws" in md.variant) == specialized, md.variant
    assert "v" in md.variant.split("/")[3], md.variant
