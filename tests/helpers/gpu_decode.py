"""What the GPU kernel tests share: the cache formats they run, a cache of random tokens at random pages, one decode
call checked against the fp32 oracle over the cache's own dequantized values, the fp64 error of a call, and the
configs that ask for each CUDA kernel (skipping where nvcc is missing)."""

import math

import pytest
import torch

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout
from quantmla.cache.paged import gather_sequences, write_tokens
from quantmla.quant import BF16, PathFormat

D_C, D_R, PAGE = 512, 64, 64
FORMATS = {
    "bf16": CacheFormat(BF16, BF16),
    "int4/int4": CacheFormat(PathFormat(4, 128), PathFormat(4, 64)),
    "int2/int4": CacheFormat(PathFormat(2, 128), PathFormat(4, 64)),
    "fp8": CacheFormat(PathFormat(8, 128, "fp8", "float32"), BF16),
    "int4/int8": CacheFormat(PathFormat(4, 128), PathFormat(8, 64)),
    "int4/int4-g64/g32": CacheFormat(PathFormat(4, 64), PathFormat(4, 32)),
    "int2/int8-sym-bf16": CacheFormat(PathFormat(2, 64, "symmetric", "bfloat16"), PathFormat(8, 32, "symmetric")),
    "int2/int4-sym": CacheFormat(PathFormat(2, 128, "symmetric"), PathFormat(4, 64, "symmetric")),
}
PAGE_FORMATS = {  # the RoPE path grouped per page: written by the reference writer (no append kernel)
    "int4/int4-page": CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page")),
    "int2/int4-page-sym-g2": CacheFormat(PathFormat(2, 128), PathFormat(4, 2, "symmetric", grouping="page")),
    "int4/int4-page16": CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page", block=16)),
    "int2/int4-page4-sym-g2": CacheFormat(PathFormat(2, 128), PathFormat(4, 2, "symmetric", grouping="page", block=4)),
}
LENS = [0, 1, 63, 64, 65, 1023, 4097, 9999]


def kernels_api():
    from quantmla.kernels import api

    return api


def make_cache(fmt, lens, seed, grow=0.0, every=None, latent_range=None, page=PAGE, rope_scale=None):
    """Pages of random bytes holding `lens` tokens of random keys at random pages (`grow`: each token's values times
    1 + grow·position, so that scores rise along a sequence; `every` = (k, f): every k-th token's values times f;
    `latent_range` = (lo, hi): latent values uniform in [lo, hi) instead of normal; `page`: tokens a page;
    `rope_scale`: [D_R] factors, each RoPE channel's values times its own)."""
    api = kernels_api()
    lay = PageLayout(TokenLayout(D_C, D_R, fmt), page)
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_pages = sum(lay.pages_for(n) for n in lens) + 7
    pages = torch.randint(0, 256, (n_pages, lay.page_bytes), generator=g, device="cuda", dtype=torch.uint8)  # garbage
    perm = torch.randperm(n_pages, generator=g, device="cuda").to(torch.int32)
    width = max(lay.pages_for(n) for n in lens + [1])
    bt = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
    off = 0
    for b, n in enumerate(lens):
        p = lay.pages_for(n)
        bt[b, :p] = perm[off : off + p]
        off += p
        if n:
            pos = torch.arange(n, device="cuda")
            slots = bt[b].long()[pos // page] * page + pos % page
            x = torch.randn(n, D_C, generator=g, device="cuda") * 1.5 + 0.2
            if latent_range:
                lo, hi = latent_range
                x = lo + (hi - lo) * torch.rand(n, D_C, generator=g, device="cuda")
            r = torch.randn(n, D_R, generator=g, device="cuda") * 4
            if rope_scale is not None:
                r = r * rope_scale
            if grow:
                x, r = x * (1 + grow * pos[:, None]), r * (1 + grow * pos[:, None])
            if every:
                f = torch.where(pos % every[0] == 0, every[1], 1.0)[:, None]
                x, r = x * f, r * f
            if fmt.rope.per_page:  # whole pages at once: each page quantized over its tokens
                page_rope = {int(bt[b, i]): r[i * page: (i + 1) * page].bfloat16().float() for i in range(p)}
                write_tokens(pages, lay, slots, x.bfloat16().float(), r, page_rope=page_rope)
            else:
                api.append_to_pages(pages, lay, slots, x.to(torch.bfloat16), r.to(torch.bfloat16))
    return lay, pages, bt, torch.tensor(lens, dtype=torch.int32, device="cuda")


def check_decode(lay, pages, bt, sl, H, SQ, seed, config=None, chunk_tokens=None, tol=2e-2, row_scale=None,
                 lse_rel=False):
    """One decode call against the fp32 oracle over the cache's own dequantized values; `row_scale` [H] multiplies
    each head's query; `lse_rel`: the log-sum-exp's error relative to the size scores can reach in that row (past 1),
    scale·|q|·max|k|, for rows whose scores reach far beyond 1 (a 16-bit key moves a score by a fraction of that, and
    a sequence of one token has one score for its log-sum-exp, a sum of products that may cancel)."""
    api = kernels_api()
    g = torch.Generator(device="cuda").manual_seed(seed)
    B = bt.shape[0]
    f = 1.0 if row_scale is None else row_scale.view(1, 1, H, 1)
    qc = (torch.randn(B, SQ, H, D_C, generator=g, device="cuda") * f).to(torch.bfloat16)
    qr = (torch.randn(B, SQ, H, D_R, generator=g, device="cuda") * f).to(torch.bfloat16)
    out = torch.full((B, SQ, H, D_C), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, SQ, H), float("nan"), device="cuda")
    scale = 1 / math.sqrt(192)
    md = api.get_mla_metadata(sl, H, SQ, lay, config=config, chunk_tokens=chunk_tokens)
    api.mla_decode_with_kvcache(qc, qr, pages, bt, sl, lay, scale, metadata=md, out=out, lse=lse)
    lat, kr = gather_sequences(pages, lay, bt, sl)
    ro, rl = __import__("quantmla.reference.absorbed", fromlist=["x"]).absorbed_attention(
        qc.float(), qr.float(), lat, kr, scale, sl, compute_dtype=torch.float32
    )
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten output (NaN poison survived)"
    empty = torch.isinf(rl)
    assert torch.equal(torch.isinf(lse), empty)
    assert torch.all(out.float()[empty] == 0)
    rel = ((out.float() - ro).norm() / ro.norm()).item()
    lerr = (lse - rl).abs()
    if lse_rel:  # [B, SQ, H] / (scale · |q| · the sequence's largest key norm)
        kmax = torch.cat([lat, kr], -1).norm(dim=-1).amax(-1)
        bound = scale * torch.cat([qc, qr], -1).float().norm(dim=-1) * kmax.view(-1, 1, 1)
        lerr = lerr / bound.clamp(min=1)
    lerr = lerr[~empty].max().item()
    print(f"{md.config.describe()} variant={md.variant} units={md.num_units} rel={rel:.2e} lse_err={lerr:.2e}")
    assert rel < tol and lerr < tol, (rel, lerr)
    return md



def kernel_config(kernel, lay, H, SQ):
    """The CUDA kernel's config, or the Triton kernel's default tiling."""
    if kernel == "cuda":
        from quantmla.kernels.cuda.build import nvcc

        if nvcc() is None:
            pytest.skip("no nvcc: the CUDA kernel cannot be built here")
        from quantmla.kernels.schedule import cuda_config

        return cuda_config(H * SQ, lay, "cuda")
    return kernels_api().default_config(H * SQ, lay)  # no device: Triton's GPU tilings


def check_variant(md, kernel):
    """The kernel asked for is the one that ran (a failed build would fall back with only a warning)."""
    assert md.variant is not None and md.variant.startswith("cuda/") == (kernel == "cuda"), (md.variant, kernel)


def tokens_m_config(lay, rows, plan=None):
    """The tokens-as-M kernel's config; `plan` (cuda_config's token_blocks) asks for one of its plans."""
    from quantmla.kernels.cuda.build import nvcc
    from quantmla.kernels.schedule import cuda_config

    if nvcc() is None:
        pytest.skip("no nvcc: the CUDA kernel cannot be built here")
    cfg = cuda_config(rows, lay, "cuda", tokens_m=True, **(plan or {}))
    assert cfg is not None and cfg.tokens_m, __import__("quantmla.kernels.cuda", fromlist=["x"]).plan_reason.get(lay)
    for k, v in (plan or {}).items():
        assert getattr(cfg, k) == v, (k, cfg)
    return cfg


def warpgroup_config(lay, rows, seesaw=False):
    """The heads-as-M kernel's config (mla_decode_wg.cu: the query rows as the M of warpgroup MMAs; `seesaw`: its
    warpgroups out of phase, mla_decode_seesaw.cu)."""
    from quantmla.kernels.cuda.build import nvcc
    from quantmla.kernels.schedule import cuda_config

    if nvcc() is None:
        pytest.skip("no nvcc: the CUDA kernel cannot be built here")
    cfg = cuda_config(rows, lay, "cuda", warpgroup=True, seesaw=seesaw)
    assert cfg is not None and cfg.warpgroup and cfg.seesaw == seesaw, __import__("quantmla.kernels.cuda", fromlist=["x"]).plan_reason.get(lay)
    return cfg


def fp64_error(lay, pages, bt, sl, H, seed, config):
    """Relative error of the decode output against fp64 attention over the same dequantized cache."""
    api = kernels_api()
    g = torch.Generator(device="cuda").manual_seed(seed)
    B = bt.shape[0]
    qc = (torch.randn(B, H, D_C, generator=g, device="cuda") * 0.3).to(torch.bfloat16)
    qr = (torch.randn(B, H, D_R, generator=g, device="cuda") * 0.3).to(torch.bfloat16)
    scale = 1 / math.sqrt(192)
    md = api.get_mla_metadata(sl, H, 1, lay, config=config)
    out, _ = api.mla_decode_with_kvcache(qc, qr, pages, bt, sl, lay, scale, metadata=md)
    lat, kr = gather_sequences(pages, lay, bt, sl)
    ro, _ = __import__("quantmla.reference.absorbed", fromlist=["x"]).absorbed_attention(
        qc.double().unsqueeze(1), qr.double().unsqueeze(1), lat.double(), kr.double(), scale, sl,
        compute_dtype=torch.float64)
    ro = ro.squeeze(1)
    return ((out.double() - ro).norm() / ro.norm()).item(), md


def errors_within_twice_bf16(label, runs):
    """Each run's error against fp64 over its own dequantized cache (8 sequences of 4096 tokens, 16 heads), within 2x
    the BF16 path's (the default CUDA kernel on a BF16 cache). `runs`: (name, format, [config_of(layout), ...]); each
    run's decode must take a tokens-as-M plan. Returns the errors by name (a config's index after the name)."""
    errs = {}
    lay, pages, bt, sl = make_cache(FORMATS["bf16"], [4096] * 8, seed=21)
    errs["bf16"], _ = fp64_error(lay, pages, bt, sl, 16, 22, kernel_config("cuda", lay, 16, 1))
    for name, fmt, configs in runs:
        lay, pages, bt, sl = make_cache(fmt, [4096] * 8, seed=21)
        for i, config_of in enumerate(configs):
            errs[f"{name} {i}"], md = fp64_error(lay, pages, bt, sl, 16, 22, config_of(lay))
            assert md.variant.startswith("cuda/f16/tm/"), md.variant
    print(label, {k: f"{v:.2e}" for k, v in errs.items()})
    for name, e in errs.items():
        assert e <= 2 * errs["bf16"], (name, e, errs["bf16"])
    return errs
