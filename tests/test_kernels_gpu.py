"""Full-shape kernel checks on the GPU (d_c 512, d_r 64, pages of 64 tokens): append bit-exact with the
torch writer; decode vs the fp32 torch reference at 16/32/64/128 heads, 1-4 query tokens, variable
lengths (empty, 1, page boundaries, odd, long), NaN-poisoned outputs, fresh random inputs per case;
the prefill kernel at DeepSeek head dims against fp64 (whole prompts, continued chunks, 16/128 heads). The
heads-as-M kernel's cases are in test_kernels_gpu_warpgroup.py, the shared helpers in helpers/gpu_decode.py.
Skipped without CUDA. Run: TRITON_INTERPRET=0 PYTHONPATH=src:lab pytest -v tests/test_kernels_gpu.py"""

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from helpers.gpu_decode import (  # noqa: E402
    D_C, D_R, FORMATS, LENS, PAGE, PAGE_FORMATS, check_decode, check_variant, errors_within_twice_bf16, fp64_error,
    kernel_config, make_cache, tokens_m_config, warpgroup_config)
from helpers.gpu_decode import kernels_api as _api  # noqa: E402
from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout  # noqa: E402
from quantmla.cache.paged import write_tokens  # noqa: E402
from quantmla.errors import UnsupportedFormatError  # noqa: E402
from quantmla.kernels import partials  # noqa: E402
from quantmla.quant import BF16, PathFormat  # noqa: E402


@pytest.mark.parametrize("name", list(FORMATS))
def test_append_bit_exact_full_shape(name):
    api = _api()
    fmt = FORMATS[name]
    lay = PageLayout(TokenLayout(D_C, D_R, fmt), PAGE)
    g = torch.Generator(device="cuda").manual_seed(len(name))
    start = torch.randint(0, 256, (100, lay.page_bytes), generator=g, device="cuda", dtype=torch.uint8)
    T = 5000
    slots = torch.randperm(100 * PAGE, generator=g, device="cuda")[:T]
    slots[::97] = -1
    x = (torch.randn(T, D_C, generator=g, device="cuda") * 3).to(torch.bfloat16)
    x[5, :128] = 0.75  # constant group
    r = (torch.randn(T, D_R, generator=g, device="cuda") * 20).to(torch.bfloat16)
    for n in (T, 13):  # a prefill chunk and a decode step's rows, at the default tiling and the others
        want = start.clone()
        write_tokens(want, lay, slots[:n], x[:n].float(), r[:n].float())
        for warps, apart in ((None, None), (1, True), (2, True), (1, False), (4, True)):
            pages = start.clone()
            api.append_to_pages(pages, lay, slots[:n], x[:n], r[:n], num_warps=warps, paths_apart=apart)
            bad = (pages != want).sum().item()
            assert bad == 0, f"{n} tokens, {warps} warps, apart {apart}: {bad} bytes differ"


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


@pytest.mark.parametrize("name", ["int4/int4", "int2/int4", "fp8"])
@pytest.mark.parametrize("page", [64, 128, 256])
def test_decode_cuda_tokens_m_page_sizes(name, page):
    """Pages of one tile (a stage is one bulk copy of the page where the plan takes WHOLE_PAGE: INT4/INT4 and FP8) and
    of two and four (a copy a section, from any quarter or half of a page) against the same oracle, with the default
    plan for 16 rows."""
    lay, pages, bt, sl = make_cache(FORMATS[name], LENS, seed=page + len(name), page=page)
    md = check_decode(lay, pages, bt, sl, 16, 1, seed=page, config=tokens_m_config(lay, 16))
    assert md.variant.startswith("cuda/f16/tm/"), md.variant


@pytest.mark.parametrize("ctas", [2, 1])
@pytest.mark.parametrize("H,SQ", [(16, 1), (8, 2), (5, 3), (1, 1)])
def test_decode_cuda_tokens_m_fp8(H, SQ, ctas):
    """FP8 (fp8_ds_mla) on the tokens-as-M kernel (e4m3 widened to fp16 in the products' operands, the RoPE key on
    bf16 products) against the same oracle, as the integer formats above, at two CTAs an SM (2 stages) and at one
    (4 stages: opt-in, cuda_config(..., ctas_per_sm=1))."""
    lay, pages, bt, sl = make_cache(FORMATS["fp8"], LENS, seed=19 * H + SQ + (ctas == 1))
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + 11 * SQ, config=tokens_m_config(lay, H * SQ,
                                                                                         {"ctas_per_sm": ctas}))
    assert md.variant.startswith("cuda/f16/tm/M16N64w4s"), md.variant
    assert md.config.num_stages == (4 if ctas == 1 else 2), md.config


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
        md.lengths = None  # units dealt to the real lengths here, as a graph bucket's are
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
    plans = [lambda lay, w=w: tokens_m_config(lay, 16, w) for w in TM_WARPS + [S8]]
    errors_within_twice_bf16("tokens_m", [(n, FORMATS[n], plans) for n in ("int4/int4", "int2/int4")]
                             + [("fp8", FORMATS["fp8"], [lambda lay: tokens_m_config(lay, 16)])])




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
    """Page metadata per block of 16 tokens: the default config is the built-tile CUDA kernel's, whose stage holds the
    sets of its tile's tokens, and each token reads its block's set against the same oracle."""
    fmt = CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page", block=16))
    lay, pages, bt, sl = make_cache(fmt, LENS, seed=13 * H + SQ)
    md = check_decode(lay, pages, bt, sl, H, SQ, seed=H + SQ, config=_api().default_config(H * SQ, lay, "cuda"))
    check_variant(md, "cuda")


@pytest.mark.parametrize("kernel", ["cuda", "triton"])
@pytest.mark.parametrize("H", [16, 128])
def test_decode_many_splits_and_one_split(kernel, H):
    lay, pages, bt, sl = make_cache(FORMATS["int4/int4"], [20000, 3, 511], seed=H)
    cfg = kernel_config(kernel, lay, H, 1)
    check_decode(lay, pages, bt, sl, H, 1, seed=1, config=cfg, chunk_tokens=64)  # ~300 splits, combine kernel
    check_decode(lay, pages, bt, sl, H, 1, seed=2, config=cfg, chunk_tokens=1 << 20)  # no split: direct write




@pytest.mark.parametrize("kernel,H,lo,hi", [("triton", 16, 2e4, 1.8e5), ("triton", 128, 2e4, 1.8e5),
                                            ("built-tile", 16, 3e4, 6.4e4), ("heads-m", 128, 3e4, 6.4e4),
                                            ("tokens-m", 16, 1e3, 4.5e3)])
def test_decode_fp16_partials_hold_latents_past_fp16s_range(kernel, H, lo, hi, monkeypatch):
    """INT4/INT4 splits write fp16 partials times 2^-5 (QUANTMLA_PARTIALS=fp16, partials.partial_dtype), merged by the
    combine times 2^5. Triton (a bf16 tile) reads latents of 2e4 to 1.8e5 (fp16 metadata: zero about 2e4, scale about
    1e4), whose partials pass fp16's 65504 and must come back finite and right. The other kernels have narrower latents
    of their own, so there the test checks that the shift is written and undone: the built tile and the heads-as-M
    kernel build an fp16 tile (latents under 65504: 3e4 to 6.4e4), and the tokens-as-M kernel keeps P·scale in fp16
    with P up to 2^8 (a group's scale under 256: latents of 1e3 to 4.5e3). Split units throughout; the queries are
    scaled down so that scores stay near 1."""
    monkeypatch.setenv("QUANTMLA_PARTIALS", "fp16")
    lay, pages, bt, sl = make_cache(FORMATS["int4/int4"], [3000, 1, 700], seed=H + 5, latent_range=(lo, hi))
    assert partials.partial_dtype(lay) == torch.float16
    if kernel == "tokens-m":
        cfg = tokens_m_config(lay, H)
    elif kernel == "heads-m":
        cfg = warpgroup_config(lay, H)
    elif kernel == "built-tile":
        from quantmla.kernels.cuda.build import nvcc
        from quantmla.kernels.schedule import cuda_config

        if nvcc() is None:
            pytest.skip("no nvcc: the CUDA kernel cannot be built here")
        cfg = cuda_config(H, lay, "cuda", tokens_m=False)
        assert cfg is not None and not cfg.tokens_m and not cfg.warpgroup
    else:
        cfg = kernel_config("triton", lay, H, 1)
    md = check_decode(lay, pages, bt, sl, H, 1, seed=3, config=cfg, chunk_tokens=256,
                      row_scale=torch.full((H,), 1e-4, device="cuda"))
    po, _ = md.partials(H, D_C, torch.float16, pages.device)  # the call's workspace (the API's key)
    assert md.max_splits > 1 and po.dtype == torch.float16 and sum(isinstance(k, tuple) for k in md.workspace) == 1
    check_variant(md, "triton" if kernel == "triton" else "cuda")
    tag = {"tokens-m": "/tm/", "heads-m": "/wg/", "built-tile": "cuda/f16/M"}.get(kernel)
    assert tag is None or tag in md.variant, md.variant


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
