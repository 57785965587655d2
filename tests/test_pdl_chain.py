"""The PDL chain bench (lab/quantmla_lab/bench/serving/pdl_chain.py): its Triton norm and product compute what the
cuBLAS chain computes (the interpreter, PDL and the L2 prefetch off, which need a GPU), and bad input is refused with
the fix before any device is looked at."""

import pytest
import torch

from quantmla_lab.bench.serving import pdl_chain as pc


@pytest.mark.parametrize("tiling", [(32, 128, 4, 3), (16, 64, 4, 4)])
def test_triton_chain_computes_the_cublas_chain(monkeypatch, tiling):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(0)
    layers, hidden, out, rows = 3, 128, 200, 5  # 200 output columns: a last block of W cut short
    weights = [torch.randn(out, hidden, generator=g) * hidden ** -0.5 for _ in range(layers)]
    norm_w = [1 + 0.1 * torch.randn(hidden, generator=g) for _ in range(layers)]
    x = torch.randn(rows, hidden, generator=g) * 3
    ref = x
    for w, nw in zip(weights, norm_w):  # fp64: the RMSNorm of each layer's input, then its product
        r = ref.double()
        h = nw.double() * r * torch.rsqrt((r * r).mean(-1, keepdim=True) + 1e-6)
        ref = (h @ w.double().T)[:, :hidden] if w is not weights[-1] else h @ w.double().T
    got = pc.chain("triton", x, norm_w, weights, tiling, hidden)
    assert got.shape == (rows, out)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, pc.chain("cublas", x, norm_w, weights, None, hidden), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("argv,says", [
    (["--tilings", "32,256,4"], "BLOCK_N,BLOCK_K,WARPS,STAGES"),
    (["--tilings", "32,x,4,3"], "BLOCK_N,BLOCK_K,WARPS,STAGES"),
    (["--rows", "65"], "--rows must be 1 to 64"),
    (["--out-features", "1024"], "at least --hidden"),
])
def test_bad_input_is_refused_before_the_device(argv, says):
    with pytest.raises(SystemExit, match=says):
        pc.main(argv)
