"""The lab's readers of a decode kernel's SASS and of Nsight Compute's source page (no GPU): sass_count's phases
of the tile loop, and sass_mix's instruction mix and stall reasons."""

import re
import subprocess
from pathlib import Path

import pytest

from quantmla_lab.bench.kernels.sass_mix import mix


def test_scores_phase_counts_the_span_from_the_copy_wait_to_the_vote():
    """sass_count's scores phase: the opcodes from the first copy wait to the next BAR.RED, inclusive, by base
    opcode; nothing where the span is missing."""
    from quantmla_lab.bench.kernels.sass_count import scores_phase

    ops = ["HMMA.16816.F32", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "LDSM.16.M88.4", "LOP3.LUT", "SHF.R.U32.HI",
           "HMMA.16816.F32", "HMMA.16816.F32", "FFMA", "BAR.RED.OR.DEFER_BLOCKING", "HMMA.16816.F32", "BAR.RED.OR"]
    r = scores_phase(ops)
    assert r["scores_instructions"] == 8 and r["scores_HMMA"] == 2 and r["scores_LDSM"] == 1
    assert (r["scores_LOP3"], r["scores_SHF"], r["scores_FFMA"], r["scores_LDS"]) == (1, 1, 1, 0)
    assert scores_phase(ops[:8]) == {} and scores_phase(["HMMA.16816.F32", "BAR.RED.OR"]) == {}


def test_loop_phases_follow_the_tile_loops_branches():
    """sass_count's loop phases on a made-up loop: the scores along each channel half's path from the loop's top to
    the vote, the vote with and without the copy issue, the output block the first tile skips, and P from the
    skipped move to the back edge; nothing where the loop has no back edge."""
    from quantmla_lab.bench.kernels.sass_count import loop_phases

    body = ["IMAD", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1], R2", "@!P0 BRA 0x{exit}", "@!P1 BRA 0x{half2}",
            "HMMA", "HMMA", "BRA 0x{join}",                                   # first half: 2 and the jump
            "HMMA", "HMMA", "HMMA", "HMMA",                                   # second half: 4
            "FFMA", "BAR.RED.OR.DEFER_BLOCKING 0x0, P1",                      # join .. vote
            "@P0 BRA 0x{issued}", "UBLKCP.S.G", "UBLKCP.S.G",                 # the copy issue
            "@!P3 BRA 0x{out_end}", "HMMA", "HMMA", "HMMA", "HMMA",           # output: 4
            "@P2 BRA 0x{exit}", "@!P1 BRA 0x{p}", "FMNMX", "SHFL",            # the loop's exit, the move (skipped)
            "MUFU.EX2", "STS", "BRA 0x{top}",                                 # P and the back edge
            "EXIT"]
    idx = dict(top=0, half2=7, join=11, issued=16, out_end=21, p=25, exit=28)
    lines = [(16 * i, t.format(**{k: format(16 * v, "x") for k, v in idx.items()})) for i, t in enumerate(body)]
    r = loop_phases(lines)
    assert r == {"loop_scores": [9, 10], "loop_vote": 2, "loop_vote_issuing": 4, "loop_output": 4, "loop_p": [3]}
    assert loop_phases(lines[:-2]) == {}

    # P in two versions (the full tiles' without guards, the last tile's with them): each path counted
    p_split = ["@P0 BRA 0x{guarded}", "MUFU.EX2", "STS", "BRA 0x{pjoin}",  # full tiles: 1 + 3
               "FSEL", "FSEL", "MUFU.EX2", "STS",                          # guarded: 4
               "BRA 0x{top}", "EXIT"]                                      # join: the back edge
    body2 = body[:25] + p_split
    idx2 = dict(idx, guarded=29, pjoin=33, exit=34)
    lines2 = [(16 * i, t.format(**{k: format(16 * v, "x") for k, v in idx2.items()})) for i, t in enumerate(body2)]
    assert loop_phases(lines2)["loop_p"] == [5, 6]

    # the zeroing of a partial tile's metadata right after the copy wait: a block full tiles jump over
    body3 = body[:3] + ["@P4 BRA 0x{zeroed}", "STS", "STS", "STS"] + body[3:]
    idx3 = {k: v + 4 if v >= 3 else v for k, v in idx.items()} | {"zeroed": 7}
    lines3 = [(16 * i, t.format(**{k: format(16 * v, "x") for k, v in idx3.items()})) for i, t in enumerate(body3)]
    r3 = loop_phases(lines3)
    assert r3["loop_scores"] == [10, 11] and r3["loop_p"] == [3]  # the jump counted, the three stores not


def test_sass_mix_counts_instructions_a_warp_and_tile_and_stalls_by_reason(tmp_path):
    """sass_mix on a made-up source page: opcodes without predicates or modifiers, executions over warps x tiles,
    stall samples summed by reason (the not-issued columns left out), the most-sampled instruction first."""
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
            "stall_barrier", "stall_wait (Not Issued)"]
    rows = [["0x0", "  LOP3.LUT R1, R2, 0xf, RZ, 0xc0, !PT", "10", "400", "7", "3", "99"],
            ["0x10", "  @!P0 LOP3.LUT R3, R2, 0xf0, RZ, 0xc0, !PT", "2", "200", "2", "0", "99"],
            ["0x20", "  HGMMA.64x64x16.F32 R56, R40, gdesc[UR8], R56", "30", "100", "0", "30", "99"]]
    path = tmp_path / "sass.csv"
    path.write_text("\n".join(",".join(f'"{c}"' for c in r) for r in [["Kernel Name", "mla_decode"], head, *rows]))
    out = mix(str(path), warp_tiles=100)
    lines = out.splitlines()
    assert lines[0] == "warp instructions executed: 700 (7.0 a warp and tile)"
    assert lines[3].split() == ["LOP3", "6.0"] and lines[4].split() == ["HGMMA", "1.0"]
    assert "warp-stall samples: 42, by reason:" in out
    assert [ln.split()[:2] for ln in lines if ln.startswith("  barrier") or ln.startswith("  wait")] == \
        [["barrier", "33"], ["wait", "9"]]
    assert lines[-3].split()[:2] == ["30", "HGMMA.64x64x16.F32"]


def test_mma_rate_modes_compile_to_their_tensor_instructions(tmp_path):
    """Every mode of the tensor-pipe benchmark (mma_rate.cu) builds for sm_90a with the kernels' ptx.cuh, and each
    compiles to the instruction it times: HMMA for mma.sync on fp16 (and for e4m3, which sm_90 converts), IMMA for s8,
    HGMMA, QGMMA and IGMMA for the warpgroup products on fp16, e4m3 and s8."""
    from quantmla.kernels.cuda import build
    from quantmla_lab.bench.kernels import mma_rate

    if build.nvcc() is None:
        pytest.skip("needs nvcc")
    from quantmla_lab.bench.kernels.sass_count import cuobjdump

    want = {0: "HMMA.16816", 1: "HGMMA.64x16x16", 2: "HMMA.16816", 3: "IMMA.16832.S8.S8", 4: "HGMMA.64x32x16",
            5: "QGMMA.64x32x32", 6: "IGMMA.64x32x32", 7: "QGMMA.64x16x32", 8: "QGMMA.64x48x32"}
    assert set(want) == set(mma_rate.NAME)
    for mode, op in want.items():
        sass = subprocess.run([cuobjdump(), "-sass", str(mma_rate.cubin(mode, 2, 8, tmp_path))], capture_output=True,
                              text=True, check=True).stdout
        assert op in sass, (mode, op)


def test_tokens_m_64_builds_compile_without_serialized_products(tmp_path):
    """The 64-row tokens-as-M timing model (tokens_m_64.cu) builds for sm_90a with the kernels' headers: its default
    builds keep their warpgroup products asynchronous where ptxas has the registers (the builds the docs quote: no
    serialization, no spills), compile to HGMMA m64n64k16 with register A operands, and bad --builds are refused
    with the fix."""
    from quantmla.kernels.cuda import build
    from quantmla_lab.bench.kernels import tokens_m_64 as tm

    with pytest.raises(SystemExit, match="NAME one of"):
        tm.parse_build("ZL=1,BOGUS=2")
    with pytest.raises(SystemExit, match="multiple of 8"):
        tm.parse_build("REGS_S=150")
    with pytest.raises(SystemExit, match="NAME one of"):
        tm.parse_build("NPBUF=1")  # fixed in the .cu, not a build option
    assert tm.parse_build("ZL=0,SG=4") == {"ZL": 0, "SG": 4}
    assert tm.smem_bytes(0) <= 227 * 1024 and tm.smem_bytes(1) <= 227 * 1024
    if build.nvcc() is None:
        pytest.skip("needs nvcc")
    from quantmla_lab.bench.kernels.sass_count import cuobjdump

    for spec in tm.DEFAULT_BUILDS[:3]:  # DQA, masked codes with and without the zero-point product
        path, ptx = tm.cubin(tm.parse_build(spec), 512, tmp_path)  # the runs' --iters
        assert ptx == {"registers": 168, "spill_store_bytes": 0, "products_serialized": False}, (spec, ptx)
        sass = subprocess.run([cuobjdump(), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
        # every product m64n64k16 with its A operand in registers (HGMMA d, a-register, B descriptor), setmaxnreg used
        products = re.findall(r"HGMMA\.64x64x16\.F32\S* R\d+, (\S+), gdesc", sass)
        assert products and all(a.startswith("R") for a in products) and "USETMAXREG" in sass, spec
    # ptxas serializes the products where the output keeps a k-step in flight (OUT_WAIT=1) beside both planes'
    # accumulators at once
    _, serial = tm.cubin(tm.parse_build("ZL=1,ONE_ACC=0,OUT_WAIT=1,REGS_S=152"), 512, tmp_path)
    assert serial["products_serialized"]


def test_tokens_m_64_query_order_and_swizzle():
    """The timing model's host side (no GPU): query_channel is a permutation of the 576 channels in which every content
    k-step reads one metadata group (128 channels) and the RoPE k-steps read channels 512-575, and `swizzled` puts
    16-byte unit j of row r at r·128 + ((j ^ (r % 8)) << 4), wgmma.cuh's swz."""
    import torch

    from quantmla_lab.bench.kernels import tokens_m_64 as tm

    order = [[tm.query_channel(K, k) for k in range(16)] for K in range(36)]
    assert sorted(c for row in order for c in row) == list(range(576))
    for K, row in enumerate(order):
        groups = {c // 128 for c in row} if K < 32 else {4 if c >= 512 else -1 for c in row}
        assert len(groups) == 1 and -1 not in groups, (K, row)
    # column k of a content k-step is byte 16t + 4s + (0, 2, 1, 3) of the thread's 16-byte load, plane K % 2
    assert order[0][:4] == [0, 2, 16, 18] and order[0][8:12] == [1, 3, 17, 19] and order[1][0] == 256
    assert order[32][:2] == [512, 514] and order[33][0] == 544
    x = torch.arange(2 * 64 * 64, dtype=torch.int16).view(2, 64, 64).view(torch.float16)
    b = tm.swizzled(x).view(torch.int16).view(2, 64 * 64)
    for c, r, col in ((0, 0, 0), (0, 3, 17), (1, 9, 63), (1, 63, 40)):
        j, e = col // 8, col % 8
        off = r * 128 + ((j ^ (r % 8)) << 4) + 2 * e  # bytes
        assert int(b[c, off // 2]) == int(x[c, r, col].view(torch.int16)), (c, r, col)


def test_tokens_m_64_page_is_the_cache_formats():
    """The timing model's page (tm64_ops.cuh's FB_* sections, one after another, and the driver's RAW_BYTES) is the
    INT4/INT4 cache page of groups 128/64 that the library's plan describes (kernels.cuda.decode_plan's macros), so
    the model reads the format the cache writes rather than a copy of it that could drift."""
    from unittest import mock

    import torch

    from quantmla.cache.layout import PageLayout, TokenLayout, preset
    from quantmla.kernels import cuda
    from quantmla_lab.bench.kernels import tokens_m_64 as tm

    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        m = dict(cuda.decode_plan(lay, 16, torch.bfloat16, torch.device("cuda"), tokens_m=True).macros)
    src = Path(tm.__file__).with_name("tm64_ops.cuh")  # the sections the model reads
    fb = {k: int(v) for k, v in re.findall(r"\b(FB_(?:CC|RC|CM|RM)) = (\d+)", src.read_text())}
    assert fb == {k: m[k] for k in ("FB_CC", "FB_RC", "FB_CM", "FB_RM")}
    offsets = {"OFF_CC": 0, "OFF_RC": 64 * fb["FB_CC"], "OFF_CM": 64 * (fb["FB_CC"] + fb["FB_RC"]),
               "OFF_RM": 64 * (fb["FB_CC"] + fb["FB_RC"] + fb["FB_CM"])}  # the .cu's RAW_* offsets
    assert offsets == {k: m[k] for k in offsets} and tm.RAW_BYTES == m["PAGE_BYTES"] == 64 * lay.token.bytes_per_token


def test_tokens_m_64_query_channel_twins_agree(tmp_path):
    """tm64_ops.cuh's query_channel (constexpr, host and device) equals the Python twin at all 576 columns, and its
    query_position (where the model's prologue writes a channel) is the inverse: nvcc compiles a static_assert of
    each, and fails on a wrong one."""
    from quantmla.kernels.cuda import build
    from quantmla_lab.bench.kernels import tokens_m_64 as tm

    if build.nvcc() is None:
        pytest.skip("needs nvcc")
    checks = "\n".join(f"static_assert(query_channel({K}, {k}) == {c}, \"{K} {k}\");\n"
                       f"static_assert(query_position({c}) == {16 * K + k}, \"{c}\");"
                       for K in range(36) for k in range(16) for c in [tm.query_channel(K, k)])
    src = tmp_path / "twins.cu"
    head = ('#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <stdint.h>\ntypedef __half T;\n'
            'typedef __half2 T2;\n#define MMA_TYPE "f16"\n#define WG_AB "f16"\n'
            '#include "ptx.cuh"\n#include "wgmma.cuh"\n#include "tm64_ops.cuh"\n')

    def compiles(text: str) -> subprocess.CompletedProcess:
        src.write_text(text)
        return subprocess.run([build.nvcc(), "-c", "-std=c++17", f"-I{build.SOURCE.parent}",
                               f"-I{Path(tm.__file__).parent}", "-arch=sm_90a", "-o", str(tmp_path / "twins.o"),
                               str(src)], capture_output=True, text=True, check=False)

    r = compiles(head + checks + "\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert compiles(head + checks.replace("== 0,", "== 1,", 1) + "\n").returncode != 0  # channel 0 is not 1
