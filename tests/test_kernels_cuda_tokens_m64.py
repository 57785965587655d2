"""The 64-row tokens-as-M CUDA kernel's plan (mla_decode_tm64.cu: tokens as the M of warpgroup MMAs, the codes
dequantized into their register operands), without a GPU: its launch shape and shared memory, the layouts it refuses
with their reasons, the query block's channel order (the Python twin against the header's, where nvcc is here), and
its builds for sm_90a. The kernel itself runs in tests/test_kernels_gpu_tokens_m64.py."""

import re
import subprocess
from unittest import mock

import pytest
import torch
from helpers.cuda_plans import CUDA, plan

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout, preset
from quantmla.kernels import cuda, schedule
from quantmla.kernels.cuda import build, tokens_m64
from quantmla.quant import PathFormat


@pytest.mark.parametrize("page", [64, 256])
def test_tokens_m64_plan(page):
    """64 rows a CTA of three warpgroups, one CTA an SM, 64-token tiles in 5 raw stages, the page's section offsets,
    its shared memory under the 227 KiB a CTA may ask for and asserted by the .cu; the heads-as-M launch shape."""
    lay, p = plan("int4/int4", 128, page=page, warpgroup=True, tokens_m64=True)
    m, o = dict(p.macros), lay.offsets
    assert (p.block_m, p.num_warps, p.block_n, p.ctas_per_sm, p.stages) == (64, 12, 64, 1, 5)
    assert m["TM64"] == 1 and "WG" not in m and m["PS"] == page and m["PAGE_BYTES"] == lay.page_bytes
    assert (m["OFF_CC"], m["OFF_RC"], m["OFF_CM"], m["OFF_RM"]) == tuple(o[k] for k in
                                                                         ("content_codes", "rope_codes", "content_meta", "rope_meta"))
    # the query block, two P buffers, five raw stages of a tile's sections, mbarriers, flags, the rows' exchange,
    # factors, sums, scales and causal limits, the alignment slack
    assert p.smem == m["SMEM_EXPECTED"] == 11 * 8192 + 5 * 64 * lay.token.bytes_per_token + 40 + 16 + 1024 + 1280 + 1024
    assert p.smem <= cuda.SMEM_PER_CTA and p.describe() == "cuda/f16/tm64/M64N64w12s5c1"
    assert build.source_of(p.macros).name == "mla_decode_tm64.cu"
    cfg = schedule.DecodeConfig(block_m=64, num_warps=12, kernel="cuda", warpgroup=True, tokens_m64=True)
    assert cfg.describe().startswith("cuda/tm64 M64")
    # tokens_m64 alone asks for the same plan (it implies the heads-as-M launch shape)
    assert plan("int4/int4", 128, page=page, tokens_m64=True)[1] == p
    alone = schedule.DecodeConfig(block_m=64, kernel="cuda", tokens_m64=True)
    assert alone.warpgroup and alone.describe().startswith("cuda/tm64 M64")  # the config holds the implication
    # not the API's default: asking for the heads-as-M kernel alone still gets it
    assert "WG" in dict(plan("int4/int4", 128, warpgroup=True)[1].macros)


@pytest.mark.parametrize("fmt,rows,page,why", [
    ("int4/int4", 32, 64, "64 or more"),
    ("int2/int4", 128, 64, "content path INT2/g128"),
    ("bf16", 128, 64, "content path BF16"),
    ("fp8", 128, 64, "content path FP8"),
    ("int4/int4-g64/g32", 128, 64, "groups of 128"),
    (CacheFormat(PathFormat(4, 128), PathFormat(4, 64, "symmetric")), 128, 64, "RoPE path"),
    (CacheFormat(PathFormat(4, 128, meta_dtype="bfloat16"), PathFormat(4, 64)), 128, 64, "fp16 metadata"),
    ("int4/int4", 128, 32, "multiple of 64"),
])
def test_tokens_m64_refused_with_reason(fmt, rows, page, why):
    """Where the 64-row tokens-as-M kernel cannot read a layout, asking for it gives no plan and says why."""
    if fmt == "int4/int4-g64/g32":
        fmt = CacheFormat(PathFormat(4, 64), PathFormat(4, 32))
    lay, p = plan(fmt, rows, page=page, warpgroup=True, tokens_m64=True)
    assert p is None and "tokens as M at 64 rows" in cuda.plan_reason[lay] and why in cuda.plan_reason[lay], \
        cuda.plan_reason.get(lay)


def test_tokens_m64_needs_sm90():
    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    with mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)):
        assert cuda.decode_plan(lay, 128, torch.bfloat16, CUDA, warpgroup=True, tokens_m64=True) is None
    assert "tokens as M at 64 rows: needs compute capability 9.0" in cuda.plan_reason[lay]


def test_query_channel_is_a_permutation_a_group_a_k_step():
    """The query block's order: a permutation of the 576 channels in which every content k-step reads one metadata
    group (128 channels) and the RoPE k-steps channels 512-575; column k of a content k-step is byte 16t + 4s + (0, 2,
    1, 3) of the thread's 16-byte load, plane K % 2."""
    order = [[tokens_m64.query_channel(K, k) for k in range(16)] for K in range(36)]
    assert sorted(c for row in order for c in row) == list(range(576))
    for K, row in enumerate(order):
        groups = {c // 128 for c in row} if K < 32 else {4 if c >= 512 else -1 for c in row}
        assert len(groups) == 1 and -1 not in groups, (K, row)
    assert order[0][:4] == [0, 2, 16, 18] and order[0][8:12] == [1, 3, 17, 19] and order[1][0] == 256
    assert order[32][:2] == [512, 514] and order[33][0] == 544


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
def test_query_channel_twins_agree(tmp_path):
    """tm64_ops.cuh's query_channel (constexpr, host and device) equals the Python twin at all 576 columns, and its
    query_position (where the prologue writes a channel) is the inverse: nvcc compiles a static_assert of each."""
    checks = "\n".join(f"static_assert(query_channel({K}, {k}) == {c}, \"{K} {k}\");\n"
                       f"static_assert(query_position({c}) == {16 * K + k}, \"{c}\");"
                       for K in range(36) for k in range(16) for c in [tokens_m64.query_channel(K, k)])
    src = tmp_path / "twins.cu"
    head = ('#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <stdint.h>\ntypedef __half T;\ntypedef __half2 T2;\n#define MMA_TYPE "f16"\n'
            '#define WG_AB "f16"\n#include "ptx.cuh"\n#include "wgmma.cuh"\n#include "tm64_ops.cuh"\n')
    src.write_text(head + checks + "\n")
    r = subprocess.run([build.nvcc(), "-c", "-std=c++17", f"-I{build.SOURCE.parent}", "-arch=sm_90a", "-o",
                        str(tmp_path / "twins.o"), str(src)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    bad = src.read_text().replace("== 0,", "== 1,", 1)  # the check can fail: channel 0 is not 1
    src.write_text(bad)
    assert subprocess.run([build.nvcc(), "-c", "-std=c++17", f"-I{build.SOURCE.parent}", "-arch=sm_90a", "-o",
                           str(tmp_path / "twins.o"), str(src)], capture_output=True, check=False).returncode != 0


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("out,page", [(torch.bfloat16, 64), (torch.float32, 128)])
def test_tokens_m64_builds_for_sm90(out, page, tmp_path):
    """The plan's build compiles for sm_90a (its shared-memory map asserts the plan's size) with its products not
    serialized and at most 4 bytes of spill (one value kept from the prologue for the epilogues: none in the tile
    loops), every product an m64n64k16 HGMMA with its A operand in registers, the registers handed over by
    setmaxnreg; fewer than 3 stages are refused by the plan and by the source."""
    from quantmla_lab.bench.kernels.sass_count import cuobjdump

    lay, p = plan("int4/int4", 128, page=page, out=out, warpgroup=True, tokens_m64=True)
    path = tmp_path / "tm64.cubin"
    r = subprocess.run([build.nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                        "-Xptxas", "-v", *[f"-D{k}={v}" for k, v in p.macros], "-o", str(path), str(build.SOURCE_TM64)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    assert "serialized" not in r.stderr and spill and int(spill.group(1)) <= 4, r.stderr[-1500:]
    sass = subprocess.run([cuobjdump(), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    products = re.findall(r"HGMMA\.64x64x16\.F32\S* R\d+, (\S+), gdesc", sass)
    assert len(products) == 36 + 16 and all(a.startswith("R") for a in products), products
    assert "USETMAXREG" in sass
    assert "3 or more" in tokens_m64.tokens_m64_plan(lay, 128, out, stages=2)
    two = tuple(sorted({**dict(p.macros), "STAGES": 2, "SMEM_EXPECTED": tokens_m64.smem_bytes_tm64(2)}.items()))
    with pytest.raises(Exception, match="more stages than P buffers"):
        build.compile_cubin(two, "sm_90a", out=tmp_path / "two.cubin")
