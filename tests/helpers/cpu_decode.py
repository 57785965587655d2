"""What the CPU-interpreter kernel tests share: the cache formats they run, a NaN-poisoned pool of random tokens at
pages out of order (written through the append kernel), one decode call beside the fp64 oracle over the pool's own
dequantized values, and the check of a call against it."""

import torch

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout
from quantmla.cache.paged import PagePool, gather_sequences
from quantmla.kernels import append_to_pages, get_mla_metadata, mla_decode_with_kvcache
from quantmla.quant import BF16, PathFormat
from quantmla.reference.absorbed import absorbed_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
D_C, D_R, PAGE = 64, 32, 16

FORMATS = {
    "bf16": CacheFormat(BF16, BF16),
    "int4/int4": CacheFormat(PathFormat(4, 32), PathFormat(4, 16)),
    "int2/int4": CacheFormat(PathFormat(2, 32), PathFormat(4, 32)),
    "int4/int8": CacheFormat(PathFormat(4, 16), PathFormat(8, 32)),
    "int2/int8-sym-bf16meta": CacheFormat(PathFormat(2, 16, "symmetric", "bfloat16"), PathFormat(8, 16, "symmetric")),
    "int8/int2": CacheFormat(PathFormat(8, 64), PathFormat(2, 16)),  # RoPE chunks < 16: generic kernel
    "fp8": CacheFormat(PathFormat(8, 32, "fp8", "float32"), BF16),  # fp8_ds_mla's record: fp32 scales, bf16 RoPE
    "fp8/fp8-f16meta": CacheFormat(PathFormat(8, 16, "fp8"), PathFormat(8, 16, "fp8", "bfloat16")),
    "int2/int8-sym-clipped": CacheFormat(PathFormat(2, 32, clip=0.875), PathFormat(8, 16, "symmetric", clip=0.9375)),
}


def make_cache(fmt, lens, seed=0, scale=1.0):
    """A poisoned pool holding random sequences of `lens`, written through the append kernel."""
    g = torch.Generator().manual_seed(seed)
    lay = PageLayout(TokenLayout(D_C, D_R, fmt), PAGE)
    pool = PagePool(lay, sum(lay.pages_for(n) for n in lens) + 3, device=DEV)
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, generator=g, dtype=torch.uint8))  # NaN-ish garbage
    pool.append_slots("pad", 5)  # a foreign sequence first, so pages are not in order
    for i, n in enumerate(lens):
        slots = pool.append_slots(i, n)
        x = (torch.randn(n, D_C, generator=g) * 2 + 0.3).to(DEV)
        r = (torch.randn(n, D_R, generator=g) * 3 * scale).to(DEV)
        append_to_pages(pool.layer(0), lay, slots.to(DEV), x, r)
    ids = list(range(len(lens)))
    return lay, pool, pool.block_table(ids), pool.seq_lens(ids)


def reference(lay, pool, bt, sl, qc, qr, scale):
    c, k = gather_sequences(pool.layer(0), lay, bt, sl)
    return absorbed_attention(qc.double(), qr.double(), c.double(), k.double(), scale, sl)


def run_decode(lay, pool, bt, sl, H, SQ, scale=0.125, seed=1, **md_kw):
    g = torch.Generator().manual_seed(seed)
    B = bt.shape[0]
    qc = torch.randn(B, SQ, H, D_C, generator=g).to(DEV, torch.bfloat16)
    qr = torch.randn(B, SQ, H, D_R, generator=g).to(DEV, torch.bfloat16)
    out = torch.full((B, SQ, H, D_C), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse = torch.full((B, SQ, H), float("nan"), device=DEV)
    md = get_mla_metadata(sl, H, SQ, lay, **md_kw)
    o, l = mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, scale, metadata=md, out=out, lse=lse)
    ro, rl = reference(lay, pool, bt, sl, qc, qr, scale)
    return o, l, ro, rl, md


def check(o, l, ro, rl, tol=2e-2):
    assert not torch.isnan(o).any(), "unwritten (NaN-poisoned) output elements"
    assert not torch.isnan(l).any(), "unwritten (NaN-poisoned) lse elements"
    empty = torch.isinf(rl)
    assert torch.equal(torch.isinf(l).cpu(), empty.cpu()), "rows that see no token must give lse = -inf"
    assert torch.all(o.float()[empty] == 0)
    rel = (o.double() - ro).norm() / ro.norm().clamp_min(1e-30)
    assert rel < tol, f"relative error {rel:.3g}"
    assert (l.double() - rl)[~empty].abs().max().item() < tol
