"""The tokens-as-M kernel with its scores' and output's warps apart (WS in mla_decode_tm.cu), host side without a
GPU: which layouts get it by default, its shared-memory map and registers, and that its builds compile for sm_90a
where nvcc is installed. The kernel itself runs in tests/test_kernels_gpu.py (the tokens-as-M cases)."""

from unittest import mock

import pytest
import torch

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout, preset
from quantmla.kernels import cuda
from quantmla.kernels.cuda import build
from quantmla.quant import PathFormat

CUDA = torch.device("cuda")
G64 = CacheFormat(PathFormat(4, 64), PathFormat(4, 32))  # 8 P·scale groups: two P buffers do not fit two CTAs


def plan(fmt, **kw):
    lay = PageLayout(TokenLayout(512, 64, preset(fmt) if isinstance(fmt, str) else fmt), 64)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        return lay, cuda.decode_plan(lay, 16, torch.bfloat16, CUDA, tokens_m=True, **kw)


@pytest.mark.parametrize("name", ["int4/int4", "int2/int4"])
def test_warps_apart_are_the_default_for_integer_codes(name):
    """2- and 4-bit codes get 8 warps (4 of scores, 4 of output), one token block a warp, two P buffers, the
    setmaxnreg split at two CTAs an SM and the shared-memory map with each buffer's row factors."""
    lay, p = plan(name)
    m = dict(p.macros)
    assert (m["WS"], m["NW"], m["WS_REGS"], m["ONE_BARRIER"], p.ctas_per_sm, p.num_warps) == (1, 8, 152, 1, 2, 8)
    assert "TPW" not in m and p.describe().startswith("cuda/f16/tm/M16N64w8wss")
    assert p.smem == m["SMEM_EXPECTED"] == cuda.smem_bytes_tm(lay, p.stages, specialized=True)
    assert cuda.smem_bytes_tm(lay, p.stages, specialized=True) == cuda.smem_bytes_tm(lay, p.stages) + 2 * (16 + 4) * 4
    assert 2 * (p.smem + cuda.SMEM_RESERVED) <= cuda.SMEM_PER_SM
    _, four = plan(name, specialized=False)
    assert dict(four.macros)["NW"] == 4 and "WS" not in dict(four.macros)
    # INT2/INT4: the scores' warps refill the stages, a copy a section; INT4/INT4: the output warps, a 64-token page in
    # one copy (the kernel's defaults); at one CTA an SM, and with the scores on s8, the output warps refill, and every
    # 2-bit plan takes a copy a section
    two = name == "int2/int4"
    assert (m.get("SCORES_REFILL", 0), m.get("WHOLE_PAGE", 1)) == ((2, 0) if two else (0, 1))
    # stages: INT4/INT4 the most that fit (3); INT2/INT4 TM_WS_2BIT_STAGES of the 6 that fit, the other plans the most
    assert p.stages == {"int4/int4": 3, "int2/int4": cuda.TM_WS_2BIT_STAGES}[name]
    others = (plan(name, specialized=True, s8_scores=True)[1], plan(name, specialized=True, ctas_per_sm=1)[1], four)
    for other in others:
        mo = dict(other.macros)
        assert "SCORES_REFILL" not in mo and mo.get("WHOLE_PAGE", 1) == (0 if two else 1), mo
    assert [o.stages for o in others] == ([6, 6, 6] if two else [3, 6, 3])  # (6: more than the cap)


def test_warps_apart_where_they_do_not_fit_or_read():
    """Content groups of 64 (two P buffers and three stages do not fit two CTAs): asked for, refused with the
    reason; by default the 4-warp plan with one P buffer. FP8 keeps its 4-warp plan; two token blocks a warp and
    one CTA an SM (no register split, the most stages) are plans of their own."""
    lay, asked = plan(G64, specialized=True)
    assert asked is None and "do not fit 2 CTAs" in cuda.plan_reason[lay]
    _, default = plan(G64)
    assert "WS" not in dict(default.macros) and dict(default.macros)["ONE_BARRIER"] == 0
    lay, fp8 = plan("fp8")
    assert "WS" not in dict(fp8.macros) and dict(fp8.macros)["NW"] == 4
    lay, bad = plan("fp8", specialized=True)
    assert bad is None and "FP8 with the scores' and the output's warps apart" in cuda.plan_reason[lay]
    lay, one = plan("int4/int4", specialized=True, ctas_per_sm=1)
    m = dict(one.macros)
    assert (m["WS"], m["MIN_CTAS"], one.ctas_per_sm, one.stages) == (1, 1, 1, cuda.TM_MAX_STAGES) and "WS_REGS" not in m
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):  # three CTAs an SM: 4 warps by default
        three = cuda.tokens_m_plan(lay, 16, torch.bfloat16, ctas_per_sm=3)
    assert "WS" not in dict(three.macros) and dict(three.macros)["MIN_CTAS"] == 3
    _, two = plan("int4/int4", specialized=True, token_blocks=2)
    assert dict(two.macros)["TPW"] == 2 and two.smem == cuda.smem_bytes_tm(lay, two.stages, blocks_per_warp=2,
                                                                            specialized=True)


def test_default_config_carries_the_warps_apart(monkeypatch):
    """cuda_config's default for INT4/INT4 at 16 rows is the plan with the warps apart, and its config says so (the
    launch builds the same plan from it); asked for 4 warps, the config says that."""
    from quantmla.kernels.schedule import cuda_config

    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        cfg = cuda_config(16, lay, "cuda")
        four = cuda_config(16, lay, "cuda", specialized=False)
    assert cfg.tokens_m and cfg.specialized and cfg.num_warps == 8 and cfg.describe().startswith("cuda/tm/ws ")
    assert four.tokens_m and four.specialized is False and four.num_warps == 4


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("name,kw", [("int4/int4", {}), ("int2/int4", {}), ("int4/int4", {"ctas_per_sm": 1}),
                                     ("int2/int4", {"token_blocks": 2})])
def test_warps_apart_compile_for_sm90(name, kw, tmp_path, monkeypatch):
    """Each plan with the warps apart builds for sm_90a (its static_asserts include the host's shared-memory map);
    the per-phase clocks of thread 0 (PHASES) are refused at compile time, and so is a register split that is not
    setmaxnreg's."""
    monkeypatch.setenv("QUANTMLA_CUDA_CACHE", str(tmp_path))
    _, p = plan(name, specialized=True, **kw)
    assert build.compile_cubin(p.macros, "sm_90a").stat().st_size > 10_000
    m = dict(p.macros)
    with pytest.raises(Exception, match="phases are thread 0's"):
        build.compile_cubin(tuple(sorted({**m, "TIMELINE": 1, "PHASES": 1}.items())), "sm_90a")
    with pytest.raises(Exception, match="setmaxnreg's steps"):
        build.compile_cubin(tuple(sorted({**m, "WS_REGS": 150}.items())), "sm_90a")


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("name,spills", [("int4/int4", 0), ("int2/int4", 24)])
def test_s8_scores_build_for_sm90(name, spills, tmp_path, monkeypatch):
    """The scores on 8-bit warpgroup MMAs (S8_QK, a build of the plan with the warps apart, not yet a default): 18 u8·s8
    wgmma m64n32k32 a tile (16 content k-steps, 2 of RoPE), none serialized for want of registers, spills within
    `spills` bytes (INT2/INT4's default build has 8 bytes of stack already); other layouts refused at compile time."""
    import re
    import subprocess

    from quantmla_lab.bench.kernels.sass_count import cuobjdump

    monkeypatch.setenv("QUANTMLA_CUDA_CACHE", str(tmp_path))
    _, p = plan(name, specialized=True, s8_scores=True)
    macros = p.macros
    assert dict(macros)["S8_QK"] == 1
    out = tmp_path / "s8.cubin"
    r = subprocess.run([build.nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                        "-Xptxas", "-v", *[f"-D{k}={v}" for k, v in macros], "-o", str(out), str(build.SOURCE_TM)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    assert "serialized" not in r.stderr and loads and int(loads.group(2)) <= spills, r.stderr[-1500:]
    sass = subprocess.run([cuobjdump(), "-sass", str(out)], capture_output=True, text=True, check=True).stdout
    assert sass.count("IGMMA.64x32x32.U8.S8") == 18 and "HMMA" in sass  # the output products stay on mma.sync
    _, fp8 = plan("fp8")
    with pytest.raises(Exception, match="8-bit warpgroup scores"):
        build.compile_cubin(tuple(sorted({**dict(fp8.macros), "S8_QK": 1}.items())), "sm_90a")


def test_s8_scores_plan_and_config(monkeypatch):
    """s8_scores asks for the build with S8_QK: INT4/INT4 or INT2/INT4 (groups 128/64) with the warps apart and one
    token block a warp; any other format, 4 warps or two token blocks are refused with the reason; the config carries
    it and names it ("cuda/tm/wsq"), and the launch rebuilds the same plan from the config."""
    from quantmla.kernels.schedule import cuda_config

    lay, p = plan("int4/int4", s8_scores=True)
    m = dict(p.macros)
    assert (m["S8_QK"], m["WS"], p.num_warps) == (1, 1, 8) and "TPW" not in m and "w8wsqs" in p.describe()
    assert dict(plan("int4/int4")[1].macros).get("S8_QK") is None  # not the default
    assert dict(plan("int2/int4", s8_scores=True)[1].macros)["S8_QK"] == 1
    for name, kw, why in ((G64, {}, "read INT4/INT4 or INT2/INT4 with groups 128/64"),
                          ("fp8", {}, "FP8 with the scores' and the output's warps apart"),
                          ("int4/int4", {"specialized": False}, "one token block a warp"),
                          ("int4/int4", {"token_blocks": 2}, "one token block a warp")):
        lay2, refused = plan(name, s8_scores=True, **kw)
        assert refused is None and why in cuda.plan_reason[lay2], (name, kw)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        cfg = cuda_config(16, lay, "cuda", s8_scores=True)
        again = cuda.decode_plan(lay, 16, torch.bfloat16, CUDA, tokens_m=True, token_blocks=cfg.token_blocks,
                                 specialized=cfg.specialized, s8_scores=cfg.s8_scores, ctas_per_sm=cfg.ctas_per_sm)
    assert cfg.s8_scores and cfg.describe().startswith("cuda/tm/wsq ") and again == p

