"""The append kernel under TRITON_INTERPRET=1 (CPU, small shapes): bit-exact with the reference writer
(``cache.paged.write_tokens``) at every tiling, metadata rounding included, and clear errors for bad knobs. The same
checks at full shapes run on the GPU in test_kernels_gpu.py (``-k append``)."""

import os
import re

import pytest
import torch
from helpers.cpu_decode import D_C, D_R, DEV, FORMATS, PAGE
from helpers.quant_cases import far_groups

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout
from quantmla.cache.paged import PagePool, write_tokens
from quantmla.errors import QuantMLAError
from quantmla.kernels import append_to_pages
from quantmla.kernels.api import append_tiling
from quantmla.quant import PathFormat

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)


@pytest.mark.parametrize("name", list(FORMATS))
def test_append_is_bit_exact_with_the_reference_writer(name):
    fmt = FORMATS[name]
    lay = PageLayout(TokenLayout(D_C, D_R, fmt), PAGE)
    g = torch.Generator().manual_seed(hash(name) % 1000)
    pool = PagePool(lay, 6, device=DEV)
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, generator=g, dtype=torch.uint8))
    ref = pool.data.clone()
    slots = torch.randperm(6 * PAGE, generator=g)[:41]  # scattered, crossing pages
    slots[7] = -1  # padding token: skipped
    x = torch.randn(41, D_C, generator=g) * 4
    x[3, :16] = 1.5  # a constant group (scale 0 -> 1)
    r = torch.randn(41, D_R, generator=g) * 10
    xb = x.to(torch.bfloat16)  # the kernel reads any float dtype
    write_tokens(ref[0], lay, slots.to(DEV), xb.float().to(DEV), r.to(DEV))
    start = pool.data.clone()
    # default (1 token per program at this size), multi-token programs, and the paths in programs of their own
    for block_t, warps, apart in ((None, None, None), (4, 4, False), (16, 4, False), (None, 1, True), (4, 2, True)):
        pool.data.copy_(start)
        append_to_pages(pool.layer(0), lay, slots.to(DEV), xb.to(DEV), r.to(DEV), block_t=block_t, num_warps=warps,
                        paths_apart=apart)
        assert torch.equal(pool.data, ref), (block_t, warps, apart)


def test_append_tiling_defaults_and_bad_knobs():
    lay = PageLayout(TokenLayout(D_C, D_R, FORMATS["int4/int4"]), PAGE)
    bf16 = PageLayout(TokenLayout(D_C, D_R, FORMATS["bf16"]), PAGE)
    fp8 = PageLayout(TokenLayout(D_C, D_R, FORMATS["fp8"]), PAGE)
    for layout in (lay, bf16, fp8):  # a decode step's rows, up to 256: 4 warps, the paths apart
        assert append_tiling(layout, 1) == append_tiling(layout, 256) == (1, 4, True)
    assert append_tiling(lay, 257) == (4, 1, False)  # a prefill chunk of integer codes: one warp
    assert append_tiling(fp8, 4096) == (4, 2, False)
    assert append_tiling(bf16, 4096) == (4, 2, True)
    assert append_tiling(lay, 8, num_warps=2, paths_apart=False) == (1, 2, False)
    staged = PageLayout(TokenLayout(D_C, D_R, CacheFormat(PathFormat(4, 32), PathFormat(4, 1, grouping="page"))), PAGE)
    assert append_tiling(staged, 8) == append_tiling(staged, 8, paths_apart=True) == (1, 4, False)  # one program
    pool = PagePool(lay, 2, device=DEV)
    for n in (1, 0):  # the knobs are checked before any work, an empty call's too
        args = (pool.layer(0), lay, torch.zeros(n, dtype=torch.int64, device=DEV), torch.zeros(n, D_C, device=DEV),
                torch.zeros(n, D_R, device=DEV))
        for knob, bad, msg in (("num_warps", 3, "num_warps must be 1, 2, 4 or 8, got 3"),
                               ("num_warps", 4.0, "num_warps must be 1, 2, 4 or 8, got 4.0"),
                               ("num_warps", True, "num_warps must be 1, 2, 4 or 8, got True"),
                               ("block_t", 3, "block_t must be a power of two >= 1, got 3"),
                               ("block_t", 2.0, "block_t must be a power of two >= 1, got 2.0"),
                               ("paths_apart", "no", "paths_apart must be True, False or None, got 'no'")):
            with pytest.raises(QuantMLAError, match=re.escape(msg)):
                append_to_pages(*args, **{knob: bad})
    ok = (torch.zeros(1, dtype=torch.int64, device=DEV), torch.zeros(1, D_C, device=DEV), torch.zeros(1, D_R, device=DEV))
    for i, name in enumerate(("slots", "latent", "k_rope")):  # an input on another device: named, before any work
        moved = list(ok)
        moved[i] = moved[i].to("meta")
        with pytest.raises(QuantMLAError, match=f"{name} is on meta, the cache on {DEV}"):
            append_to_pages(pool.layer(0), lay, *moved)


@pytest.mark.parametrize("fmt", [CacheFormat(PathFormat(4, 16, meta_dtype="float32"), PathFormat(4, 16)),
                                 CacheFormat(PathFormat(2, 32), PathFormat(8, 16, "symmetric", "float32"))],
                         ids=["int4-f32meta/int4", "int2/int8-sym-f32meta"])
def test_append_keeps_fp32_metadata_of_integer_codes_exact(fmt):
    """Integer groups with fp32 scales and zero points store them unrounded, as the reference writer does."""
    g = torch.Generator().manual_seed(5)
    slots = torch.randperm(3 * PAGE, generator=g)[:29]
    x, r = torch.randn(29, D_C, generator=g) * 3 + 0.1, torch.randn(29, D_R, generator=g) * 7
    _append_equals_writer(fmt, 3, slots, x, r)


BF16_META = CacheFormat(PathFormat(8, 32, meta_dtype="bfloat16"), PathFormat(4, 32, meta_dtype="bfloat16"))


@pytest.mark.parametrize("fmt", [BF16_META, CacheFormat(PathFormat(2, 32), PathFormat(8, 16))],
                         ids=["int8/int4-bf16meta", "int2/int8"])
def test_append_rounds_affine_metadata_as_the_reference_writer(fmt):
    """Groups far from 0 against their width, and within an fp16 subnormal of 0 on either side: the append kernel
    stores each zero rounded down and each scale rounded up, bit for bit as the reference writer."""
    far = far_groups(fmt.content.bits)  # [8, 32]
    slots = torch.randperm(2 * PAGE, generator=torch.Generator().manual_seed(9))[:8]
    _append_equals_writer(fmt, 2, slots, torch.cat([far, far.roll(3, 0)], -1), far.roll(5, 0)[:, :D_R])


@pytest.mark.parametrize("meta", ["float16", "bfloat16"])
def test_append_rounds_symmetric_scales_up_as_the_reference_writer(meta):
    """Symmetric groups of every magnitude down to subnormal fp16 scales: the append kernel stores each scale rounded
    up, bit for bit as the reference writer."""
    fmt = CacheFormat(PathFormat(8, 32, "symmetric", meta), PathFormat(4, 16, "symmetric", meta))
    g = torch.Generator().manual_seed(11)
    mags = torch.tensor([1e-2, 1e-4, 2.5e-5, 3e-6, 1.0, 7.0, 0.3, 5e-5])[:, None]
    slots = torch.randperm(2 * PAGE, generator=g)[:8]
    x, r = torch.randn(8, D_C, generator=g) * mags, torch.randn(8, D_R, generator=g) * mags
    _append_equals_writer(fmt, 2, slots, x, r)


def _append_equals_writer(fmt: CacheFormat, pages: int, slots, x, r) -> None:
    """Tokens x [n, D_C], r [n, D_R] at `slots` of a pool of `pages`: the kernel's pages (paths apart and together)
    equal the reference writer's byte for byte."""
    lay = PageLayout(TokenLayout(D_C, D_R, fmt), PAGE)
    pool = PagePool(lay, pages, device=DEV)
    ref = pool.data.clone()
    write_tokens(ref[0], lay, slots.to(DEV), x.to(DEV), r.to(DEV))
    for apart in (True, False):
        pool.data.zero_()
        append_to_pages(pool.layer(0), lay, slots.to(DEV), x.to(DEV), r.to(DEV), paths_apart=apart)
        assert torch.equal(pool.data, ref), apart


