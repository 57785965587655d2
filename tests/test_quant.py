"""Quantizers and packing: round trips, error bounds, clear errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.quant_cases import far_groups
from quantmla.errors import MetadataRangeError, NonFiniteError, UnsupportedFormatError
from quantmla.quant import PathFormat, dequantize, fake_quant, pack, quantize, quantize_dequantize, unpack

SETTINGS = settings(max_examples=40, deadline=None)


@SETTINGS
@given(bits=st.sampled_from([2, 3, 4, 8]), rows=st.integers(1, 5), width=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(bits, rows, width, seed):
    dim = width * 8
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, 3, dim), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (rows, 3, dim * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits, dim), codes)


def test_planar_packing_layout():
    """Byte j holds codes j + k·P in bits [k·b, (k+1)·b) — the layout the kernels unpack."""
    codes = torch.arange(16, dtype=torch.uint8) % 4  # 2-bit, P = 4
    packed = pack(codes[None], 2)[0]
    for j in range(4):
        expect = sum(int(codes[j + k * 4]) << (2 * k) for k in range(4))
        assert int(packed[j]) == expect
    c4 = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.uint8)
    assert pack(c4, 4)[0].tolist() == [1 | 5 << 4, 2 | 6 << 4, 3 | 7 << 4, 4 | 8 << 4]


@SETTINGS
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    group=st.sampled_from([8, 16, 32, 64]),
    mode=st.sampled_from(["affine", "symmetric"]),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_int_quantization_error_bound(bits, group, mode, scale, seed):
    fmt = PathFormat(bits, group, mode)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 2, 128, generator=g) * scale
    y = quantize_dequantize(x, fmt)
    xg, yg = x.reshape(4, 2, -1, group), y.reshape(4, 2, -1, group)
    if mode == "affine":
        step = (xg.amax(-1) - xg.amin(-1)) / (2**bits - 1)
    else:
        step = xg.abs().amax(-1) / (2 ** (bits - 1) - 1)
    # half a step, plus the fp16 rounding of the stored scale/zero (relative 2^-11 of the group range)
    bound = step / 2 + xg.abs().amax(-1) * 2**-9 * (2**bits)
    assert ((xg - yg).abs().amax(-1) <= bound + 1e-6).all()


def test_constant_and_zero_groups_are_exact():
    x = torch.zeros(2, 64)
    x[0, :32] = 3.25
    x[1, 32:] = -1.5
    for fmt in [PathFormat(4, 32), PathFormat(2, 32), PathFormat(3, 32)]:  # affine: zero point = the value
        assert torch.equal(quantize_dequantize(x, fmt), x), fmt
    for fmt in [PathFormat(8, 32, "symmetric"), PathFormat(4, 32, "symmetric"), PathFormat(8, 32, "fp8")]:
        y = quantize_dequantize(x, fmt)
        assert torch.equal(y[0, 32:], x[0, 32:]) and torch.equal(y[1, :32], x[1, :32]), fmt  # all-zero groups
        torch.testing.assert_close(y, x, rtol=2e-3, atol=0), fmt


def test_fp8_matches_torch_e4m3():
    x = torch.randn(3, 64) * 10
    fmt = PathFormat(8, 64, "fp8")
    y = quantize_dequantize(x, fmt)
    s = (x.abs().amax(-1, keepdim=True) / 448).half().float()
    ref = (x / s).to(torch.float8_e4m3fn).float() * s
    torch.testing.assert_close(y, ref)


def test_codes_use_the_stored_scale():
    """Dequantizing the stored codes with the stored fp16 metadata reproduces quantize_dequantize."""
    x = torch.randn(5, 64) * 7
    fmt = PathFormat(4, 16)
    q = quantize(x, fmt)
    assert q.meta.dtype == torch.float16 and q.meta.shape == (5, 4, 2)
    codes = unpack(q.codes, 4, 64).float().reshape(5, 4, 16)
    manual = (codes * q.meta[..., :1].float() + q.meta[..., 1:].float()).reshape(5, 64)
    assert torch.equal(manual, dequantize(q, fmt, 64))


def test_bf16_meta_dtype():
    x = torch.randn(2, 64)
    y = quantize_dequantize(x, PathFormat(4, 32, meta_dtype="bfloat16"))
    assert (y - x).abs().max() < 1.0


@pytest.mark.parametrize("meta", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_affine_grid_spans_groups_far_from_zero(meta, bits):
    """The stored zero is rounded down and the scale up, so [zero, zero + (2^b - 1)·scale] spans each group and every
    value dequantizes within half a stored step (rounded to nearest, a bf16 zero of [1002.5, 1003.5] clamped its
    low values by up to 1.5 against a step of 0.004 at 8 bits)."""
    x = far_groups(bits)
    fmt = PathFormat(bits, 32, "affine", meta)
    q = quantize(x, fmt)
    scale, zero = q.meta[..., 0].double(), q.meta[..., 1].double()  # [8, 1]
    assert (zero[:, 0] <= x.amin(-1).double()).all()
    assert (zero[:, 0] + (2**bits - 1) * scale[:, 0] >= x.amax(-1).double()).all()
    err = (dequantize(q, fmt, 32) - x).abs().amax(-1).double()
    assert (err <= scale[:, 0] / 2 + 2**-22 * x.abs().amax(-1).double()).all(), (err, scale[:, 0])


@pytest.mark.parametrize("meta", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_symmetric_codes_hold_the_largest_magnitude_of_small_groups(meta, bits):
    """Symmetric scales are rounded up to the metadata dtype, so ±amax stays within the codes and every value is
    within half a stored step, subnormal fp16 scales included (rounded to nearest, INT8 groups of amax 2.5e-5
    saturated by 9 % of amax)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 32, generator=g) * torch.tensor([1e-2, 1e-4, 2.5e-5, 3e-6, 1.0, 7.0])[:, None]
    fmt = PathFormat(bits, 32, "symmetric", meta)
    q = quantize(x, fmt)
    scale = q.meta[..., 0].double()[:, 0]
    assert ((2 ** (bits - 1) - 1) * scale >= x.abs().amax(-1).double()).all()
    err = (dequantize(q, fmt, 32) - x).abs().amax(-1).double()
    assert (err <= scale / 2 + 2**-22 * x.abs().amax(-1).double()).all(), (err, scale)


def test_fake_quant_straight_through():
    x = torch.randn(2, 64, requires_grad=True)
    y = fake_quant(x, PathFormat(2, 32))
    assert not torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_a_clear_error(bad):
    x = torch.randn(2, 64)
    x[1, 5] = bad
    with pytest.raises(NonFiniteError, match="NaN"):
        quantize(x, PathFormat(4, 32))


@pytest.mark.parametrize("mode, lo, hi", [("affine", -7e4, 10.0), ("affine", 0.0, 1.2e6), ("symmetric", -1e6, 1.0),
                                          ("fp8", -3e7, 1.0)])
def test_metadata_past_fp16s_range_is_a_clear_error(mode, lo, hi):
    """Groups whose zero point (affine: the minimum) or scale (range / (2^b - 1), amax / (2^(b-1) - 1) or amax / 448)
    passes fp16's 65504 would store inf metadata and dequantize to NaN: with fp16 metadata quantize and quantize_page
    refuse them, naming the fix; bf16 metadata holds them and dequantizes finitely; values just inside the range
    pass with fp16 metadata."""
    from quantmla.quant.groupwise import quantize_page

    bits = 8 if mode == "fp8" else 4
    x = torch.linspace(0, 1, 4 * 64).reshape(4, 64) * (hi - lo) + lo
    with pytest.raises(MetadataRangeError, match="float16 metadata.*bfloat16 or float32"):
        quantize(x, PathFormat(bits, 32, mode))
    y = quantize_dequantize(x, PathFormat(bits, 32, mode, "bfloat16"))
    assert torch.isfinite(y).all() and float((y - x).abs().max()) < 0.2 * float(x.abs().max())
    assert torch.isfinite(quantize_dequantize(x * 0.05, PathFormat(bits, 32, mode))).all()
    if mode in ("affine", "symmetric"):
        with pytest.raises(MetadataRangeError, match="float16 metadata"):
            quantize_page(x[None], PathFormat(bits, 32, mode, grouping="page"))


def test_metadata_range_edges():
    """An affine group whose zero point fits fp16 but whose scale does not (0 to 1e6: scale 6.7e4) is refused; a
    zero point at -65504 (fp16's largest finite) passes and one at -65520 (rounding to -inf) or +65520 (to +inf, not
    stepped down to 65504) is refused; bf16 metadata that overflows asks about the activations, not for bf16."""
    x = torch.zeros(4, 64)
    x[:, 1::32] = 1e6
    with pytest.raises(MetadataRangeError, match="8 groups with a scale or zero point past float16"):
        quantize(x, PathFormat(4, 32))
    edge = torch.zeros(1, 32)
    edge[0, 0] = -65504.0
    assert torch.isfinite(quantize_dequantize(edge, PathFormat(4, 32))).all()
    edge[0, 0] = -65520.0
    with pytest.raises(MetadataRangeError, match="1 group with"):
        quantize(edge, PathFormat(4, 32))
    above = torch.full((1, 32), 65520.0) + torch.arange(32.0)  # a zero past the range is refused, not stepped down
    for bits in (2, 8):
        with pytest.raises(MetadataRangeError, match="1 group with"):
            quantize(above, PathFormat(bits, 32))
    huge = torch.full((1, 32), 3.3e38)
    huge[0, 0] = -3.3e38
    with pytest.raises(MetadataRangeError, match="past bfloat16.*check the model's activations \\(fp16"):
        quantize(huge, PathFormat(4, 32, "affine", "bfloat16"))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(bits=5), "unsupported bit width"),
        (dict(bits=4, group_size=48), "power of two"),
        (dict(bits=4, mode="nf4"), "unknown quantization mode"),
        (dict(bits=4, mode="fp8"), "fp8"),
        (dict(bits=4, meta_dtype="float64"), "meta_dtype"),
        (dict(bits=2, clip=0.85), "1 - 2\\^-k"),
        (dict(bits=8, mode="fp8", clip=0.875), "integer codes"),
        (dict(bits=16, clip=0.875), "no range to clip"),
    ],
)
def test_bad_formats_are_clear_errors(kw, match):
    with pytest.raises(UnsupportedFormatError, match=match):
        PathFormat(**kw)


def test_group_must_divide_dim():
    with pytest.raises(UnsupportedFormatError, match="does not divide"):
        quantize(torch.randn(2, 48), PathFormat(4, 32))


@pytest.mark.parametrize("mode", ["affine", "symmetric"])
@pytest.mark.parametrize("clip", [0.5, 0.75, 0.875, 0.9375])
def test_clip_shrinks_each_groups_range_and_saturates_beyond_it(mode, clip):
    """A clipped format spans clip of each group's range (affine: centred on the range's middle; symmetric:
    clip x the largest magnitude): the end codes dequantize at the clipped ends, values beyond them saturate."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 32, generator=g) * 3 + 1
    fmt = PathFormat(2, 16, mode, clip=clip)
    y = quantize_dequantize(x, fmt).reshape(64, 2, 16)
    xg = x.reshape(64, 2, 16)
    if mode == "affine":  # codes 0..3 span [lo + t, hi - t]; both ends are reached (values beyond saturate)
        lo, hi = xg.amin(-1), xg.amax(-1)
        t = (hi - lo) * (1 - clip) / 2
        ends = (lo + t, hi - t)
        tol = (hi - lo) * 2**-9 + 1e-6  # the fp16 rounding of the stored scale and zero
        assert ((y.amin(-1) - ends[0]).abs() <= tol).all() and ((y.amax(-1) - ends[1]).abs() <= tol).all()
    else:  # levels (code - 2)·s with s = clip·amax: the top level is clip·amax, every value above it saturates there
        top = xg.abs().amax(-1) * clip
        tol = top * 2**-9 + 1e-6
        ends = (-2 * top, top)
        above = xg >= top[..., None]
        assert above.any() and ((y - top[..., None]).abs() <= tol[..., None])[above].all()
    assert ((y >= ends[0][..., None] - tol[..., None]) & (y <= ends[1][..., None] + tol[..., None])).all()
    q = quantize(x, fmt)
    assert q.codes.shape == quantize(x, PathFormat(2, 16, mode)).codes.shape  # the stored record is unchanged


def test_clip_lowers_int2_error_on_gaussian_groups():
    """Two-bit codes of Gaussian groups: a range of 0.875 of min..max has a lower mean squared error than the
    full range (outer levels nearer the bulk), which is what the clip is for."""
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    err = {c: (quantize_dequantize(x, PathFormat(2, 32, clip=c)) - x).pow(2).mean().item() for c in (1.0, 0.875)}
    assert err[0.875] < 0.9 * err[1.0], err


def test_clip_is_kept_by_the_format_json():
    f = PathFormat(2, 32, clip=0.875)
    assert PathFormat.from_dict(f.to_dict()) == f and f.describe() == "INT2/g32·clip0.875" and f.clip_exp == 3
    assert "clip" not in PathFormat(2, 32).to_dict() and PathFormat(2, 32).clip_exp == 0
    assert PathFormat.from_dict({"bits": 2, "group_size": 32, "clip": 1}).clip == 1.0
    with pytest.raises(UnsupportedFormatError, match="clip must be a number"):
        PathFormat.from_dict({"bits": 2, "group_size": 32, "clip": "0.875"})
