"""The tokens-as-M decode kernel at 64 query rows (mla_decode_tm64.cu: the codes dequantized into the register operands
of warpgroup MMAs, no tile built) on the GPU, at full shape against the fp32 oracle over the cache's own dequantized
values: INT4/INT4 with DeepSeek's groups, 32 to 128 heads and 1 to 4 query tokens, page sizes, splits, query ranges,
rising scores and large scales, and its error against fp64 within 2x the BF16 heads-as-M kernel's. Skipped without
CUDA. Run: TRITON_INTERPRET=0 PYTHONPATH=src:lab pytest -v tests/test_kernels_gpu_tokens_m64.py"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from helpers.gpu_decode import FORMATS, LENS, check_decode, fp64_error, make_cache, tokens_m64_config, warpgroup_config

VARIANT = "cuda/f16/tm64/M64N64w12s5c1"


@pytest.mark.parametrize("H,SQ", [(128, 1), (64, 1), (128, 2), (64, 4), (40, 3), (32, 2)])
def test_decode_cuda_tokens_m64(H, SQ):
    """NaN-poisoned outputs, lengths 0, 1, odd and across pages, causal multi-token rows, a row block past the last
    row (40 x 3 = 120 rows in two 64-row blocks); the pages start random, so a partial last tile's stale codes and
    metadata (NaN or inf as fp16) must never reach the output."""
    lay, pages, bt, sl = make_cache(FORMATS["int4/int4"], LENS, seed=31 * H + SQ)
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + 5 * SQ, config=tokens_m64_config(lay, H * SQ))
    assert md.variant.startswith(VARIANT), md.variant


@pytest.mark.parametrize("page", [128, 256])
def test_decode_cuda_tokens_m64_page_sizes(page):
    """Pages of several tiles: a tile's sections at its offset inside the page."""
    lay, pages, bt, sl = make_cache(FORMATS["int4/int4"], LENS, seed=page, page=page)
    md = check_decode(lay, pages, bt, sl, 128, 1, seed=page + 1, config=tokens_m64_config(lay, 128))
    assert md.variant.startswith(VARIANT), md.variant


def test_decode_cuda_tokens_m64_splits():
    """Hundreds of splits a sequence (partials through the combine kernel), and one split (direct write)."""
    lay, pages, bt, sl = make_cache(FORMATS["int4/int4"], [20000, 3, 511], seed=43)
    cfg = tokens_m64_config(lay, 128)
    check_decode(lay, pages, bt, sl, 128, 1, seed=3, config=cfg, chunk_tokens=64)
    check_decode(lay, pages, bt, sl, 128, 1, seed=4, config=cfg, chunk_tokens=1 << 20)


def test_decode_cuda_tokens_m64_query_ranges():
    """Heads whose queries span 2^-12 to 2^17 (rows past 2^13 scaled down by a power of two, undone in the scores)
    and one head of zeros (uniform attention)."""
    lay, pages, bt, sl = make_cache(FORMATS["int4/int4"], [700, 64, 1], seed=29)
    scales = torch.tensor([2.0 ** (-12 + e % 30) for e in range(63)] + [0.0], device="cuda")
    check_decode(lay, pages, bt, sl, 64, 1, seed=3, config=tokens_m64_config(lay, 64), row_scale=scales, lse_rel=True)


def test_decode_cuda_tokens_m64_rising_scores():
    """Scores that rise along each sequence: the rows' references move many times, by more and by less than their
    slack, with hundreds of splits and with one."""
    lay, pages, bt, sl = make_cache(FORMATS["int4/int4"], [9999, 4097, 700, 65], seed=47, grow=1 / 256)
    cfg = tokens_m64_config(lay, 128)
    check_decode(lay, pages, bt, sl, 128, 1, seed=6, config=cfg, chunk_tokens=1 << 20, lse_rel=True)
    check_decode(lay, pages, bt, sl, 128, 1, seed=7, config=cfg, chunk_tokens=512, lse_rel=True)


def test_decode_cuda_tokens_m64_large_scales():
    """Groups of scale 2^7 or more beside ordinary ones in the same tiles (values of thousands in fp16)."""
    lay, pages, bt, sl = make_cache(FORMATS["int4/int4"], [700, 65, 4097], seed=53, every=(3, 1000.0))
    cfg = tokens_m64_config(lay, 128)
    small = torch.full((128,), 2.0 ** -10, device="cuda")
    check_decode(lay, pages, bt, sl, 128, 1, seed=8, config=cfg, chunk_tokens=1 << 20, row_scale=small, lse_rel=True)
    check_decode(lay, pages, bt, sl, 128, 1, seed=9, config=cfg, chunk_tokens=128, row_scale=small, lse_rel=True)


def test_decode_cuda_tokens_m64_error_within_twice_bf16():
    """Against fp64 over its own dequantized cache at 128 heads, its error is within 2x the BF16 heads-as-M kernel's
    over the BF16 cache of the same tokens (a value rounded once to fp16, P in fp16, fp32 sums)."""
    lay, pages, bt, sl = make_cache(FORMATS["int4/int4"], [4096] * 4, seed=37)
    err, md = fp64_error(lay, pages, bt, sl, 128, 22, tokens_m64_config(lay, 128))
    assert md.variant.startswith(VARIANT), md.variant
    blay, bpages, bbt, bsl = make_cache(FORMATS["bf16"], [4096] * 4, seed=37)
    ref, md = fp64_error(blay, bpages, bbt, bsl, 128, 22, warpgroup_config(blay, 128))
    assert "/wg/" in md.variant, md.variant
    print(f"tokens_m64 int4/int4 {err:.2e}, heads-as-M bf16 {ref:.2e}")
    assert err <= 2 * ref, (err, ref)
