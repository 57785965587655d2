"""The heads-as-M decode kernel on warpgroup MMAs (mla_decode_wg.cu) on the GPU, at full shape against the fp32 oracle
over each cache's own dequantized values: BF16 and the low-bit formats, 16 to 128 heads and 1 to 4 query tokens,
splits, query ranges, rising scores and large scales, and its error against fp64 within the BF16 paths'. Skipped
without CUDA. Run: TRITON_INTERPRET=0 PYTHONPATH=src:lab pytest -v tests/test_kernels_gpu_warpgroup.py"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from helpers.gpu_decode import (  # noqa: E402
    FORMATS, LENS, check_decode, fp64_error, kernel_config, make_cache, warpgroup_config)
from quantmla.cache.paged import gather_sequences  # noqa: E402


@pytest.mark.parametrize("seesaw", [False, True])
@pytest.mark.parametrize("H,SQ", [(128, 1), (64, 1), (128, 2), (64, 4), (16, 4), (40, 3)])
def test_decode_cuda_warpgroup(H, SQ, seesaw):
    """Heads as the M of warpgroup MMAs (mla_decode_wg.cu, BF16; `seesaw`: its warpgroups out of phase,
    mla_decode_seesaw.cu) against the same fp32 oracle: NaN-poisoned outputs, lengths 0, 1, odd and across pages (odd
    and even tile counts), causal multi-token rows, row blocks past the last row (40 x 3 = 120 rows in two 64-row
    blocks); the garbage bytes past a partial last tile (the pages start random) never reach the output."""
    lay, pages, bt, sl = make_cache(FORMATS["bf16"], LENS, seed=23 * H + SQ)
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + 13 * SQ, config=warpgroup_config(lay, H * SQ, seesaw))
    assert md.variant.startswith("cuda/bf16/ss/" if seesaw else "cuda/bf16/wg/M64N64w8s2c1"), md.variant


@pytest.mark.parametrize("seesaw", [False, True])
def test_decode_cuda_warpgroup_splits(seesaw):
    """Hundreds of splits a sequence (partials through the combine kernel), and one split (direct write)."""
    lay, pages, bt, sl = make_cache(FORMATS["bf16"], [20000, 3, 511], seed=31)
    cfg = warpgroup_config(lay, 128, seesaw)
    check_decode(lay, pages, bt, sl, 128, 1, seed=1, config=cfg, chunk_tokens=64)
    check_decode(lay, pages, bt, sl, 128, 1, seed=2, config=cfg, chunk_tokens=1 << 20)


@pytest.mark.parametrize("seesaw", [False, True])
def test_decode_cuda_warpgroup_error_within_bf16_paths(seesaw):
    """Against fp64, the heads-as-M kernel's error at 128 heads is within 1.5x the Triton BF16 kernel's (both round P
    to bf16 and accumulate in fp32)."""
    lay, pages, bt, sl = make_cache(FORMATS["bf16"], [4096] * 4, seed=37)
    wg, md = fp64_error(lay, pages, bt, sl, 128, 22, warpgroup_config(lay, 128, seesaw))
    assert md.variant.startswith("cuda/bf16/ss/" if seesaw else "cuda/bf16/wg/"), md.variant
    tri, md = fp64_error(lay, pages, bt, sl, 128, 22, kernel_config("triton", lay, 128, 1))
    assert not md.variant.startswith("cuda/"), md.variant
    print(f"warpgroup {wg:.2e}, triton {tri:.2e}")
    assert wg <= 1.5 * tri, (wg, tri)


def test_decode_cuda_warpgroup_out_off_16_bytes():
    """A caller's `out` that starts off a 16-byte boundary (the staged epilogue stores 16-byte pieces) is written
    through an aligned copy: the same values as an output the API allocates, sequences split and not."""
    import torch

    from quantmla.kernels import api

    lay, pages, bt, sl = make_cache(FORMATS["bf16"], [20000, 3, 511], seed=43)
    cfg = warpgroup_config(lay, 128)
    g = torch.Generator(device="cuda").manual_seed(5)
    qc = torch.randn(3, 1, 128, 512, generator=g, device="cuda").to(torch.bfloat16)
    qr = torch.randn(3, 1, 128, 64, generator=g, device="cuda").to(torch.bfloat16)
    md = api.get_mla_metadata(sl, 128, 1, lay, config=cfg)
    ref, _ = api.mla_decode_with_kvcache(qc, qr, pages, bt, sl, lay, 0.07, metadata=md)
    buf = torch.full((qc.numel() + 4,), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buf[4:].view(qc.shape)  # 8 bytes past a 16-byte boundary
    assert out.data_ptr() % 16 == 8
    api.mla_decode_with_kvcache(qc, qr, pages, bt, sl, lay, 0.07, metadata=md, out=out)
    assert md.variant.startswith("cuda/bf16/wg/") and torch.equal(out, ref)


WG_LOWBIT = ["int4/int4", "int2/int4", "int4/int8", "int4/int4-g64/g32", "int2/int8-sym-bf16", "int2/int4-sym", "fp8"]


@pytest.mark.parametrize("name", WG_LOWBIT)
@pytest.mark.parametrize("H,SQ", [(128, 1), (64, 2), (40, 3)])
def test_decode_cuda_warpgroup_lowbit(name, H, SQ):
    """Integer codes and FP8 on the heads-as-M kernel (raw stages of bulk copies, one tile built: wg_build.cuh) against
    the fp32 oracle over the cache's own dequantized values: NaN-poisoned outputs, lengths 0, 1, odd and across pages,
    causal multi-token rows, a second row block past the last row; the pages start random, so a partial last tile's
    stale codes and metadata (NaN or inf as fp16) must never reach the output."""
    lay, pages, bt, sl = make_cache(FORMATS[name], LENS, seed=29 * H + SQ)
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + 7 * SQ, config=warpgroup_config(lay, H * SQ))
    half = name not in ("int2/int8-sym-bf16", "fp8")  # fp16 operands where both paths' metadata is fp16
    stages = 1 if name == "fp8" else 3  # raw stages: FP8's 656 bytes a token fit one
    assert md.variant.startswith(f"cuda/{'f16' if half else 'bf16'}/wg/M64N64w8s{stages}c1"), md.variant


def test_decode_cuda_warpgroup_lowbit_query_ranges():
    """fp16 operands: heads whose queries span 2^-12 to 2^17 (rows past 2^13 scaled down by a power of two, undone in
    the scores; without it they would overflow fp16 to inf) and one head of zeros (uniform attention), against the
    same oracle (the log-sum-exp's error relative to the rows' score bound: scores reach 10^6)."""
    lay, pages, bt, sl = make_cache(FORMATS["int4/int4"], [700, 64, 1], seed=29)
    scales = torch.tensor([2.0 ** (-12 + e % 30) for e in range(63)] + [0.0], device="cuda")
    md = check_decode(lay, pages, bt, sl, 64, 1, seed=3, config=warpgroup_config(lay, 64), row_scale=scales, lse_rel=True)
    assert md.variant.startswith("cuda/f16/wg/"), md.variant


@pytest.mark.parametrize("name", ["int4/int4", "int2/int4", "fp8"])
def test_decode_cuda_warpgroup_lowbit_splits(name):
    """Hundreds of splits a sequence (partials through the combine kernel), and one split (direct write)."""
    lay, pages, bt, sl = make_cache(FORMATS[name], [20000, 3, 511], seed=41)
    cfg = warpgroup_config(lay, 128)
    check_decode(lay, pages, bt, sl, 128, 1, seed=3, config=cfg, chunk_tokens=64)
    check_decode(lay, pages, bt, sl, 128, 1, seed=4, config=cfg, chunk_tokens=1 << 20)


@pytest.mark.parametrize("name", ["bf16", "int4/int4", "int2/int4", "fp8", "bf16/seesaw"])
def test_decode_cuda_warpgroup_rising_scores(name):
    """Scores that rise along each sequence (keys scaled by 1 + position/256, to about 60 in base 2 at 10K tokens):
    the rows' reference maxima move many times, by more and by less than the 2^8 slack they keep before the output
    is rescaled, and the outputs still match the oracle, with hundreds of splits and with one."""
    fmt, seesaw, _ = name.partition("/seesaw")
    lay, pages, bt, sl = make_cache(FORMATS[fmt], [9999, 4097, 700, 65], seed=47, grow=1 / 256)
    cfg = warpgroup_config(lay, 128, bool(seesaw))
    check_decode(lay, pages, bt, sl, 128, 1, seed=6, config=cfg, chunk_tokens=1 << 20, lse_rel=True)
    check_decode(lay, pages, bt, sl, 128, 1, seed=7, config=cfg, chunk_tokens=512, lse_rel=True)


@pytest.mark.parametrize("name", ["int4/int4", "int2/int4"])
def test_decode_cuda_warpgroup_lowbit_large_scales(name):
    """Groups of scale 2^7 or more (every third token's values times 1000: scales of hundreds, values of thousands in
    the fp16 tile) beside ordinary ones in the same tiles, against the oracle with hundreds of splits and with one. The
    queries are scaled by 2^-10, so that the scores stay in the range where the tile's fp16 rounding is not what the
    test measures."""
    lay, pages, bt, sl = make_cache(FORMATS[name], [700, 65, 4097], seed=53, every=(3, 1000.0))
    lat, _ = gather_sequences(pages, lay, bt, sl)  # the content groups' scales: (max - min) / (2^bits - 1)
    c = lay.token.fmt.content
    groups = lat.reshape(*lat.shape[:2], -1, c.group_size)
    scale = (groups.amax(-1) - groups.amin(-1)) / (2 ** c.bits - 1)
    assert (scale >= 128).any() and ((scale > 0) & (scale < 128)).any()  # both kinds of group are there
    cfg = warpgroup_config(lay, 128)
    small = torch.full((128,), 2.0 ** -10, device="cuda")
    check_decode(lay, pages, bt, sl, 128, 1, seed=8, config=cfg, chunk_tokens=1 << 20, row_scale=small, lse_rel=True)
    check_decode(lay, pages, bt, sl, 128, 1, seed=9, config=cfg, chunk_tokens=128, row_scale=small, lse_rel=True)


def test_decode_cuda_warpgroup_lowbit_error_within_twice_bf16():
    """Against fp64 over each format's own dequantized cache at 128 heads, the heads-as-M kernel's INT4/INT4 and
    INT2/INT4 errors (a value rounded once, to fp16) and its FP8 error (rounded once, to bf16) are within 2x its BF16
    error."""
    errs = {}
    for name in ("bf16", "int4/int4", "int2/int4", "fp8"):
        lay, pages, bt, sl = make_cache(FORMATS[name], [4096] * 4, seed=37)
        errs[name], md = fp64_error(lay, pages, bt, sl, 128, 22, warpgroup_config(lay, 128))
        assert "/wg/" in md.variant, md.variant
    print("warpgroup", {k: f"{v:.2e}" for k, v in errs.items()})
    for name, e in errs.items():
        assert e <= 2 * errs["bf16"], (name, e, errs["bf16"])
