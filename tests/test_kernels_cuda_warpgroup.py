"""The heads-as-M CUDA kernel's plans (mla_decode_wg.cu, warpgroup MMAs), without a GPU: its tiling and shared
memory, the tensor maps its BF16 tiles are copied through, integer codes and FP8 on it, and the layouts it refuses with
their reasons. The kernel itself runs in tests/test_kernels_gpu_warpgroup.py."""

from unittest import mock

import pytest
import torch
from helpers.cuda_plans import CUDA, plan

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout, preset
from quantmla.kernels import cuda
from quantmla.kernels.cuda import build
from quantmla.quant import BF16, PathFormat


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
def test_warpgroup_plan(out):
    """The heads-as-M kernel: 64 rows a CTA, two warpgroups, one CTA per SM, its shared memory under the 227 KiB a
    CTA may ask for, the bf16 layout's section offsets."""
    lay, p = plan("bf16", 128, out=out, warpgroup=True)
    m = dict(p.macros)
    assert (p.block_m, p.num_warps, p.block_n, p.ctas_per_sm, p.stages) == (64, 8, 64, 1, 2)
    assert m["WG"] == 1 and m["TMA"] == 1 and m["OFF_RC"] == lay.offsets["rope_codes"] and m["FB_CC"] == 1024
    assert m["FB_RC"] == 128
    assert p.smem == m["SMEM_EXPECTED"] == cuda.smem_bytes_wg() <= cuda.SMEM_PER_CTA
    assert p.describe().startswith("cuda/bf16/wg/M64N64w8")
    assert build.source_of(p.macros).name == "mla_decode_wg.cu"


def test_warpgroup_tensor_maps_describe_the_page_sections(monkeypatch):
    """The two tensor maps the heads-as-M kernel copies its tiles through: 16-bit elements over the latent and RoPE
    sections of every page (channels, tokens, pages), 64 x 64 x 1 boxes in the 128-byte swizzle, 128-byte aligned
    buffers, built once per pages buffer."""
    import ctypes

    from quantmla.kernels.cuda import driver, warpgroup

    lay, p = plan("bf16", 128, warpgroup=True)
    pages = torch.zeros(5, lay.page_bytes, dtype=torch.uint8)
    calls = []

    class Encode:
        argtypes = None

        def __call__(self, buf, dtype, rank, addr, dims, strides, box, steps, interleave, swizzle, l2, oob):
            calls.append((dtype, rank, addr.value, list(dims), list(strides), list(box), list(steps), interleave, swizzle))
            return 0

    monkeypatch.setattr(driver, "_lib", lambda: type("Lib", (), {"cuTensorMapEncodeTiled": Encode()}))
    monkeypatch.setattr(warpgroup, "_MAPS", {})
    maps = warpgroup.tensor_maps(pages, p)
    assert warpgroup.tensor_maps(pages, p) == maps and len(calls) == 2  # cached
    base, pb = pages.data_ptr(), lay.page_bytes
    assert calls == [(1, 3, base + lay.offsets["content_codes"], [512, 64, 5], [1024, pb], [64, 64, 1], [1, 1, 1], 0, 3),
                     (1, 3, base + lay.offsets["rope_codes"], [64, 64, 5], [128, pb], [64, 64, 1], [1, 1, 1], 0, 3)]
    assert all(ctypes.addressof(m) % 128 == 0 and ctypes.sizeof(m) == 128 for m in maps)
    with pytest.raises(Exception, match="contiguous"):
        warpgroup.tensor_maps(torch.zeros(5, 2 * lay.page_bytes, dtype=torch.uint8)[:, ::2], p)


@pytest.mark.parametrize("fmt,bits,smem", [("int4/int4", (4, 4), 217632), ("int2/int4", (2, 4), 193056)])
def test_warpgroup_lowbit_plan(fmt, bits, smem):
    """Integer codes on the heads-as-M kernel: three raw stages of a tile's four page sections (bulk copies, no tensor
    maps) and one built tile, fp16 operands where the metadata is fp16; the layout's offsets, field widths, groups and
    metadata kinds as macros."""
    from quantmla.kernels.cuda import warpgroup

    lay, p = plan(fmt, 128, warpgroup=True)
    m, o = dict(p.macros), lay.offsets
    assert (p.block_m, p.num_warps, p.block_n, p.ctas_per_sm, p.stages) == (64, 8, 64, 1, 3)
    assert m["LOWBIT"] == 1 and m["TMA"] == 0 and m["HALF"] == 1 and m["PV_STEPS"] == 1 and warpgroup.lowbit(p)
    assert p.describe().startswith("cuda/f16/wg/M64N64w8s3c1")
    assert (m["OFF_CC"], m["OFF_RC"], m["OFF_CM"], m["OFF_RM"]) == tuple(o[k] for k in
                                                                         ("content_codes", "rope_codes", "content_meta", "rope_meta"))
    assert (m["FB_CC"], m["FB_RC"], m["FB_CM"], m["FB_RM"]) == (64 * bits[0], 8 * bits[1], 16, 4)
    assert (m["BITS_C"], m["BITS_R"], m["GS_C"], m["GS_R"], m["KIND_C"], m["MB_C"]) == (*bits, 128, 64, 1, 2)
    # the query block, one built tile, P, the maxima and sums, the query rows' factors, three raw stages, three
    # mbarriers, the alignment slack
    assert p.smem == smem == 2 * 9 * 8192 + 8192 + 1024 + 512 + 256 + 3 * 64 * lay.token.bytes_per_token + 32 + 1024
    assert p.smem == cuda.smem_bytes_wg(lay) <= cuda.SMEM_PER_CTA
    assert not warpgroup.lowbit(plan("bf16", 128, warpgroup=True)[1])
    # bf16 metadata: bf16 operands, no query factors
    sym = CacheFormat(PathFormat(2, 64, "symmetric", "bfloat16"), PathFormat(8, 32, "symmetric"))
    lay, p = plan(sym, 128, warpgroup=True)
    assert dict(p.macros)["HALF"] == 0 and p.describe().startswith("cuda/bf16/wg/")
    assert p.smem == 2 * 9 * 8192 + 8192 + 1024 + 512 + 3 * 64 * lay.token.bytes_per_token + 32 + 1024


def test_warpgroup_fp8_plan():
    """FP8 (fp8_ds_mla) on the heads-as-M kernel: e4m3 latent values with fp32 scales and the BF16 RoPE key through one
    raw stage (656 bytes a token), built into a bf16 tile; no RoPE metadata to copy."""
    lay, p = plan("fp8", 128, warpgroup=True)
    m = dict(p.macros)
    assert (m["LOWBIT"], m["RAW_N"], m["HALF"], m["KIND_C"], m["BITS_C"], m["MB_C"], m["KIND_R"], m["BITS_R"]) == \
        (1, 1, 0, 3, 8, 4, 0, 16)
    assert m["FB_CC"] == 512 and m["FB_CM"] == 16 and m["FB_RC"] == 128 and m["FB_RM"] == 0 and m["PV_STEPS"] == 1
    assert p.smem == 2 * 9 * 8192 + 8192 + 1024 + 512 + 64 * 656 + 16 + 1024 == cuda.smem_bytes_wg(lay)
    assert p.stages == 1 and p.describe().startswith("cuda/bf16/wg/M64N64w8s1c1")


@pytest.mark.parametrize("fmt,rows,page,d_c,why", [
    ("bf16", 32, 64, 512, "64 or more"),
    ("int4/int4", 32, 64, 512, "64 or more"),
    (CacheFormat(PathFormat(8, 128, "fp8", "float32"), PathFormat(4, 64)), 128, 64, 512, "a BF16 RoPE key"),
    (CacheFormat(PathFormat(4, 128), BF16), 128, 64, 512, "both paths BF16, or both integer codes"),
    (CacheFormat(PathFormat(4, 128, meta_dtype="bfloat16"), PathFormat(4, 1, grouping="page")), 128, 64, 512,
     "both paths with fp16 metadata"),
    (CacheFormat(PathFormat(4, 128), PathFormat(4, 16, "symmetric", grouping="page")), 128, 64, 512, "16-byte sets"),
    (CacheFormat(PathFormat(3, 128), PathFormat(4, 64)), 128, 64, 512, "2-, 4- or 8-bit"),
    ("bf16", 128, 32, 512, "multiple of 64"),
    ("bf16", 128, 64, 256, "DeepSeek's geometry"),
])
def test_warpgroup_refused_with_reason(fmt, rows, page, d_c, why):
    """Where the heads-as-M kernel cannot read a layout, asking for it gives no plan and says why."""
    lay, p = plan(fmt, rows, page=page, d_c=d_c, warpgroup=True)
    assert p is None and why in cuda.plan_reason[lay], cuda.plan_reason.get(lay)


@pytest.mark.parametrize("rope,sets", [(PathFormat(4, 1, grouping="page"), 1),
                                       (PathFormat(4, 1, grouping="page", block=16), 4),
                                       (PathFormat(4, 2, "symmetric", grouping="page", block=4), 16)])
def test_warpgroup_rope_page_plans(rope, sets, monkeypatch):
    """A RoPE path grouped per page on the heads-as-M kernel: its raw stages hold the sets a tile's tokens read (the
    page's metadata section, not per-token rows), and the default config takes the kernel only where
    WG_ROPE_PAGE_DEFAULT is set (else the built tile)."""
    from quantmla.kernels.cuda import warpgroup
    from quantmla.kernels.schedule import default_config

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lay, p = plan(CacheFormat(PathFormat(4, 128), rope), 128, warpgroup=True)
    tok_lay, q = plan("int4/int4", 128, warpgroup=True)
    m = dict(p.macros)
    assert (m["R_PAGE"], m["PMB_R"], m["FB_RM"], m["OFF_RM"]) == (1, lay.rope_meta_set_bytes, 0,
                                                                 lay.offsets["rope_page_meta"])
    assert m.get("R_BLK", lay.page_size) == rope.meta_block(64) and "R_PAGE" not in dict(q.macros)
    assert p.smem - q.smem == 3 * (sets * lay.rope_meta_set_bytes - 64 * 4)  # three raw stages; per-token g64: 4 B
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        for on in (False, True):
            monkeypatch.setattr(warpgroup, "WG_ROPE_PAGE_DEFAULT", on)
            assert default_config(128, lay, "cuda").warpgroup == on
            assert default_config(128, tok_lay, "cuda").warpgroup


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
def test_warpgroup_rope_page_builds_for_sm90_without_spills(tmp_path):
    """The page build (wg_build.cuh's PM) compiles for sm_90a, sets per page and per block of 4 tokens, without
    spills."""
    import subprocess

    for rope in (PathFormat(4, 1, grouping="page", block=16), PathFormat(4, 2, "symmetric", grouping="page", block=4)):
        _, p = plan(CacheFormat(PathFormat(2, 128), rope), 128, warpgroup=True)
        cmd = [build.nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
               *[f"-D{k}={v}" for k, v in p.macros], "-o", str(tmp_path / "wg.cubin"), str(build.source_of(p.macros))]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "0 bytes spill stores" in r.stderr and "serialized" not in r.stderr, r.stderr[-2000:]


def test_warpgroup_needs_sm90():
    lay = PageLayout(TokenLayout(512, 64, preset("bf16")), 64)
    with mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)):
        assert cuda.decode_plan(lay, 128, torch.bfloat16, CUDA, warpgroup=True) is None
    assert "9.0" in cuda.plan_reason[lay] and "warpgroup" in cuda.plan_reason[lay]


def test_seesaw_plan():
    """The heads-as-M kernel with its warpgroups out of phase (mla_decode_seesaw.cu): the BF16 plan's launch shape and
    shared memory with SEESAW=1, its own source and name; a config asks for it and implies the heads-as-M launch."""
    from quantmla.kernels import schedule

    _, p = plan("bf16", 128, warpgroup=True, seesaw=True)
    _, base = plan("bf16", 128, warpgroup=True)
    assert dict(p.macros) == {**dict(base.macros), "SEESAW": 1}
    assert (p.block_m, p.num_warps, p.block_n, p.ctas_per_sm, p.smem) == (64, 8, 64, 1, base.smem)
    assert build.source_of(p.macros).name == "mla_decode_seesaw.cu"
    assert p.describe().startswith("cuda/bf16/ss/M64N64w8")
    assert plan("bf16", 128, seesaw=True)[1] == p  # seesaw alone asks for the same plan
    cfg = schedule.DecodeConfig(block_m=64, num_warps=8, kernel="cuda", seesaw=True)
    assert cfg.warpgroup and cfg.describe().startswith("cuda/ss ")


@pytest.mark.parametrize("fmt", ["int4/int4", "fp8"])
def test_seesaw_refuses_low_bit_caches(fmt):
    lay, p = plan(fmt, 128, warpgroup=True, seesaw=True)
    assert p is None and "BF16 cache only" in cuda.plan_reason[lay], cuda.plan_reason.get(lay)


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
def test_seesaw_builds_for_sm90_without_spills_or_serialized_products(tmp_path):
    """The kernel compiles for sm_90a with no stack spills, and ptxas does not serialize its warpgroup MMAs (it does
    where a product follows a branch, e.g. a barrier's wait, without a fence of its own); its timing builds too."""
    import subprocess

    _, p = plan("bf16", 128, warpgroup=True, seesaw=True)
    for extra in ({}, {"SKIP_QK": 1, "SKIP_PV": 1}):
        mac = tuple(sorted({**dict(p.macros), **extra}.items()))
        cmd = [build.nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
               *[f"-D{k}={v}" for k, v in mac], "-o", str(tmp_path / "ss.cubin"), str(build.source_of(mac))]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in r.stderr, r.stderr[-2000:]
        assert "serialized" not in r.stderr and "injected" not in r.stderr, r.stderr[-2000:]


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("setting", ["fp32", "auto"])
def test_staged_epilogue_builds_for_sm90(setting, tmp_path, monkeypatch):
    """The heads-as-M kernels' epilogue through shared memory (EPI_SMEM=1, the default; its plans do not set it)
    compiles for sm_90a with 16-bit partials (the default) and with fp32 ones, for BF16, INT4/INT4, FP8 and the
    warpgroups out of phase, with no stack spills and no warning; its rows fit the space it stages them in (the
    kernels' static_asserts)."""
    import subprocess

    monkeypatch.setenv("QUANTMLA_PARTIALS", setting)
    for fmt, kw in (("bf16", {}), ("int4/int4", {}), ("fp8", {}), ("bf16", {"seesaw": True})):
        _, p = plan(fmt, 128, warpgroup=True, **kw)
        assert cuda.partial_kind(p) == ((torch.float16 if fmt == "int4/int4" else torch.bfloat16) if setting == "auto"
                                        else torch.float32)
        assert "EPI_SMEM" not in dict(p.macros)
        mac = p.macros
        cmd = [build.nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
               *[f"-D{k}={v}" for k, v in mac], "-o", str(tmp_path / "epi.cubin"), str(build.source_of(mac))]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in r.stderr, r.stderr[-2000:]
        assert "warning" not in r.stderr.lower(), r.stderr[-2000:]
