"""Greedy tokens in two kernels (kernels/sampling.py, TRITON_INTERPRET=1 on CPU) against torch's argmax with its
non-finite guard (serving.graphs.greedy's CPU path): the first of a row's largest logits, NONFINITE for a row with
NaN or Inf, at vocabularies that are and are not a multiple of the kernel's block."""

import os

import pytest
import torch

from quantmla.kernels import sampling
from quantmla.serving.graphs import NONFINITE, greedy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_greedy(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x).all(-1), x.argmax(-1), NONFINITE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("V", [1, 37, 4096, 10000])
def test_tokens_equal_torchs_with_ties_and_nonfinite_rows(dtype, V, monkeypatch):
    monkeypatch.setattr(sampling, "BLOCK_V", 1024)  # several blocks a row at the larger vocabularies
    g = torch.Generator().manual_seed(V)
    x = (torch.randn(9, V, generator=g) * 4).round()  # few distinct values: ties within and across blocks
    if V > 1:
        x[1, V // 3] = x[1, -1] = 50.0  # the same maximum twice, the first one wins
        x[2, V - 1] = 60.0  # the maximum in the last, partial block
        x[3, 0] = float("nan")
        x[4, V // 2] = float("inf")
        x[5, -1] = float("-inf")
        x[6] = -3.0  # a row of one value: token 0
    else:
        x[3, 0] = float("nan")
    x = x.to(DEV, dtype)
    want = _torch_greedy(x)
    got = sampling.greedy_tokens(x, NONFINITE)
    assert got.dtype == torch.int64 and got.device == x.device
    assert got.tolist() == want.tolist()
    if V > 1:
        assert got[1].item() == V // 3 and got[2].item() == V - 1 and got[6].item() == 0
        assert got[3].item() == got[4].item() == got[5].item() == NONFINITE
    assert got[:0].numel() == 0


def test_strided_rows_and_no_rows():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(4, 300, generator=g).to(DEV, torch.bfloat16)
    x = wide[:, :257]  # rows strided, the last dim contiguous
    assert sampling.greedy_tokens(x, NONFINITE).tolist() == _torch_greedy(x).tolist()
    assert sampling.greedy_tokens(x[:0], NONFINITE).shape == (0,)
    assert greedy(x).tolist() == _torch_greedy(x).tolist()  # the engine's entry point, either device


@pytest.mark.parametrize("bad,match", [(torch.zeros(3, dtype=torch.float32), "rows, vocabulary"),
                                       (torch.zeros(2, 3, dtype=torch.int64), "floating-point"),
                                       (torch.zeros(2, 0), "vocabulary is empty"),
                                       (torch.zeros(2, 3, dtype=torch.float64), "fit fp32 unrounded")])
def test_bad_logits_are_refused_before_launch(bad, match):
    with pytest.raises(ValueError, match=match):
        sampling.greedy_tokens(bad.to(DEV), NONFINITE)


def test_fp64_logits_keep_torchs_tokens():
    """fp64 logits that fp32 would merge into a tie (or overflow to Inf) take torch's path in ``greedy``."""
    x = torch.tensor([[1.0, 1.0 + 2.0**-40, 0.0], [1e300, 1e301, 0.0]], dtype=torch.float64, device=DEV)
    assert greedy(x).tolist() == [1, 1] == _torch_greedy(x).tolist()
