"""The tokens-as-M kernel on a RoPE path grouped per page (KIVI's per-channel keys: rope_page_tm.cuh folds each 16-token
block's channel scales into the query), and the heads-as-M kernel's build of such a path (wg_build.cuh's PM), on the GPU
against the fp32 oracle over the cache's own dequantized values: NaN-poisoned outputs, lengths 0, 1, odd and across
pages, causal multi-token rows, every plan of the kernel, metadata sets per page and per block, affine and symmetric
codes, RoPE values spanning 2^-12 to 2^12, hundreds of splits, and the error against fp64 within 2x the BF16 path's.
Skipped without CUDA.
Run: TRITON_INTERPRET=0 PYTHONPATH=src:lab:tests pytest -v tests/test_kernels_gpu_rope_page.py"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from helpers.gpu_decode import (  # noqa: E402
    D_R, LENS, PAGE_FORMATS, check_decode, errors_within_twice_bf16, make_cache, tokens_m_config, warpgroup_config)
from quantmla.cache.layout import CacheFormat  # noqa: E402
from quantmla.quant import PathFormat  # noqa: E402

TM_PAGE_FORMATS = {  # the page formats the tokens-as-M kernel reads (16-token blocks or longer, groups of 1 or 2)
    **{k: v for k, v in PAGE_FORMATS.items() if v.rope.meta_block(64) % 16 == 0},
    "int2/int4-page16": CacheFormat(PathFormat(2, 128), PathFormat(4, 1, grouping="page", block=16)),
    "int4/int2-page32": CacheFormat(PathFormat(4, 128), PathFormat(2, 1, grouping="page", block=32)),
}
PLANS = {"t1": {"token_blocks": 1, "specialized": False}, "t2": {"token_blocks": 2, "specialized": False},
         "ws": {"token_blocks": 1, "specialized": True}}


def tm_config(lay, rows, plan):
    cfg = tokens_m_config(lay, rows, plan)
    assert cfg.tokens_m
    return cfg


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", list(TM_PAGE_FORMATS))
@pytest.mark.parametrize("H,SQ", [(16, 1), (8, 2), (5, 3), (1, 1)])
def test_decode_tokens_m_rope_pages(name, plan, H, SQ):
    lay, pages, bt, sl = make_cache(TM_PAGE_FORMATS[name], LENS, seed=31 * H + SQ + len(name))
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + 7 * SQ, config=tm_config(lay, H * SQ, PLANS[plan]))
    assert md.variant.startswith("cuda/f16/tm/"), md.variant


@pytest.mark.parametrize("name", ["int4/int4-page16", "int2/int4-page-sym-g2"])
def test_decode_tokens_m_rope_pages_wide_channel_scales(name):
    """Channels whose RoPE values span 2^-12 to 2^12 (scales from fp16's subnormals to 2^10: the set's power of two
    keeps the scaled query finite and exact enough), with queries spanning 2^-12 to 2^2 and a head of zeros. Scores
    reach about 10^4 here, so the log-sum-exp's error is taken relative to the size they can reach (lse_rel)."""
    ch = 2.0 ** torch.linspace(-12, 12, D_R, device="cuda")
    lay, pages, bt, sl = make_cache(TM_PAGE_FORMATS[name], [700, 64, 1, 129], seed=41,
                                    rope_scale=ch[torch.randperm(D_R, device="cuda")])
    rows = torch.tensor([2.0 ** e for e in range(-12, 3)] + [0.0], device="cuda")
    for plan in PLANS.values():
        md = check_decode(lay, pages, bt, sl, 16, 1, seed=3, config=tm_config(lay, 16, plan), row_scale=rows,
                          lse_rel=True)
        assert md.variant.startswith("cuda/f16/tm/"), md.variant


@pytest.mark.parametrize("plan", ["t2", "ws"])
def test_decode_tokens_m_rope_pages_splits(plan):
    """Hundreds of splits a sequence (partials through the combine kernel), and one split (direct write)."""
    lay, pages, bt, sl = make_cache(TM_PAGE_FORMATS["int4/int4-page16"], [20000, 3, 511], seed=17)
    cfg = tm_config(lay, 16, PLANS[plan])
    check_decode(lay, pages, bt, sl, 16, 1, seed=1, config=cfg, chunk_tokens=64)
    check_decode(lay, pages, bt, sl, 16, 1, seed=2, config=cfg, chunk_tokens=1 << 20)


@pytest.mark.parametrize("on", [False, True])
def test_default_config_reads_rope_blocks_on_tokens_m(on, monkeypatch):
    """At 16 rows the API's default config reads 16-token RoPE blocks on the tokens-as-M kernel where
    TM_ROPE_PAGE_DEFAULT is set (else on the built tile), and blocks of 4 tokens (a warp's block spans four sets) on
    the built tile, each against the oracle."""
    from helpers.gpu_decode import kernels_api
    from quantmla.kernels.cuda import tokens_m

    monkeypatch.setattr(tokens_m, "TM_ROPE_PAGE_DEFAULT", on)
    for name, kind in (("int4/int4-page16", "cuda/f16/tm/" if on else "cuda/f16/M16"),
                       ("int2/int4-page4-sym-g2", "cuda/f16/M16")):
        lay, pages, bt, sl = make_cache(PAGE_FORMATS[name], LENS, seed=5)
        md = check_decode(lay, pages, bt, sl, 16, 1, seed=6, config=kernels_api().default_config(16, lay, "cuda"))
        assert md.variant.startswith(kind), (name, md.variant)


def test_decode_tokens_m_rope_pages_error_within_twice_bf16():
    """Against fp64 over its own dequantized cache, the per-channel formats' tokens-as-M error (each plan) is within
    2x the BF16 path's (the default CUDA kernel on a BF16 cache)."""
    plans = [lambda lay, p=p: tm_config(lay, 16, p) for p in PLANS.values()]
    errors_within_twice_bf16("rope pages", [(n, TM_PAGE_FORMATS[n], plans)
                                            for n in ("int4/int4-page16", "int2/int4-page-sym-g2")])


ALL_PAGE_FORMATS = {**PAGE_FORMATS, **TM_PAGE_FORMATS}


@pytest.mark.parametrize("name", list(ALL_PAGE_FORMATS))
@pytest.mark.parametrize("H,SQ", [(128, 1), (64, 2), (32, 3)])
def test_decode_heads_m_rope_pages(name, H, SQ):
    """The heads-as-M kernel (64 rows a CTA) reading the page's sets: per page, per block of 4 to 32 tokens, affine and
    symmetric, 2-bit RoPE codes."""
    lay, pages, bt, sl = make_cache(ALL_PAGE_FORMATS[name], LENS, seed=37 * H + SQ + len(name))
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + 5 * SQ, config=warpgroup_config(lay, H * SQ))
    assert md.variant.startswith("cuda/f16/wg/"), md.variant


def test_decode_heads_m_rope_pages_scales_and_splits():
    """At 128 heads: channels whose RoPE values span 2^-12 to 2^10 (at 2^12, values 4·2^12·N(0, 1) over 20000 tokens
    reach past fp16's 65504 in some set, whose zero point the writer then refuses), and hundreds of splits a sequence
    (and one)."""
    ch = 2.0 ** torch.linspace(-12, 10, D_R, device="cuda")
    lay, pages, bt, sl = make_cache(ALL_PAGE_FORMATS["int4/int4-page16"], [20000, 3, 511, 700], seed=43,
                                    rope_scale=ch[torch.randperm(D_R, device="cuda")])
    cfg = warpgroup_config(lay, 128)
    check_decode(lay, pages, bt, sl, 128, 1, seed=1, config=cfg, chunk_tokens=64, lse_rel=True)
    check_decode(lay, pages, bt, sl, 128, 1, seed=2, config=cfg, chunk_tokens=1 << 20, lse_rel=True)


@pytest.mark.parametrize("on", [False, True])
def test_default_config_reads_rope_pages_on_heads_m(on, monkeypatch):
    """At 128 rows the API's default config reads RoPE pages on the heads-as-M kernel where WG_ROPE_PAGE_DEFAULT is
    set, else on the built tile, against the oracle."""
    from helpers.gpu_decode import kernels_api
    from quantmla.kernels.cuda import warpgroup

    monkeypatch.setattr(warpgroup, "WG_ROPE_PAGE_DEFAULT", on)
    lay, pages, bt, sl = make_cache(ALL_PAGE_FORMATS["int4/int4-page16"], LENS, seed=9)
    md = check_decode(lay, pages, bt, sl, 128, 1, seed=10, config=kernels_api().default_config(128, lay, "cuda"))
    assert md.variant.startswith("cuda/f16/wg/" if on else "cuda/f16/M"), md.variant

