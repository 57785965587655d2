"""RMSNorm in one kernel (kernels/norm.py, TRITON_INTERPRET=1 on CPU) against the transformers modules it
replaces, and the engine's use of it (serving/norms.py): fused inside its steps only, refused with a reason for
a norm that computes something else, the modules' own forwards back after close()."""

import os

import pytest
import torch
from torch import nn
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RMSNorm

from quantmla.model.tiny import tiny_model
from quantmla.serving import norms
from quantmla.serving.engine import BF16_CONFIG, Engine, EngineConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _norm(n, dtype, seed=0):
    m = DeepseekV2RMSNorm(n, eps=1e-6).to(DEV, dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype))
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [512, 96])
def test_kernel_matches_the_module(dtype, n):
    """Rows of [1, T, n], a strided slice of a wider projection (the latent's rows inside kv_a_proj's output)
    and no rows at all: equal to the module within one rounding of the dtype."""
    from quantmla.kernels.norm import rms_norm

    m = _norm(n, dtype)
    g = torch.Generator().manual_seed(1)
    wide = (torch.randn(1, 7, n + 64, generator=g) * 5).to(DEV, dtype)
    for x in (wide[..., :n].contiguous(), wide[..., :n], wide[:, :0, :n]):
        ref, got = m(x), rms_norm(x, m.weight, m.variance_epsilon)
        assert got.shape == ref.shape and got.dtype == dtype and got.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)
        else:  # the same two roundings (of x·rstd, then of weight times it): a sum order apart at most
            step = ref.float().abs().clamp_min(1e-3) * 2.0 ** -7
            assert bool(((got.float() - ref.float()).abs() <= 2 * step).all())
            assert x.numel() == 0 or (got == ref).float().mean() > 0.99


def test_kernel_refuses_a_weight_of_another_dtype_or_size():
    from quantmla.kernels.norm import rms_norm

    x = torch.randn(3, 64, device=DEV)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(64, device=DEV, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32, device=DEV), 1e-6)


class OnePlusRMSNorm(nn.Module):
    """A norm that scales by 1 + weight (as some families do): not what the kernel computes."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1 + self.weight) * h.to(x.dtype)


class _Engine:
    pass


def test_attach_fuses_inside_steps_only_and_detach_restores():
    """Inside a step of an attached engine the kernel runs (both give the same answer, so the dispatch is
    observed through a counter on the kernel); outside steps and for other engines the module's own forward;
    a norm that computes something else keeps its own forward and says why; detach gives every module its
    forward back."""
    model = nn.ModuleDict({"good": _norm(64, torch.float32), "other": OnePlusRMSNorm(64).to(DEV)})
    eng, stranger, active = _Engine(), _Engine(), [None]
    report = norms.attach(model, eng, lambda: active[0], cpu=True)
    assert report["good"] == "fused" and "differs" in report["other"]
    assert "forward" in model["good"].__dict__ and "forward" not in model["other"].__dict__

    calls = []
    import quantmla.kernels.norm as kn
    real = kn.rms_norm
    kn.rms_norm = lambda *a: calls.append(1) or real(*a)
    try:
        x = torch.randn(2, 64, device=DEV)
        ref = model["good"].__dict__[norms._KEY]["orig"](x)
        for who, fused in ((None, False), (stranger, False), (eng, True)):
            active[0] = who
            n = len(calls)
            torch.testing.assert_close(model["good"](x), ref, rtol=2e-6, atol=1e-6)
            assert (len(calls) > n) == fused
    finally:
        kn.rms_norm = real
    norms.detach(model, eng)
    assert "forward" not in model["good"].__dict__ and norms._KEY not in model["good"].__dict__


def test_engine_reports_its_norms_and_restores_them():
    """On the CPU the engine keeps the modules' own forwards and says so; close() leaves them as they were."""
    model = tiny_model("deepseek_v3")
    eng = Engine(model, EngineConfig(quant=BF16_CONFIG, num_pages=8, page_size=16, backend="torch"))
    names = set(norms.rms_norm_modules(model))
    assert set(eng.norms) == names and len(names) >= 3
    assert all(v == "not on a CUDA device" for v in eng.norms.values())
    eng.close()
    assert not any("forward" in m.__dict__ for m in norms.rms_norm_modules(model).values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_gpu_fuses_every_norm_and_matches_generate():
    """On CUDA every RMSNorm of the MLA families is fused, and greedy outputs still equal generate()'s."""
    from quantmla_lab.bench.serving.agreement import engine_agreement

    model = tiny_model("deepseek_v3", first_k_dense_replace=2).cuda()
    eng = Engine(model, EngineConfig(quant=BF16_CONFIG, num_pages=8, page_size=16))
    assert eng.norms and all(v == "fused" for v in eng.norms.values()), eng.norms
    eng.close()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 40, 1)]
    rep, st = engine_agreement(model, BF16_CONFIG, prompts, 16, tie_tol=2e-2, num_pages=24, graph_buckets=(1, 2, 4))
    assert st["graph_steps"] > 0 and rep.ok, rep.details
