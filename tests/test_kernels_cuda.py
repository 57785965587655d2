"""The CUDA decode path's host side, without a GPU: which build a layout gets (tile type, row block,
stages that fit shared memory), why a layout is refused, and that every plan's source compiles with the
host's shared-memory map (mla_decode.cu asserts it equals its own) where nvcc is installed.
The kernel itself runs in tests/test_kernels_gpu.py; the API's choice among the plans is tested in
tests/test_decode_configs.py."""

from unittest import mock

import pytest
import torch
from helpers.cuda_plans import CUDA, plan

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout, preset
from quantmla.kernels import cuda
from quantmla.kernels.cuda import build
from quantmla.quant import BF16, PathFormat


def test_a_plan_is_made_once_a_process(monkeypatch):
    """decode_plan is a pure function of its arguments past the device: a second call returns the same plan without
    planning again, a refused plan says its reason again (another call may have replaced it), and the device is asked
    every time (a plan for sm_90 is not returned on sm_80)."""
    made = []
    real = cuda.tokens_m_plan
    monkeypatch.setattr(cuda, "tokens_m_plan", lambda *a, **k: made.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(cuda, "_PLANS", {})
    lay, p = plan("int4/int4", 16, tokens_m=True)
    assert plan("int4/int4", 16, tokens_m=True)[1] is p and made == [16]
    _, bad = plan("int4/int4", 32, tokens_m=True)
    assert bad is None and made == [16, 32] and "at most 16" in cuda.plan_reason[lay]
    cuda.plan_reason[lay] = "another call's reason"
    assert plan("int4/int4", 32, tokens_m=True)[1] is None and "at most 16" in cuda.plan_reason[lay] and made == [16, 32]
    with mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)):
        assert cuda.decode_plan(lay, 16, torch.bfloat16, CUDA, tokens_m=True) is None
    assert "9.0" in cuda.plan_reason[lay]
    assert plan("int4/int4", 16, tokens_m=True, specialized=False)[1] is not p and made == [16, 32, 16]


def test_page_metadata_plan_copies_the_page_section():
    """A RoPE path grouped per page: the stage copies the page's metadata section (not per-token rows) and
    the shared-memory map counts it once per tile."""
    fmt = CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page"))
    lay, p = plan(fmt)
    m = dict(p.macros)
    assert m["R_PAGE"] == 1 and m["PMB_R"] == 64 * 2 * 2 and m["FB_RM"] == 0 and m["HALF"] == 1
    assert m["OFF_RM"] == lay.offsets["rope_page_meta"]
    _, q = plan("int4/int4")  # per-token g64 RoPE metadata: 4 B a token, 128 B a 32-token tile
    smem = lambda pl: dict(pl.macros)["SMEM_EXPECTED"]  # noqa: E731
    assert "R_PAGE" not in dict(q.macros) and smem(p) - smem(q) == m["STAGES"] * (256 - 128)


def test_page_metadata_in_blocks_plan_copies_the_tiles_sets(monkeypatch):
    """A RoPE path with a metadata set per block of tokens (several sets a page): the built-tile stage copies the
    sets its tile's tokens read (two of 256 bytes for a 32-token tile of 16-token blocks, the one set holding a tile
    for blocks of 64 tokens or more), and so does the tokens-as-M stage (four for its 64-token tile). The default
    config at 16 rows takes the tokens-as-M kernel only where TM_ROPE_PAGE_DEFAULT is set, else the built tile."""
    from quantmla.kernels.cuda import tokens_m

    from quantmla.kernels.schedule import default_config

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    page = CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page"))
    blocked = CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page", block=16))
    _, whole = plan(page)
    lay, p = plan(blocked)
    m, w = dict(p.macros), dict(whole.macros)
    assert (m["R_PAGE"], m["R_BLK"], m["PMB_R"], m["BN"]) == (1, 16, 256, 32) and "R_BLK" not in w
    assert m["PMB_R"] == lay.page_field_bytes["rope_page_meta"] // 4 and w["PMB_R"] == 256
    assert m["STAGES"] == w["STAGES"] and m["SMEM_EXPECTED"] - w["SMEM_EXPECTED"] == m["STAGES"] * 256
    _, p64 = plan(blocked, num_warps=16, block_n=64)  # a 64-token tile reads the page's four sets
    assert dict(p64.macros)["SMEM_EXPECTED"] - dict(plan(page, num_warps=16, block_n=64)[1].macros)[
        "SMEM_EXPECTED"] == dict(p64.macros)["STAGES"] * 3 * 256
    _, tm = plan(blocked, tokens_m=True)
    _, tm_page = plan(page, tokens_m=True)
    t, tp = dict(tm.macros), dict(tm_page.macros)
    assert (t["R_PAGE"], t["R_BLK"], t["PMB_R"], t["FB_RM"]) == (1, 16, 256, 0)
    assert t["OFF_RM"] == lay.offsets["rope_page_meta"]
    assert "R_BLK" not in tp and "R_FLD" not in tp and t["STAGES"] == tp["STAGES"]
    assert t["SMEM_EXPECTED"] - tp["SMEM_EXPECTED"] == t["STAGES"] * 3 * 256
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        for on in (False, True):
            monkeypatch.setattr(tokens_m, "TM_ROPE_PAGE_DEFAULT", on)
            cfg = default_config(16, lay, "cuda")
            assert cfg.kernel == "cuda" and cfg.tokens_m == on
            assert default_config(16, plan("int4/int4")[0], "cuda").tokens_m  # per-token formats either way


def test_page_metadata_the_tile_cannot_read_falls_back_to_triton(monkeypatch):
    """A RoPE path per page whose metadata the built tile cannot read in its 16-bit type (fp32 sets): no CUDA plan,
    so the default config is Triton's and a call asked for the CUDA kernel warns and runs Triton."""
    import types

    from quantmla.kernels import launch
    from quantmla.kernels.schedule import DecodeConfig, default_config

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    f32 = CacheFormat(PathFormat(4, 128), PathFormat(4, 1, meta_dtype="float32", grouping="page", block=16))
    lay, p = plan(f32)
    assert p is None and "the tile's 16-bit type" in cuda.plan_reason[lay]
    pages = types.SimpleNamespace(device=CUDA)  # the call's device is all the plan reads of the pages
    out = torch.zeros(1, 1, 16, 512, dtype=torch.bfloat16)
    args = (None, None, pages, None, None, None, None, None, out, None, None, None, 0, 16, 1, 16, 1, 1.0)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        assert default_config(16, lay, "cuda").kernel != "cuda"
        with pytest.warns(UserWarning, match="16-bit type.*the Triton kernel runs instead"):
            assert launch.launch_cuda((1, 1), args, lay, DecodeConfig(block_m=16, block_n=32, num_warps=8,
                                                                    kernel="cuda")) is None


@pytest.mark.parametrize("name,half", [("int4/int4", 1), ("int2/int4", 1), ("int8/int8", 1), ("bf16", 0), ("fp8", 0)])
def test_tile_type(name, half):
    """fp16 tiles only where every quantized path stores fp16 metadata and nothing is raw bf16 or e4m3."""
    _, p = plan(name)
    assert dict(p.macros)["HALF"] == half


@pytest.mark.parametrize("rows,bm", [(1, 16), (16, 16), (17, 32), (32, 32), (33, 64), (128, 64), (512, 64)])
def test_row_block(rows, bm):
    _, p = plan("int4/int4", rows)
    assert p.block_m == bm


@pytest.mark.parametrize("name", ["bf16", "fp8", "int4/int4", "int2/int4", "int8/int8"])
@pytest.mark.parametrize("rows", [16, 32, 64])
def test_shared_memory_fits(name, rows):
    lay, p = plan(name, rows)
    assert 2 <= p.stages <= 4 and p.smem <= cuda.SMEM_PER_CTA
    assert p.ctas_per_sm * (p.smem + cuda.SMEM_RESERVED) <= cuda.SMEM_PER_SM
    m = dict(p.macros)
    assert p.smem == cuda.smem_bytes(lay, p.block_m, p.stages, m["KSPLIT"], p.block_n)


@pytest.mark.parametrize("nw,bn,rows", [(16, 32, 16), (16, 64, 16), (8, 64, 16), (16, 32, 64), (16, 64, 128)])
def test_tilings(nw, bn, rows):
    """Other tilings: every warp gets whole score tiles of one row block, and the map still fits."""
    lay, p = plan("int4/int4", rows, num_warps=nw, block_n=bn)
    m = dict(p.macros)
    assert (p.num_warps, p.block_n) == (nw, bn) and f"N{bn}w{nw}" in p.describe()
    ws = (nw, bn, rows) == (16, 32, 16)  # warp-specialized: half the warps compute, two built tiles
    assert m["WS"] == int(ws) and ("ws" in p.describe()) == ws
    tpw = (p.block_m // 16) * (bn // 8) * m["KSPLIT"] // (nw // 2 if ws else nw)
    assert tpw >= 1 and (bn // 8) % tpw == 0 and (576 // 16) % m["KSPLIT"] == 0
    assert p.ctas_per_sm * (p.smem + cuda.SMEM_RESERVED) <= cuda.SMEM_PER_SM and (p.ctas_per_sm == 1 or not ws)
    assert p.smem == cuda.smem_bytes(lay, p.block_m, p.stages, m["KSPLIT"], bn, ws)


def test_bf16_is_never_warp_specialized():
    """A BF16 tile is copied straight in: no builder warps."""
    _, p = plan("bf16", 16, num_warps=16, block_n=32)
    assert dict(p.macros)["WS"] == 0


def test_unknown_tiling_is_refused_with_its_reason():
    lay, p = plan("int4/int4", num_warps=4)
    assert p is None and "4 warps" in cuda.plan_reason[lay]
    lay, p = plan("int4/int4", page=32, block_n=64)
    assert p is None and "page size" in cuda.plan_reason[lay]


def test_two_ctas_per_sm_at_16_heads():
    for name in ("bf16", "fp8", "int4/int4", "int2/int4"):
        assert plan(name, 16)[1].ctas_per_sm == 2, name


@pytest.mark.parametrize("fmt,page,why", [
    (preset("int4/int4"), 16, "page size"),
    (CacheFormat(PathFormat(3, 64), BF16), 64, "3-bit"),
    (CacheFormat(PathFormat(4, 2), BF16), 64, "multiple of 4"),
    (CacheFormat(PathFormat(8, 128, "fp8", "float32"), PathFormat(4, 1, grouping="page")), 64, "tile's 16-bit type"),
])
def test_refused_layouts_say_why(fmt, page, why):
    lay, p = plan(fmt, page=page)
    assert p is None and why in cuda.plan_reason[lay]


def test_off_switch_and_cpu():
    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    assert cuda.decode_plan(lay, 16, torch.bfloat16, torch.device("cpu")) is None
    with mock.patch.dict("os.environ", {"QUANTMLA_DECODE_KERNEL": "triton"}):
        assert plan("int4/int4")[1] is None
    with mock.patch("torch.cuda.get_device_capability", return_value=(7, 5)):
        assert cuda.decode_plan(lay, 16, torch.bfloat16, CUDA) is None and "8.0" in cuda.plan_reason[lay]


@pytest.mark.parametrize("name,stages", [("int4/int4", 3), ("int2/int4", 6)])
def test_tokens_m_plan(name, stages):
    """Tokens as the MMA's M dimension: its own source, 4 warps of 64-token tiles, the most stages that keep
    two CTAs per SM, and the shared-memory map of mla_decode_tm.cu."""
    lay, p = plan(name, tokens_m=True, token_blocks=1, specialized=False)
    m = dict(p.macros)
    assert build.source_of(p.macros) == build.SOURCE_TM and build.source_of(plan(name)[1].macros) == build.SOURCE
    assert (m["TM"], m["NW"], m["BN"], p.block_m, p.ctas_per_sm, p.stages) == (1, 4, 64, 16, 2, stages)
    assert p.smem == m["SMEM_EXPECTED"] == cuda.smem_bytes_tm(lay, stages)
    assert 2 * (p.smem + cuda.SMEM_RESERVED) <= cuda.SMEM_PER_SM < 2 * (cuda.smem_bytes_tm(lay, stages + 1) + cuda.SMEM_RESERVED) \
        or stages == cuda.TM_MAX_STAGES
    assert (m["C_BITS"], m["C_GS"], m["R_BITS"], m["R_GS"]) == (lay.token.fmt.content.bits, 128, 4, 64)
    assert p.describe().startswith("cuda/f16/tm/M16N64w4") and m["ONE_BARRIER"] == 1


@pytest.mark.parametrize("name", ["int4/int4", "int2/int4"])
def test_tokens_m_plan_of_two_token_blocks_a_warp(name):
    """Two token blocks a warp (TPW=2: the default for 4-bit content codes, measured faster on the H200; 2-bit
    content keeps one): the partial scores' exchange in the shared-memory map, its own build name; other counts are
    refused with the reason."""
    lay, p = plan(name, tokens_m=True, token_blocks=2, specialized=False)
    m = dict(p.macros)
    assert (m["NW"], m["TPW"], p.num_warps) == (4, 2, 4) and p.describe().startswith("cuda/f16/tm/M16N64w4t2s")
    assert p.smem == m["SMEM_EXPECTED"] == cuda.smem_bytes_tm(lay, p.stages, blocks_per_warp=2)
    assert cuda.smem_bytes_tm(lay, p.stages, blocks_per_warp=2) == cuda.smem_bytes_tm(lay, p.stages) + 4 * 32 * 16 * 2
    one = plan(name, tokens_m=True, token_blocks=1, specialized=False)[1]
    assert "TPW" not in dict(one.macros)  # one block a warp keeps the earlier build's cache key
    default = plan(name, tokens_m=True, specialized=False)[1]  # (the 4-warp plans'; the warps apart are the default)
    assert default == (p if name == "int4/int4" else one)
    lay, bad = plan(name, tokens_m=True, token_blocks=3)
    assert bad is None and "1 or 2" in cuda.plan_reason[lay]


def test_tokens_m_plan_one_p_buffer_where_two_do_not_fit():
    """Content groups of 64 (8 P·scale groups): two P buffers and 3 stages do not fit two CTAs per SM, so the
    plan takes the loop with a barrier after P, one buffer and the most stages that fit."""
    fmt = CacheFormat(PathFormat(4, 64), PathFormat(4, 32))
    lay, p = plan(fmt, tokens_m=True, token_blocks=1)
    m = dict(p.macros)
    assert 2 * (cuda.smem_bytes_tm(lay, cuda.TM_MIN_STAGES) + cuda.SMEM_RESERVED) > cuda.SMEM_PER_SM
    assert m["ONE_BARRIER"] == 0 and p.smem == m["SMEM_EXPECTED"] == cuda.smem_bytes_tm(lay, p.stages, p_buffers=1)
    assert 2 * (cuda.smem_bytes_tm(lay, p.stages + 1, p_buffers=1) + cuda.SMEM_RESERVED) > cuda.SMEM_PER_SM


def test_tokens_m_plan_for_fp8():
    """FP8 (fp8_ds_mla): e4m3 content and a bf16 RoPE key on the tokens-as-M kernel, one token block a warp, two
    stages and one P buffer at two CTAs per SM; the API's default (by the units' lengths); two blocks refused."""
    lay, p = plan("fp8", tokens_m=True)
    m = dict(p.macros)
    assert (m["C_FP8"], m["C_BITS"], m["R_BITS"], m["ONE_BARRIER"], p.stages) == (1, 8, 16, 0, 2)
    assert "TPW" not in m and p.smem == m["SMEM_EXPECTED"] == cuda.smem_bytes_tm(lay, 2, p_buffers=1)
    assert 2 * (p.smem + cuda.SMEM_RESERVED) <= cuda.SMEM_PER_SM
    lay, bad = plan("fp8", tokens_m=True, token_blocks=2)
    assert bad is None and "FP8 with two token blocks" in cuda.plan_reason[lay]


@pytest.fixture
def sm90_sass(tmp_path, monkeypatch):
    """macros -> the SASS of their build for sm_90a (compiled into a cache of the test's own); skips without nvcc or
    cuobjdump."""
    import subprocess

    from quantmla_lab.bench.kernels.sass_count import cuobjdump

    if build.nvcc() is None:
        pytest.skip("needs nvcc")
    try:
        cuobjdump()
    except SystemExit:
        pytest.skip("needs cuobjdump (CUDA's, or the one bundled with triton)")
    monkeypatch.setenv("QUANTMLA_CUDA_CACHE", str(tmp_path))

    def sass(macros) -> str:
        cubin = build.compile_cubin(tuple(sorted(dict(macros).items())), "sm_90a")
        return subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout

    return sass


@pytest.mark.parametrize("name,sections", [("int4/int4", 4), ("int2/int4", 4), ("fp8", 3)])
def test_tokens_m_stage_is_one_copy_where_a_page_is_one_tile(name, sections, sm90_sass):
    """Pages of 64 tokens are one tile whose sections lie where a stage's do, so a stage can be one bulk copy of the
    page (WHOLE_PAGE=1, the kernel's default, which the plans of INT4/INT4 and FP8 keep); pages of 128 tokens take a
    copy a section, and so does the 64-token build with WHOLE_PAGE=0 (same plan), which every INT2/INT4 plan asks."""
    def copies(macros) -> int:
        return sm90_sass(macros).count("UBLKCP.S.G")

    _, p64 = plan(name, tokens_m=True, specialized=False)
    _, p128 = plan(name, tokens_m=True, specialized=False, page=128)
    m = dict(p64.macros)
    one, each = copies({**m, "WHOLE_PAGE": 1}), copies(p128.macros)
    assert one > 0 and each == sections * one, (one, each)
    assert copies({**m, "WHOLE_PAGE": 0}) == each
    assert copies(p64.macros) == (each if name == "int2/int4" else one)  # the plan's own choice


@pytest.mark.parametrize("name,specialized", [("int4/int4", False), ("int4/int4", True), ("int2/int4", True),
                                              ("fp8", False)])
def test_scale_vote_builds_for_sm90(name, specialized, sm90_sass):
    """SCALE_VOTE (asked for with scale_vote, not a default): the tokens-as-M plans build with it for sm_90a, and only
    then does the vote take each token's largest content scale's log2 (MUFU.LG2 in the SASS); the default builds take
    none."""
    _, p = plan(name, tokens_m=True, specialized=specialized)
    _, v = plan(name, tokens_m=True, specialized=specialized, scale_vote=True)
    assert sm90_sass(p.macros).count("MUFU.LG2") == 0 and "SCALE_VOTE" not in dict(p.macros)
    assert dict(v.macros) == {**dict(p.macros), "SCALE_VOTE": 1} and v.stages == p.stages
    assert sm90_sass(v.macros).count("MUFU.LG2") > 0


@pytest.mark.parametrize("fmt,rows,d_c,why", [
    ("int4/int4", 32, 512, "at most 16"),
    ("bf16", 16, 512, "2- or 4-bit affine"),
    (CacheFormat(PathFormat(8, 64, "fp8", "float32"), BF16), 16, 512, "multiple of 128"),
    ("int4/int8", 16, 512, "2- or 4-bit affine"),
    (CacheFormat(PathFormat(2, 128, "symmetric"), PathFormat(4, 64)), 16, 512, "2- or 4-bit affine"),
    (CacheFormat(PathFormat(4, 128, meta_dtype="bfloat16"), PathFormat(4, 64)), 16, 512, "fp16 metadata"),
    (CacheFormat(PathFormat(4, 32), PathFormat(4, 32)), 16, 512, "multiple of 64"),
    (CacheFormat(PathFormat(4, 128), PathFormat(4, 16)), 16, 512, "whole number of code planes"),
    (CacheFormat(PathFormat(4, 64), PathFormat(4, 32)), 16, 128, "DeepSeek's geometry"),
])
def test_tokens_m_refused_with_reason(fmt, rows, d_c, why):
    """Where the tokens-as-M kernel cannot read a layout, asking for it gives no plan and says why."""
    lay, p = plan(fmt, rows, d_c=d_c, d_r=64 if d_c == 512 else 32, tokens_m=True)
    assert p is None and why in cuda.plan_reason[lay], cuda.plan_reason.get(lay)


@pytest.mark.parametrize("rope,why", [
    (PathFormat(4, 1, grouping="page", block=4), "16-token block must lie in one set"),
    (PathFormat(4, 1, grouping="page", block=8), "16-token block must lie in one set"),
    (PathFormat(4, 4, grouping="page"), "groups of one or two channels"),
    (PathFormat(4, 1, meta_dtype="float32", grouping="page", block=16), "fp16 metadata"),
    (PathFormat(8, 1, grouping="page"), "2- or 4-bit"),
])
def test_tokens_m_refuses_rope_pages_it_cannot_fold(rope, why):
    """A RoPE path grouped per page reaches the tokens-as-M kernel only where each warp's 16 tokens read one set of
    fp16 scales a channel or channel pair; otherwise the plan says why (and the default takes the built tile)."""
    lay, p = plan(CacheFormat(PathFormat(4, 128), rope), tokens_m=True)
    assert p is None and why in cuda.plan_reason[lay], cuda.plan_reason.get(lay)


@pytest.mark.parametrize("rope,fld", [(PathFormat(4, 1, grouping="page"), None),
                                      (PathFormat(4, 2, "symmetric", grouping="page", block=32), 1),
                                      (PathFormat(2, 1, grouping="page", block=16), None)])
def test_tokens_m_rope_page_plans(rope, fld):
    """The tokens-as-M plans of page formats: the page's sets instead of per-token RoPE metadata (no RoPE group sums
    in the query block), symmetric codes with one field a group, and every plan of the kernel."""
    from quantmla.kernels.cuda.tokens_m import smem_bytes_tm

    fmt = CacheFormat(PathFormat(4, 128), rope)
    tok_lay, _ = plan(CacheFormat(PathFormat(4, 128), PathFormat(rope.bits, 64)), tokens_m=True)
    for kw in ({}, {"specialized": False}, {"specialized": False, "token_blocks": 1}):
        lay, p = plan(fmt, tokens_m=True, **kw)
        m = dict(p.macros)
        assert m["R_PAGE"] == 1 and m["PMB_R"] == lay.rope_meta_set_bytes and m.get("R_FLD") == fld
        assert m["R_GS"] == rope.group_size and "S8_QK" not in m
    extra = lay.tile_rope_meta_bytes(64) - 64 * 4  # a stage's sets against per-token g64 (4 bytes a token)
    ng = 16 * 4  # one RoPE group sum a query row fewer
    for stages in (3, 4):
        assert smem_bytes_tm(lay, stages, specialized=True) - smem_bytes_tm(tok_lay, stages, specialized=True) == \
            stages * extra - ng
    _, s8 = plan(fmt, tokens_m=True, specialized=True, s8_scores=True)
    assert s8 is None and "8-bit warpgroup" in cuda.plan_reason[lay]


def test_tokens_m_needs_sm90():
    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    with mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)):
        assert cuda.decode_plan(lay, 16, torch.bfloat16, CUDA, tokens_m=True) is None
    assert "9.0" in cuda.plan_reason[lay]


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("name,rows,tiling", [("int4/int4", 16, {}), ("fp8", 64, {}),
                                              (CacheFormat(PathFormat(2, 64, "symmetric", "bfloat16"),
                                                           PathFormat(8, 32, "symmetric")), 32, {}),
                                              ("int4/int4", 16, {"num_warps": 16, "block_n": 64}),
                                              ("int2/int4", 16, {"num_warps": 16, "block_n": 32}),
                                              ("int4/int4", 16, {"tokens_m": True}),
                                              ("int2/int4", 4, {"tokens_m": True}),
                                              (CacheFormat(PathFormat(4, 64), PathFormat(4, 32)), 16, {"tokens_m": True}),
                                              ("int4/int4", 16, {"tokens_m": True, "token_blocks": 1}),
                                              ("int2/int4", 16, {"tokens_m": True, "token_blocks": 2}),
                                              ("fp8", 16, {"tokens_m": True}),
                                              ("bf16", 16, {"num_warps": 16, "block_n": 32}),  # one score a lane
                                              ("bf16", 128, {"warpgroup": True}),
                                              ("int4/int4", 128, {"warpgroup": True}),  # fp16 operands
                                              ("int2/int4", 64, {"warpgroup": True}),
                                              (CacheFormat(PathFormat(2, 64, "symmetric", "bfloat16"),
                                                           PathFormat(8, 32, "symmetric")), 128, {"warpgroup": True}),
                                              ("fp8", 128, {"warpgroup": True}),  # one raw stage, bf16 operands
                                              (CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page")), 16, {}),
                                              (CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page",
                                                                                          block=16)), 16, {}),
                                              (CacheFormat(PathFormat(2, 128), PathFormat(4, 1, grouping="page",
                                                                                          block=16)), 16,
                                               {"num_warps": 16, "block_n": 64}),
                                              (CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page",
                                                                                          block=4)), 64, {}),
                                              (CacheFormat(PathFormat(2, 128), PathFormat(4, 2, "symmetric",
                                                                                          grouping="page")), 64, {}),
                                              (CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page",
                                                                                          block=16)), 16,
                                               {"tokens_m": True}),
                                              (CacheFormat(PathFormat(2, 128), PathFormat(4, 2, "symmetric",
                                                                                          grouping="page")), 16,
                                               {"tokens_m": True, "specialized": False}),
                                              (CacheFormat(PathFormat(4, 128), PathFormat(2, 1, grouping="page",
                                                                                          block=32)), 16,
                                               {"tokens_m": True, "specialized": False, "token_blocks": 2})])
def test_plans_compile_for_sm90(name, rows, tiling, tmp_path, monkeypatch):
    """The source builds for sm_90a with each plan's constants (its static_asserts include the host's
    shared-memory size), the build is cached, and other constants give another build."""
    monkeypatch.setenv("QUANTMLA_CUDA_CACHE", str(tmp_path))
    _, p = plan(name, rows, **tiling)
    path = build.compile_cubin(p.macros, "sm_90a")
    assert path.exists() and path.stat().st_size > 10_000
    mtime = path.stat().st_mtime_ns
    assert build.compile_cubin(p.macros, "sm_90a") == path and path.stat().st_mtime_ns == mtime
    other = tuple((k, v + 1 if k == "SMEM_EXPECTED" else v) for k, v in p.macros)
    with pytest.raises(Exception, match="shared-memory"):
        build.compile_cubin(other, "sm_90a")


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
def test_tokens_m_timing_builds_compile_for_sm90(tmp_path, monkeypatch):
    """The tokens-as-M kernel's timing builds (TIMELINE, and PHASES with it) compile, and PHASES alone or in the
    loop with two barriers is refused at compile time (its static_assert)."""
    monkeypatch.setenv("QUANTMLA_CUDA_CACHE", str(tmp_path))
    _, p = plan("int4/int4", tokens_m=True, specialized=False)
    m = dict(p.macros)
    for extra in ({"TIMELINE": 1}, {"TIMELINE": 1, "PHASES": 1}):
        assert build.compile_cubin(tuple(sorted({**m, **extra}.items())), "sm_90a").stat().st_size > 10_000
    with pytest.raises(Exception, match="phases are timed"):
        build.compile_cubin(tuple(sorted({**m, "PHASES": 1}.items())), "sm_90a")


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
def test_warpgroup_timing_builds_compile_for_sm90(tmp_path, monkeypatch):
    """The heads-as-M kernel's timing builds compile for the integer codes (the output products' k-steps committed
    together, the whole chunks built after them; no build at all; 16 steps a batch; the reference maxima moved at
    every increase; the codes widened as e4m3 bit patterns), and the k-steps' builds (the
    default) are refused at compile time without the warpgroups' own builds (its static_assert)."""
    monkeypatch.setenv("QUANTMLA_CUDA_CACHE", str(tmp_path))
    _, p = plan("int4/int4", 128, warpgroup=True)
    m = dict(p.macros)
    for extra in ({"PV_STEPS": 0}, {"SKIP_BUILD": 1}, {"BUILD_BATCH": 16}, {"MAX_SLACK": 0}, {"E4M3_EXPAND": 1}):
        assert build.compile_cubin(tuple(sorted({**m, **extra}.items())), "sm_90a").stat().st_size > 10_000
    with pytest.raises(Exception, match="k-steps"):
        build.compile_cubin(tuple(sorted({**m, "PV_STEPS": 1, "SPLIT": 0}.items())), "sm_90a")


def test_launch_falls_back_with_a_warning_or_raises_when_asked(monkeypatch):
    """Where the CUDA kernel cannot run a call, the API warns and the Triton kernel runs; with
    QUANTMLA_DECODE_KERNEL=cuda it is an error naming why."""
    from quantmla.errors import UnsupportedFormatError
    from quantmla.kernels import launch
    from quantmla.kernels.schedule import DecodeConfig

    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    pages = torch.zeros(2, lay.page_bytes, dtype=torch.uint8)  # CPU: no plan
    out = torch.zeros(1, 1, 16, 512, dtype=torch.bfloat16)
    args = (None, None, pages, None, None, None, None, None, out, None, None, None, 0, 16, 1, 16, 1, 1.0)
    cfg = DecodeConfig(block_m=16, block_n=32, kernel="cuda")
    with pytest.warns(UserWarning, match="not a CUDA device"):
        assert launch.launch_cuda((1, 1), args, lay, cfg) is None
    monkeypatch.setenv("QUANTMLA_DECODE_KERNEL", "cuda")
    with pytest.raises(UnsupportedFormatError, match="not a CUDA device"):
        launch.launch_cuda((1, 1), args, lay, cfg)


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
def test_an_edited_header_is_another_build(tmp_path, monkeypatch):
    """The headers mla_decode.cu includes are part of the cache key: an edit never loads a stale cubin."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(build.SOURCE.parent, src, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(build, "SOURCE", src / build.SOURCE.name)
    monkeypatch.setenv("QUANTMLA_CUDA_CACHE", str(tmp_path / "cache"))
    _, p = plan("int4/int4", 16)
    first = build.compile_cubin(p.macros, "sm_90a")
    (src / "ptx.cuh").write_text((src / "ptx.cuh").read_text() + "\n// edited\n")
    assert build.compile_cubin(p.macros, "sm_90a") != first


def test_every_included_header_is_in_the_cache_key():
    """Every header a kernel source or header includes by quotes is one the cache key reads (an edit to any of them
    is another build, never a stale cubin)."""
    import re

    folder = build.SOURCE.parent
    included = {name for f in [*folder.glob("*.cu"), *folder.glob("*.cuh")]
                for name in re.findall(r'^#include "([^"]+)"', f.read_text(), re.M)}
    assert "timeline_tm.cuh" in included and "out_io.cuh" in included
    assert included <= set(build.HEADERS), included - set(build.HEADERS)
    assert all((folder / h).is_file() for h in build.HEADERS)


def test_a_build_is_looked_up_once_a_process(monkeypatch):
    """Launches ask for their cubin by the plan's constants: the sources are read and hashed (the disk cache's
    key) once a process, not at every eager launch (27 a decode step); another architecture or line info is
    another build."""
    built = []
    monkeypatch.setattr(build, "compile_cubin", lambda macros, arch, extra=(): built.append((macros, arch, extra))
                        or f"{macros}-{arch}-{extra}.cubin")
    monkeypatch.setattr(build, "_CUBINS", {})
    monkeypatch.delenv("QUANTMLA_CUDA_LINEINFO", raising=False)
    a, b = (("TM", 1),), (("TM", 0),)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        got = [build.cubin_for(m, "cuda") for m in (a, a, b, b)]
        assert got == [f"{a}-sm_90a-().cubin"] * 2 + [f"{b}-sm_90a-().cubin"] * 2
        assert built == [(a, "sm_90a", ()), (b, "sm_90a", ())]
        monkeypatch.setenv("QUANTMLA_CUDA_LINEINFO", "1")
        build.cubin_for(a, "cuda")
    with mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)):
        monkeypatch.delenv("QUANTMLA_CUDA_LINEINFO")
        build.cubin_for(a, "cuda")
    assert built[2:] == [(a, "sm_90a", ("-lineinfo",)), (a, "sm_80", ())]


@pytest.mark.parametrize("bits,gs,symmetric", [(4, 1, False), (4, 2, False), (4, 1, True), (4, 2, True),
                                               (2, 1, False), (2, 2, True)])
def test_rope_page_scores_emulated(bits, gs, symmetric, monkeypatch):
    """The tokens-as-M kernel's RoPE scores on a page's sets (rope_page_tm.cuh), emulated lane by lane in numpy
    (quantmla_lab.bench.kernels.rope_page_layout): with channel scales spanning 2^-12 to 2^12, the scores of 16
    tokens x 16 rows are within 2^-10 of Σ|k·q| of the fp64 scores over the same codes and set; a scale paired with the
    wrong query position is caught."""
    from quantmla_lab.bench.kernels import rope_page_layout as emu

    for seed in range(2):
        rel, ok = emu.emulate(bits, gs, symmetric, seed)
        assert ok and rel > 0, rel
    real = emu.set_pairs
    monkeypatch.setattr(emu, "set_pairs", lambda *a: (lambda s02, s13, z02, z13: (s13, s02, z02, z13))(*real(*a)))
    if gs == 1:  # (a channel pair shares its group's scale: there the swap changes nothing)
        assert not emu.emulate(bits, gs, symmetric, 0)[1]
