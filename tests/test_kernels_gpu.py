"""Full-shape kernel checks on the GPU (d_c 512, d_r 64, pages of 64 tokens): append bit-exact with the
torch writer; decode vs the fp32 torch reference at 16/32/64/128 heads, 1-4 query tokens, variable
lengths (empty, 1, page boundaries, odd, long), NaN-poisoned outputs, fresh random inputs per case;
the prefill kernel at DeepSeek head dims against fp64 (whole prompts, continued chunks, 16/128 heads).
Skipped without CUDA. Run: TRITON_INTERPRET=0 PYTHONPATH=src:lab pytest -v tests/test_kernels_gpu.py"""

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout  # noqa: E402
from quantmla.cache.paged import gather_sequences, write_tokens  # noqa: E402
from quantmla.errors import UnsupportedFormatError  # noqa: E402
from quantmla.quant import BF16, PathFormat  # noqa: E402

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
}
LENS = [0, 1, 63, 64, 65, 1023, 4097, 9999]


def _api():
    from quantmla.kernels import api

    return api


def make_cache(fmt, lens, seed, grow=0.0, every=None):
    """Pages of random bytes holding `lens` tokens of random keys at random pages (`grow`: each token's values times
    1 + grow·position, so that scores rise along a sequence; `every` = (k, f): every k-th token's values times f)."""
    api = _api()
    lay = PageLayout(TokenLayout(D_C, D_R, fmt), PAGE)
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
            slots = bt[b].long()[pos // PAGE] * PAGE + pos % PAGE
            x = torch.randn(n, D_C, generator=g, device="cuda") * 1.5 + 0.2
            r = torch.randn(n, D_R, generator=g, device="cuda") * 4
            if grow:
                x, r = x * (1 + grow * pos[:, None]), r * (1 + grow * pos[:, None])
            if every:
                f = torch.where(pos % every[0] == 0, every[1], 1.0)[:, None]
                x, r = x * f, r * f
            if fmt.rope.per_page:  # whole pages at once: each page quantized over its tokens
                page_rope = {int(bt[b, i]): r[i * PAGE: (i + 1) * PAGE].bfloat16().float() for i in range(p)}
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
    api = _api()
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


@pytest.mark.parametrize("name", list(FORMATS))
def test_append_bit_exact_full_shape(name):
    api = _api()
    fmt = FORMATS[name]
    lay = PageLayout(TokenLayout(D_C, D_R, fmt), PAGE)
    g = torch.Generator(device="cuda").manual_seed(len(name))
    pages = torch.randint(0, 256, (100, lay.page_bytes), generator=g, device="cuda", dtype=torch.uint8)
    ref = pages.clone()
    T = 5000
    slots = torch.randperm(100 * PAGE, generator=g, device="cuda")[:T]
    slots[::97] = -1
    x = (torch.randn(T, D_C, generator=g, device="cuda") * 3).to(torch.bfloat16)
    x[5, :128] = 0.75  # constant group
    r = (torch.randn(T, D_R, generator=g, device="cuda") * 20).to(torch.bfloat16)
    api.append_to_pages(pages, lay, slots, x, r)
    write_tokens(ref, lay, slots, x.float(), r.float())
    assert torch.equal(pages, ref), f"{(pages != ref).sum().item()} bytes differ"


def kernel_config(kernel, lay, H, SQ):
    """The CUDA kernel's config, or the Triton kernel's default tiling."""
    if kernel == "cuda":
        from quantmla.kernels.cuda.build import nvcc

        if nvcc() is None:
            pytest.skip("no nvcc: the CUDA kernel cannot be built here")
        from quantmla.kernels.schedule import cuda_config

        return cuda_config(H * SQ, lay, "cuda")
    return _api().default_config(H * SQ, lay)  # no device: Triton's GPU tilings


def check_variant(md, kernel):
    """The kernel asked for is the one that ran (a failed build would fall back with only a warning)."""
    assert md.variant is not None and md.variant.startswith("cuda/") == (kernel == "cuda"), (md.variant, kernel)


@pytest.mark.parametrize("kernel", ["cuda", "triton"])
@pytest.mark.parametrize("name", ["bf16", "int4/int4", "int2/int4", "int4/int8", "fp8"])
@pytest.mark.parametrize("H", [16, 32, 64, 128])
@pytest.mark.parametrize("SQ", [1, 2, 4])
def test_decode_full_shape(kernel, name, H, SQ):
    lay, pages, bt, sl = make_cache(FORMATS[name], LENS, seed=H * 10 + SQ)
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + SQ, config=kernel_config(kernel, lay, H, SQ))
    check_variant(md, kernel)


@pytest.mark.parametrize("name", ["bf16", "int4/int4"])
def test_decode_cuda_query_views_off_16_bytes(name):
    """The CUDA kernel reads queries in 16-byte pieces: views that start one element past a 16-byte
    boundary give the same output and log-sum-exp as contiguous queries, bit for bit."""
    api = _api()
    lay, pages, bt, sl = make_cache(FORMATS[name], [1, 65, 4097], seed=11)
    B, SQ, H = 3, 1, 16
    cfg = kernel_config("cuda", lay, H, SQ)
    g = torch.Generator(device="cuda").manual_seed(3)
    qs = [torch.randn(B, SQ, H, d, generator=g, device="cuda").to(torch.bfloat16) for d in (D_C, D_R)]
    views = []
    for q in qs:
        v = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
        v.copy_(q)
        assert v.data_ptr() % 16 != 0
        views.append(v)
    md = api.get_mla_metadata(sl, H, SQ, lay, config=cfg)
    out, lse = api.mla_decode_with_kvcache(*qs, pages, bt, sl, lay, 0.07, metadata=md)
    check_variant(md, "cuda")
    out_v, lse_v = api.mla_decode_with_kvcache(*views, pages, bt, sl, lay, 0.07, metadata=md)
    assert torch.equal(out, out_v) and torch.equal(lse, lse_v)


@pytest.mark.parametrize("tiling", [(16, 32), (16, 64), (8, 64)])
@pytest.mark.parametrize("name", ["bf16", "int4/int4", "int2/int4", "fp8"])
@pytest.mark.parametrize("H,SQ", [(16, 1), (16, 3), (128, 1)])
def test_decode_cuda_tilings(tiling, name, H, SQ):
    """The CUDA kernel's other tilings (warps per CTA x tokens per tile) against the same fp64 oracle."""
    from quantmla.kernels.cuda.build import nvcc
    from quantmla.kernels.schedule import cuda_config

    if nvcc() is None:
        pytest.skip("no nvcc: the CUDA kernel cannot be built here")
    lay, pages, bt, sl = make_cache(FORMATS[name], LENS, seed=7 * H + SQ)
    cfg = cuda_config(H * SQ, lay, "cuda", num_warps=tiling[0], block_n=tiling[1])
    if cfg is None:  # 64-token BF16 tiles of 64 rows exceed shared memory: refused, with the reason
        from quantmla.kernels.cuda import plan_reason

        assert tiling[1] == 64 and "shared memory" in plan_reason[lay], plan_reason.get(lay)
        return
    assert (cfg.num_warps, cfg.block_n) == tiling
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + 3 * SQ, config=cfg)
    assert md.variant.startswith("cuda/") and f"N{tiling[1]}w{tiling[0]}" in md.variant, md.variant
    assert ("ws" in md.variant) == (tiling == (16, 32) and name != "bf16" and H * SQ <= 16), md.variant


@pytest.mark.parametrize("name", ["int4/int4", "int2/int4", "int4/int4-g64/g32", "int2/int4-sym"])
@pytest.mark.parametrize("H,SQ", [(16, 1), (8, 2), (5, 3)])
def test_decode_cuda_fragments(name, H, SQ):
    """The codes read straight into the products' operands (no built tile) against the same fp64 oracle;
    the garbage bytes past a partial last tile (the pages start random) never reach the output."""
    from quantmla.kernels.cuda.build import nvcc
    from quantmla.kernels.schedule import cuda_config

    if nvcc() is None:
        pytest.skip("no nvcc: the CUDA kernel cannot be built here")
    lay, pages, bt, sl = make_cache(FORMATS[name], LENS, seed=11 * H + SQ)
    cfg = cuda_config(H * SQ, lay, "cuda", fragments=True)
    assert cfg is not None and cfg.fragments, __import__("quantmla.kernels.cuda", fromlist=["x"]).plan_reason.get(lay)
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + 5 * SQ, config=cfg)
    assert md.variant.startswith("cuda/f16/frag/"), md.variant


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


# the tokens-as-M plans: a warp's scores over one block of 16 tokens, or two warps' over two blocks; and the
# scores' and output's warps apart (8 warps), two CTAs an SM (128 registers) or one
TM_WARPS = [{"token_blocks": 1, "specialized": False}, {"token_blocks": 2, "specialized": False},
            {"token_blocks": 1, "specialized": True},
            {"token_blocks": 2, "specialized": True, "ctas_per_sm": 1}]
TM_IDS = ["t1", "t2", "ws", "t2ws1"]


S8 = {"token_blocks": 1, "specialized": True, "s8_scores": True}  # the scores on 8-bit warpgroup MMAs


def tm_variant(warps: dict) -> str:
    """The piece of a tokens-as-M plan's description that names its warps, e.g. "w4t2s", "w8wss" or "w8wsqs"."""
    ws = warps.get("specialized", False)
    s8 = "q" if warps.get("s8_scores") else ""
    return f"w{8 if ws else 4}{'t2' if warps['token_blocks'] == 2 else ''}{'ws' if ws else ''}{s8}s"


@pytest.mark.parametrize("name,warps", [pytest.param(n, w, id=f"{n}-{i}") for n in ("int4/int4", "int2/int4", "int4/int4-g64/g32")
                                        for w, i in zip(TM_WARPS, TM_IDS)
                                        if not (w.get("specialized") and n.endswith("g64/g32"))]  # (refused: no room)
                                       + [pytest.param(n, S8, id=f"{n}-s8") for n in ("int4/int4", "int2/int4")])
@pytest.mark.parametrize("H,SQ", [(16, 1), (8, 2), (5, 3), (1, 1)])
def test_decode_cuda_tokens_m(name, H, SQ, warps):
    """Tokens as the MMA's M dimension (mla_decode_tm.cu) against the same fp32 oracle: NaN-poisoned outputs,
    lengths 0, 1, odd and across pages, causal multi-token rows; the garbage bytes past a partial last tile
    (the pages start random) never reach the output."""
    lay, pages, bt, sl = make_cache(FORMATS[name], LENS, seed=13 * H + SQ)
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + 7 * SQ, config=tokens_m_config(lay, H * SQ, warps))
    assert md.variant.startswith("cuda/f16/tm/"), md.variant
    assert tm_variant(warps) in md.variant, md.variant


@pytest.mark.parametrize("H,SQ", [(16, 1), (8, 2), (5, 3), (1, 1)])
def test_decode_cuda_tokens_m_fp8(H, SQ):
    """FP8 (fp8_ds_mla) on the tokens-as-M kernel (e4m3 widened to fp16 in the products' operands, the RoPE key on
    bf16 products) against the same oracle, as the integer formats above."""
    lay, pages, bt, sl = make_cache(FORMATS["fp8"], LENS, seed=19 * H + SQ)
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + 11 * SQ, config=tokens_m_config(lay, H * SQ))
    assert md.variant.startswith("cuda/f16/tm/M16N64w4s"), md.variant


@pytest.mark.parametrize("warps", TM_WARPS + [S8], ids=TM_IDS + ["s8"])
def test_decode_cuda_tokens_m_query_ranges(warps):
    """Heads whose queries span 2^-12 to 2^2 (products down to fp16's subnormals, summed in fp32) and one head
    of zeros (uniform attention), against the same oracle."""
    lay, pages, bt, sl = make_cache(FORMATS["int4/int4"], [700, 64, 1], seed=29)
    scales = torch.tensor([2.0 ** e for e in range(-12, 3)] + [0.0], device="cuda")
    md = check_decode(lay, pages, bt, sl, 16, 1, seed=3, config=tokens_m_config(lay, 16, warps), row_scale=scales)
    assert md.variant.startswith("cuda/f16/tm/"), md.variant


@pytest.mark.parametrize("name,warps", [pytest.param(n, w, id=f"{n}-{i}") for n in ("int4/int4", "int2/int4")
                                        for w, i in zip(TM_WARPS, TM_IDS)]
                                       + [pytest.param("fp8", TM_WARPS[0], id="fp8-t1"),
                                          pytest.param("int4/int4", S8, id="int4/int4-s8"),
                                          pytest.param("int2/int4", S8, id="int2/int4-s8")])
def test_decode_cuda_tokens_m_splits(name, warps):
    """Hundreds of splits a sequence (partials through the combine kernel), and one split (direct write)."""
    lay, pages, bt, sl = make_cache(FORMATS[name], [20000, 3, 511], seed=17)
    cfg = tokens_m_config(lay, 16, warps)
    check_decode(lay, pages, bt, sl, 16, 1, seed=1, config=cfg, chunk_tokens=64)
    check_decode(lay, pages, bt, sl, 16, 1, seed=2, config=cfg, chunk_tokens=1 << 20)


def launch_bucket_units(name: str, launches: int, splits: int = 16) -> None:
    """The engine's graph-bucket schedule on the tokens-as-M kernel with its warps apart: 64 sequences of 0 to 700
    tokens in a bucket of `splits` units a row, dealt out by length, so that most units are empty (the engine's
    `bucket_schedule`), launched `launches` times. The outputs must equal the 4-warp plan's bit for bit."""
    from quantmla.serving.triton_backend import bucket_schedule

    api = _api()
    lens = [0, 1, 63, 700] * 16
    lay, pages, bt, sl = make_cache(FORMATS[name], lens, seed=23)
    bt = torch.nn.functional.pad(bt, (0, 1024 // PAGE - bt.shape[1]))  # the bucket's rows: pages for 1024 tokens
    g = torch.Generator(device="cuda").manual_seed(5)
    qc = torch.randn(len(lens), 1, 16, D_C, generator=g, device="cuda").to(torch.bfloat16)
    qr = torch.randn(len(lens), 1, 16, D_R, generator=g, device="cuda").to(torch.bfloat16)
    outs = {}
    for ws in (False, True):
        cfg = tokens_m_config(lay, 16, {"token_blocks": 1, "specialized": ws})
        md = api.get_mla_metadata(torch.full_like(sl, 1024), 16, 1, lay, config=cfg, chunk_tokens=1024 // splits)
        units, info = (torch.from_numpy(a) for a in bucket_schedule(sl.cpu().numpy(), md.num_units, 64, 64))
        assert md.num_units == len(lens) * splits and (units[:, 1] == units[:, 2]).float().mean() > 0.7
        md.units.copy_(units.to(torch.int32))
        md.seq_info.copy_(info.to(torch.int32))
        out = torch.full((len(lens), 1, 16, D_C), float("nan"), dtype=torch.bfloat16, device="cuda")
        for _ in range(launches if ws else 1):
            api.mla_decode_with_kvcache(qc, qr, pages, bt, sl, lay, 1 / math.sqrt(192), metadata=md, out=out)
        torch.cuda.synchronize()
        assert (ws and "w8wss" in md.variant) or (not ws and "w4s" in md.variant), md.variant
        outs[ws] = out
    assert torch.equal(outs[True], outs[False]) and not outs[True].isnan().any()
    assert torch.all(outs[True][sl == 0] == 0)


@pytest.mark.parametrize("name", ["int4/int4", "int2/int4"])
def test_decode_cuda_tokens_m_warps_apart_finish_on_empty_units(name):
    """Units without tiles (the engine's graph buckets are mostly such) never leave a CTA waiting: the output warps
    take their registers back only after the scores' warps have given theirs. Run in a process of its own, so that a
    kernel that hangs fails the test instead of stopping the suite."""
    import subprocess
    import sys
    from pathlib import Path

    code = f"import test_kernels_gpu as t; t.launch_bucket_units({name!r}, 300)"
    here = Path(__file__).parent
    env = {**__import__("os").environ, "PYTHONPATH": f"{here}:{here.parent / 'src'}:{here.parent / 'lab'}"}
    try:
        r = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the tokens-as-M kernel with its warps apart did not finish 300 launches over empty units in 240 s")
    assert r.returncode == 0, r.stderr[-3000:]


def test_decode_cuda_tokens_m_error_within_twice_bf16():
    """Against fp64 over its own dequantized cache, each format's tokens-as-M error (4- and 8-warp CTAs) is within
    2x the BF16 path's (the default CUDA kernel on a BF16 cache)."""
    errs = {}
    lay, pages, bt, sl = make_cache(FORMATS["bf16"], [4096] * 8, seed=21)
    errs["bf16"], _ = fp64_error(lay, pages, bt, sl, 16, 22, kernel_config("cuda", lay, 16, 1))
    for name in ("int4/int4", "int2/int4"):
        lay, pages, bt, sl = make_cache(FORMATS[name], [4096] * 8, seed=21)
        for w, wid in zip(TM_WARPS + [S8], TM_IDS + ["s8"]):
            errs[f"{name} {wid}"], md = fp64_error(lay, pages, bt, sl, 16, 22, tokens_m_config(lay, 16, w))
            assert md.variant.startswith("cuda/f16/tm/"), md.variant
    lay, pages, bt, sl = make_cache(FORMATS["fp8"], [4096] * 8, seed=21)
    errs["fp8"], md = fp64_error(lay, pages, bt, sl, 16, 22, tokens_m_config(lay, 16))
    assert md.variant.startswith("cuda/f16/tm/"), md.variant
    print("tokens_m", {k: f"{v:.2e}" for k, v in errs.items()})
    for name, e in errs.items():
        assert e <= 2 * errs["bf16"], (name, e, errs["bf16"])


def warpgroup_config(lay, rows):
    """The heads-as-M kernel's config (mla_decode_wg.cu: the query rows as the M of warpgroup MMAs)."""
    from quantmla.kernels.cuda.build import nvcc
    from quantmla.kernels.schedule import cuda_config

    if nvcc() is None:
        pytest.skip("no nvcc: the CUDA kernel cannot be built here")
    cfg = cuda_config(rows, lay, "cuda", warpgroup=True)
    assert cfg is not None and cfg.warpgroup, __import__("quantmla.kernels.cuda", fromlist=["x"]).plan_reason.get(lay)
    return cfg


@pytest.mark.parametrize("H,SQ", [(128, 1), (64, 1), (128, 2), (64, 4), (16, 4), (40, 3)])
def test_decode_cuda_warpgroup(H, SQ):
    """Heads as the M of warpgroup MMAs (mla_decode_wg.cu, BF16) against the same fp32 oracle: NaN-poisoned outputs,
    lengths 0, 1, odd and across pages, causal multi-token rows, row blocks past the last row (40 x 3 = 120 rows in
    two 64-row blocks); the garbage bytes past a partial last tile (the pages start random) never reach the output."""
    lay, pages, bt, sl = make_cache(FORMATS["bf16"], LENS, seed=23 * H + SQ)
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + 13 * SQ, config=warpgroup_config(lay, H * SQ))
    assert md.variant.startswith("cuda/bf16/wg/M64N64w8s2c1"), md.variant


def test_decode_cuda_warpgroup_splits():
    """Hundreds of splits a sequence (partials through the combine kernel), and one split (direct write)."""
    lay, pages, bt, sl = make_cache(FORMATS["bf16"], [20000, 3, 511], seed=31)
    cfg = warpgroup_config(lay, 128)
    check_decode(lay, pages, bt, sl, 128, 1, seed=1, config=cfg, chunk_tokens=64)
    check_decode(lay, pages, bt, sl, 128, 1, seed=2, config=cfg, chunk_tokens=1 << 20)


def test_decode_cuda_warpgroup_error_within_bf16_paths():
    """Against fp64, the heads-as-M kernel's error at 128 heads is within 1.5x the Triton BF16 kernel's (both round P
    to bf16 and accumulate in fp32)."""
    lay, pages, bt, sl = make_cache(FORMATS["bf16"], [4096] * 4, seed=37)
    wg, md = fp64_error(lay, pages, bt, sl, 128, 22, warpgroup_config(lay, 128))
    assert md.variant.startswith("cuda/bf16/wg/"), md.variant
    tri, md = fp64_error(lay, pages, bt, sl, 128, 22, kernel_config("triton", lay, 128, 1))
    assert not md.variant.startswith("cuda/"), md.variant
    print(f"warpgroup {wg:.2e}, triton {tri:.2e}")
    assert wg <= 1.5 * tri, (wg, tri)


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


@pytest.mark.parametrize("name", ["bf16", "int4/int4", "int2/int4", "fp8"])
def test_decode_cuda_warpgroup_rising_scores(name):
    """Scores that rise along each sequence (keys scaled by 1 + position/256, to about 60 in base 2 at 10K tokens):
    the rows' reference maxima move many times, by more and by less than the 2^8 slack they keep before the output
    is rescaled, and the outputs still match the oracle, with hundreds of splits and with one."""
    lay, pages, bt, sl = make_cache(FORMATS[name], [9999, 4097, 700, 65], seed=47, grow=1 / 256)
    cfg = warpgroup_config(lay, 128)
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


@pytest.mark.parametrize("kernel", ["cuda", "triton"])
@pytest.mark.parametrize("name", ["int4/int4-g64/g32", "int2/int8-sym-bf16"])
def test_decode_other_formats(kernel, name):
    lay, pages, bt, sl = make_cache(FORMATS[name], LENS, seed=5)
    for H, seed in ((16, 6), (128, 7), (5, 8)):
        check_variant(check_decode(lay, pages, bt, sl, H, 1, seed=seed, config=kernel_config(kernel, lay, H, 1)), kernel)


@pytest.mark.parametrize("kernel", ["cuda", "triton"])
@pytest.mark.parametrize("name", list(PAGE_FORMATS))
@pytest.mark.parametrize("H,SQ", [(16, 1), (16, 3), (128, 1)])
def test_decode_page_rope(kernel, name, H, SQ):
    """A RoPE path grouped per page (the page's channel scales and zero points) against the same oracle."""
    lay, pages, bt, sl = make_cache(PAGE_FORMATS[name], LENS, seed=11 * H + SQ)
    check_variant(check_decode(lay, pages, bt, sl, H, SQ, seed=H + SQ, config=kernel_config(kernel, lay, H, SQ)), kernel)


@pytest.mark.parametrize("H,SQ", [(16, 1), (16, 3), (128, 1)])
def test_decode_page_rope_blocks(H, SQ):
    """Page metadata per block of 16 tokens: the CUDA plans refuse it, so the default config is Triton's, which
    reads each token's block against the same oracle."""
    fmt = CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page", block=16))
    lay, pages, bt, sl = make_cache(fmt, LENS, seed=13 * H + SQ)
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + SQ, config=_api().default_config(H * SQ, lay, "cuda"))
    check_variant(md, "triton")


@pytest.mark.parametrize("kernel", ["cuda", "triton"])
@pytest.mark.parametrize("H", [16, 128])
def test_decode_many_splits_and_one_split(kernel, H):
    lay, pages, bt, sl = make_cache(FORMATS["int4/int4"], [20000, 3, 511], seed=H)
    cfg = kernel_config(kernel, lay, H, 1)
    check_decode(lay, pages, bt, sl, H, 1, seed=1, config=cfg, chunk_tokens=64)  # ~300 splits, combine kernel
    check_decode(lay, pages, bt, sl, H, 1, seed=2, config=cfg, chunk_tokens=1 << 20)  # no split: direct write


def fp64_error(lay, pages, bt, sl, H, seed, config):
    """Relative error of the decode output against fp64 attention over the same dequantized cache."""
    api = _api()
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


@pytest.mark.parametrize("kernel", ["cuda", "triton"])
def test_decode_error_within_twice_bf16(kernel):
    """Every format's kernel error (against fp64 over its own dequantized cache) is within 2x the BF16 path's:
    the quantized formats' arithmetic adds no error of its own beyond the 16-bit rounding BF16 has."""
    errs = {}
    for name in ("bf16", "fp8", "int4/int4", "int2/int4"):
        lay, pages, bt, sl = make_cache(FORMATS[name], [4096] * 8, seed=21)
        errs[name], md = fp64_error(lay, pages, bt, sl, 16, 22, kernel_config(kernel, lay, 16, 1))
        check_variant(md, kernel)
    print(kernel, {k: f"{v:.2e}" for k, v in errs.items()})
    for name, e in errs.items():
        assert e <= 2 * errs["bf16"], (name, e, errs["bf16"])


@pytest.mark.parametrize("name", ["bf16", "int4/int4", "int2/int4"])
@pytest.mark.parametrize("SQ", [1, 3])
def test_decode_transposed_orientation(name, SQ):
    api = _api()
    cfg = api.DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, orient="tokens")
    lay, pages, bt, sl = make_cache(FORMATS[name], LENS, seed=11 + SQ)
    check_decode(lay, pages, bt, sl, 16 // SQ if SQ == 1 else 5, SQ, seed=SQ, config=cfg)


@pytest.mark.parametrize("variant", ["generic-d0", "generic-d1", "fused-tl"])
def test_decode_kernel_variants(variant):
    api = _api()
    if variant == "fused-tl":
        cfg = api.DecodeConfig(block_m=16, block_n=64, num_warps=8, num_stages=3, kernel="fused", unpack="tl")
    else:
        cfg = api.DecodeConfig(block_m=16, block_n=32, num_warps=4, num_stages=2, kernel="generic", deq=int(variant[-1]))
    lay, pages, bt, sl = make_cache(FORMATS["int2/int4"], LENS, seed=3)
    md = check_decode(lay, pages, bt, sl, 16, 2, seed=4, config=cfg)
    # the variant asked for ran: a compile failure would fall back to another one, with only a warning
    want = f"fused/tl/{cfg.orient}" if variant == "fused-tl" else f"generic/d{variant[-1]}/s{cfg.num_stages}"
    assert md.variant == want, (md.variant, want)


def test_unsupported_formats_raise_before_launch():
    api = _api()
    for fmt in (CacheFormat(PathFormat(3, 64), BF16), CacheFormat(BF16, PathFormat(3, 32))):
        lay = PageLayout(TokenLayout(D_C, D_R, fmt), PAGE)
        with pytest.raises(UnsupportedFormatError):
            api.check_layout_supported(lay)


@pytest.mark.parametrize("n,T,H,cfg", [
    (1531, 1531, 16, None),  # a whole odd-length prompt, default tiling
    (300, 2100, 16, None),  # a chunk continuing a context
    (4500, 4500, 16, None),  # beyond 2048 queries: the other default tiling
    (700, 6000, 16, None),  # a short chunk after a long context: the other default tiling too
    (777, 1000, 128, "M128 N128 w8 s2"),  # DeepSeek-V3 head count, a swept tiling
    (1531, 1531, 16, "M64 N64 w4 s2 tma"),  # key blocks through tensor descriptors (bulk tensor copies)
    (700, 6000, 16, "M128 N64 w8 s3 tma"),
    (4500, 4500, 16, "M128 N64 w8 s3 one-loop tma"),
])
def test_prefill_full_shape(n, T, H, cfg):
    """The prefill kernel at DeepSeek head dims (d_n 128, d_r 64, d_v 128) against an fp64 reference on
    the same bf16 inputs, into a NaN-poisoned output, kv a strided view as from kv_b_proj."""
    api = _api()
    from quantmla.reference.prefill import prefill_attention

    config = api.PrefillConfig.parse(cfg) if cfg else None
    g = torch.Generator(device="cuda").manual_seed(n)
    q_nope = torch.randn(n, H, 128, device="cuda", generator=g).bfloat16()
    q_rope = torch.randn(n, H, 64, device="cuda", generator=g).bfloat16()
    kv = torch.randn(T, H, 256 + 16, device="cuda", generator=g).bfloat16()[..., :256]
    k_rope = torch.randn(T, 64, device="cuda", generator=g).bfloat16()
    out = torch.full((n, H, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    api.mla_prefill_attention(q_nope, q_rope, kv, k_rope, 192 ** -0.5, out=out, config=config)
    assert not out.isnan().any()
    for s in range(0, n, 512):  # fp64 reference in query blocks (memory)
        e = min(n, s + 512)
        ref = prefill_attention(q_nope[s:e], q_rope[s:e], kv[: T - n + e], k_rope[: T - n + e], 192 ** -0.5)
        rel = ((out[s:e].double() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, f"queries {s}..{e}: relative error {rel:.3g}"
