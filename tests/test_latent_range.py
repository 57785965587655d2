"""The content scales a model's latent norm allows (serving/latent_range.py), and the engine keeping latents whose
scales the tokens-as-M decode kernel cannot hold off that kernel."""

import math

import pytest
import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout
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
    bound = latent_range.content_scale_bound(norm, fmt)
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


def test_bound_is_none_where_no_scale_a_token_is_stored():
    norm = torch.nn.RMSNorm(D)
    assert latent_range.content_scale_bound(norm, BF16) is None
    assert latent_range.content_scale_bound(norm, PathFormat(4, 32, grouping="page")) is None
    assert latent_range.content_scale_bound(torch.nn.RMSNorm(D, elementwise_affine=False), FORMATS["int4"]) is None


def test_wide_layers_are_those_past_the_tokens_m_kernels_scale():
    """A tiny DeepSeek-V3 whose layer-1 latent norm weighs w: INT4 groups of 32 over d_c channels reach a scale of
    sqrt(d_c)·sqrt(2)·w / 15, named from the kernel's 255 on; INT2's /3 reaches it five times sooner; BF16 layers
    never."""
    from quantmla.model.spec import mla_modules
    from quantmla.model.tiny import tiny_model

    model = tiny_model("deepseek_v3")
    mods = mla_modules(model)
    d_c = mods[1].kv_a_layernorm.weight.numel()
    int4 = {s: CacheFormat(PathFormat(4, 32), PathFormat(4, 16)) for s in mods}
    int2 = {s: CacheFormat(PathFormat(2, 32), PathFormat(4, 16)) for s in mods}
    edge = 255.0 * 15 / (math.sqrt(d_c) * math.sqrt(2))  # INT4's w at the kernel's bound
    with torch.no_grad():
        mods[1].kv_a_layernorm.weight.fill_(edge * 0.99)
        assert latent_range.wide_layers(mods, int4) == {}
        assert set(latent_range.wide_layers(mods, int2)) == {1}
        mods[1].kv_a_layernorm.weight.fill_(edge * 1.01)
        wide = latent_range.wide_layers(mods, int4)
        assert set(wide) == {1} and wide[1] == pytest.approx(255.0 * 1.01, rel=1e-4)
        assert latent_range.wide_layers(mods, {s: CacheFormat(BF16, BF16) for s in mods}) == {}


def test_default_config_leaves_the_tokens_m_kernel_out_when_asked(monkeypatch):
    """default_config(tokens_m=False) asks the CUDA config for the built tile only; by default it lets the
    tokens-as-M kernel be chosen (the CUDA device mocked: only the argument is checked here)."""
    from quantmla.kernels import cuda, schedule

    asked = []
    monkeypatch.setattr(schedule, "interpreting", lambda: False)
    monkeypatch.setattr(cuda, "warpgroup_reason", lambda layout, rows: "not at 16 rows")
    monkeypatch.setattr(schedule, "cuda_config", lambda rows, layout, device, **kw: asked.append(kw.get("tokens_m"))
                        or schedule.DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=3, kernel="cuda"))
    lay = PageLayout(TokenLayout(512, 64, CacheFormat(PathFormat(4, 128), PathFormat(4, 64))), 64)
    schedule.default_config(16, lay, "cuda")
    schedule.default_config(16, lay, "cuda", tokens_m=False)
    assert latent_range.without_tokens_m(16, lay, "cuda").kernel == "cuda"
    assert asked == [None, False, False]


def test_engine_decodes_wide_latents_off_the_tokens_m_kernel(v3):
    """An engine over a model whose latent norm allows content scales past 255 takes its decode configs from
    without_tokens_m and says so; a decode_config given in the EngineConfig is kept; the torch backend, which has no
    such kernel, says nothing."""
    from quantmla.model.spec import mla_modules
    from quantmla.serving.engine import Engine, EngineConfig

    int2 = QuantCacheConfig.of_bits(2, 4, 32, 16)
    norm = mla_modules(v3)[0].kv_a_layernorm
    saved = norm.weight.detach().clone()
    try:
        with torch.no_grad():
            norm.weight.fill_(500.0)
        cfg = {"quant": int2, "num_pages": 8, "backend": "triton", "cuda_graphs": False}
        with pytest.warns(UserWarning, match=r"layers \[0\].*built-tile kernel"):
            eng = Engine(v3, EngineConfig(**cfg))
        assert eng.backend.decode_config is latent_range.without_tokens_m
        mine = lambda rows, layout, device: latent_range.without_tokens_m(rows, layout, device)  # noqa: E731
        assert Engine(v3, EngineConfig(**cfg, decode_config=mine)).backend.decode_config is mine
        with torch.no_grad():
            norm.weight.copy_(saved)
        assert Engine(v3, EngineConfig(**cfg)).backend.decode_config is None
    finally:
        with torch.no_grad():
            norm.weight.copy_(saved)
