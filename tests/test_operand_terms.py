"""The lab's model of 8-bit product operands (quantmla_lab.bench.kernels.e4m3_operands): a value split into e4m3 or
s8 terms rounds as those formats do, and the emulated decode arithmetic matches fp64 where nothing rounds."""

import torch

from quantmla_lab.bench.kernels.e4m3_operands import D_C, D_R, decode, e4m3_terms, make_cache, s8_terms


def test_s8_terms_round_to_their_last_unit():
    """n s8 terms after the row's factor to 127: each value within half of the last term's unit (2^-7(n-1)) of the
    scaled row, every term an integer in [-127, 127] of its unit; a power-of-two factor per tile where asked."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=g, dtype=torch.float64) * torch.tensor([[1e-3], [1.0], [7.0], [1e4]])
    for n in (1, 2, 3):
        y = s8_terms(x, n)
        f = 127.0 / x.abs().amax(-1, keepdim=True)
        err = ((y - x) * f).abs().max()
        assert err <= 0.5 * 2.0 ** (-7 * (n - 1)) + 1e-12, (n, float(err))
        first = torch.round(x * f).clamp(-127, 127)
        assert (first.abs() <= 127).all() and torch.allclose(s8_terms(x, 1) * f, first)
    t = s8_terms(x.abs(), 1, tile=64)  # per 64-value tile, a power of two: the tile's largest in (63.5, 127]
    for row in range(4):
        for k in range(0, 256, 64):
            v = x[row, k:k + 64].abs()
            f = 2.0 ** torch.floor(torch.log2(127.0 / v.max()))
            assert torch.allclose(t[row, k:k + 64], torch.round(v * f) / f)


def test_e4m3_terms_gain_bits_with_each_term():
    """Each e4m3 term takes about 4 more significant bits off the error (after the factor to 448)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 512, generator=g, dtype=torch.float64)
    errs = [float(((e4m3_terms(x, n) - x).abs() / x.abs().amax(-1, keepdim=True)).max()) for n in (1, 2, 3)]
    assert errs[0] < 2.0 ** -4 and errs[1] < errs[0] / 8 and errs[2] < errs[1] / 8, errs


def test_emulated_decode_matches_fp64_where_nothing_rounds():
    """With three s8 terms of the query and of p·scale the emulated kernel arithmetic is within 1e-3 of fp64 (the
    rest is the bf16 output), and one e4m3 term of each is far off (about 9e-2): the model tells the formats apart."""
    g = torch.Generator().manual_seed(2)
    codes, scales, zeros = make_cache(256, 4, g)
    q = torch.randn(4, D_C + D_R, generator=g, dtype=torch.float64)
    sm = 1.0 / (192 ** 0.5)
    ref = decode(q, codes, scales, zeros, sm, "fp64", None)
    rel = lambda m: float((decode(q, codes, scales, zeros, sm, m, None) - ref).norm() / ref.norm())  # noqa: E731
    assert rel("s8 q3p3") < 3e-3 and rel("e4m3 q1p1") > 2e-2
    assert rel("s8 q2p2") < rel("s8 q1p2")
