"""The tokens-as-M kernel's scores on warpgroup MMAs (WG_QK in mla_decode_tm.cu, scores_wg.cuh), host side without a
GPU: which plans take it, what they refuse and say, and that its builds compile for sm_90a where nvcc is installed.
The kernel itself runs in tests/test_kernels_gpu.py (the tokens-as-M cases with id "wsq", and its outputs equal the
mma.sync scores' bit for bit)."""

from unittest import mock

import pytest
import torch

from quantmla.cache.layout import PageLayout, TokenLayout, preset
from quantmla.kernels import cuda
from quantmla.kernels.cuda import build

CUDA = torch.device("cuda")


def plan(fmt, **kw):
    lay = PageLayout(TokenLayout(512, 64, preset(fmt)), 64)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        return lay, cuda.decode_plan(lay, 16, torch.bfloat16, CUDA, tokens_m=True, **kw)


@pytest.mark.parametrize("name", ["int4/int4", "int2/int4"])
def test_wgmma_scores_plan_is_the_warps_apart_plan_plus_one_macro(name):
    """Asked for, the plan is the default one (8 warps apart, one token block a warp, the same stages and shared
    memory: the query block keeps its size) with WG_QK set, and says so in its name; not asked for, WG_QK is absent."""
    _, base = plan(name)
    _, q = plan(name, wgmma_scores=True)
    mb, mq = dict(base.macros), dict(q.macros)
    assert "WG_QK" not in mb and mq.pop("WG_QK") == 1 and mq == mb
    assert (q.stages, q.smem, q.ctas_per_sm) == (base.stages, base.smem, base.ctas_per_sm)
    assert "w8wsqs" in q.describe() and "wsq" not in base.describe()


@pytest.mark.parametrize("kw", [{"specialized": False}, {"token_blocks": 2}])
def test_wgmma_scores_refused_outside_the_warps_apart_plan(kw):
    """With 4 warps, or two token blocks a warp, the warpgroup of scores does not exist: refused with the reason."""
    lay, p = plan("int4/int4", wgmma_scores=True, **({"specialized": True} | kw))
    assert p is None and "scores on warpgroup MMAs" in cuda.plan_reason[lay]


def test_wgmma_scores_refused_for_fp8():
    """FP8 has no plan with the warps apart, so none with the scores on warpgroup MMAs."""
    lay, p = plan("fp8", wgmma_scores=True, specialized=True)
    assert p is None and "FP8" in cuda.plan_reason[lay]


def test_config_carries_wgmma_scores():
    """cuda_config asked for the scores on warpgroup MMAs says so in its config (the launch builds the same plan)."""
    from quantmla.kernels.schedule import cuda_config

    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        cfg = cuda_config(16, lay, "cuda", wgmma_scores=True)
        plain = cuda_config(16, lay, "cuda")
    assert cfg.wgmma_scores and cfg.specialized and cfg.describe().startswith("cuda/tm/wsq ")
    assert not plain.wgmma_scores


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("name", ["int4/int4", "int2/int4"])
def test_wgmma_scores_compile_for_sm90(name, tmp_path, monkeypatch):
    """The plan builds for sm_90a; its source refuses two token blocks a warp at compile time, and a pipeline depth
    past what it folds."""
    monkeypatch.setenv("QUANTMLA_CUDA_CACHE", str(tmp_path))
    _, p = plan(name, wgmma_scores=True)
    assert build.compile_cubin(p.macros, "sm_90a").stat().st_size > 10_000
    _, two = plan(name, specialized=True, token_blocks=2)
    with pytest.raises(Exception, match="the scores' warpgroup MMAs"):
        build.compile_cubin(tuple(sorted({**dict(two.macros), "WG_QK": 1}.items())), "sm_90a")
    with pytest.raises(Exception, match="words in flight"):
        build.compile_cubin(tuple(sorted({**dict(p.macros), "WG_QK_DEPTH": 5}.items())), "sm_90a")
