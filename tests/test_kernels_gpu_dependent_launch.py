"""Programmatic dependent launches on the GPU: the combine as a dependent of the CUDA decode kernels
(launch.launch_combine, on by default on Hopper) and the decode kernel as a dependent of the kernel before it
(QUANTMLA_DEPENDENT_LAUNCH=both). With either, every CUDA kernel's split calls give the stream-ordered launch's output bit for bit,
eager and in a CUDA graph, with the outputs and the partials' workspace poisoned just before each call by a kernel
(a combine that read a partial before the decode grid wrote it, or a decode kernel that wrote before the poisoning
kernel ended, would leave NaN). Skipped without CUDA.
Run: TRITON_INTERPRET=0 PYTHONPATH=src:lab:tests pytest -v tests/test_kernels_gpu_dependent_launch.py"""

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from helpers.gpu_decode import FORMATS, check_decode, kernel_config, make_cache, tokens_m64_config, warpgroup_config

from quantmla.kernels import launch
from quantmla.kernels.partials import partial_dtype


def test_combine_is_a_dependent_launch_on_hopper(monkeypatch):
    """On sm_90 and later, with this Triton, the combine launches as a programmatic dependent by default, the decode
    kernel too with QUANTMLA_DEPENDENT_LAUNCH=both; none turns both off."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    monkeypatch.delenv("QUANTMLA_DEPENDENT_LAUNCH", raising=False)
    cuda = torch.device("cuda")
    assert launch.combine_pdl(cuda) and not launch.decode_pdl(cuda)
    monkeypatch.setenv("QUANTMLA_DEPENDENT_LAUNCH", "both")
    assert launch.combine_pdl(cuda) and launch.decode_pdl(cuda)
    monkeypatch.setenv("QUANTMLA_DEPENDENT_LAUNCH", "none")
    assert not launch.combine_pdl(cuda) and not launch.decode_pdl(cuda)


def _call(api, lay, pages, bt, sl, md, q, graph: bool):
    """One decode call with every output and partial poisoned with NaN first (eager, or a CUDA graph's replay)."""
    qc, qr = q
    B, SQ, H, DC = qc.shape
    po, plse = md.partials(H * SQ, DC, partial_dtype(lay), qc.device)
    out = torch.empty(B, SQ, H, DC, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(B, SQ, H, device="cuda")

    def run():
        api.mla_decode_with_kvcache(qc, qr, pages, bt, sl, lay, 1 / math.sqrt(192), metadata=md, out=out, lse=lse)

    if graph:
        run()  # builds and compiles outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
    for t in (po, plse, out, lse):
        t.fill_(float("nan"))
    g.replay() if graph else run()
    torch.cuda.synchronize()
    return out.clone(), lse.clone()


CASES = {  # name: (format, heads, config of (layout, rows))
    "tokens-m int4/int4 16h": ("int4/int4", 16, lambda lay, rows: kernel_config("cuda", lay, 16, 1)),
    "built tile bf16 16h": ("bf16", 16, lambda lay, rows: kernel_config("cuda", lay, 16, 1)),
    "heads-as-M bf16 128h": ("bf16", 128, warpgroup_config),
    "heads-as-M int4/int4 128h": ("int4/int4", 128, warpgroup_config),
    "tokens-m64 int4/int4 128h": ("int4/int4", 128, tokens_m64_config),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("graph", [False, True])
def test_dependent_launches_match_stream_order(name, graph, monkeypatch):
    """Hundreds of splits a sequence (64-token units) and a sequence of one split: with the combine a dependent, and
    with the decode kernel one as well, the output is the stream-ordered one's bit for bit, and the oracle's;
    repeated, each time over poisoned outputs and partials."""
    from quantmla.kernels import api

    fmt, H, config = CASES[name]
    lay, pages, bt, sl = make_cache(FORMATS[fmt], [20000, 3, 4097], seed=len(name))
    cfg = config(lay, H)
    md = check_decode(lay, pages, bt, sl, H, 1, seed=5, config=cfg, chunk_tokens=64)
    assert md.max_splits > 100 and md.variant.startswith("cuda/"), (md.max_splits, md.variant)
    g = torch.Generator(device="cuda").manual_seed(9)
    q = (torch.randn(3, 1, H, 512, generator=g, device="cuda").bfloat16(),
         torch.randn(3, 1, H, 64, generator=g, device="cuda").bfloat16())
    monkeypatch.setenv("QUANTMLA_DEPENDENT_LAUNCH", "none")
    ref = _call(api, lay, pages, bt, sl, md, q, graph)
    for setting in ("combine", "both"):
        monkeypatch.setenv("QUANTMLA_DEPENDENT_LAUNCH", setting)
        for _ in range(5):
            out, lse = _call(api, lay, pages, bt, sl, md, q, graph)
            assert not torch.isnan(out).any() and not torch.isnan(lse).any(), setting
            assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1]), setting
