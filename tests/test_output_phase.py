"""The 8-bit output-products design of the output-phase bench (lab/.../kernels/output_phase.{cu,py}): its host-side
operands and, on the CPU, the kernel's own index arithmetic (words, transposes, plane masks, A and B fragments,
accumulator fold and store) against an fp64 reference of the same operands."""

import pytest
import torch

from quantmla_lab.bench.kernels import output_phase as op


@pytest.mark.parametrize("mode", [1, 2])
def test_the_kernels_index_arithmetic_gives_the_codes_times_p_scale(mode):
    codes, x = op.operands(seed=3)
    hi, lo, held, f = op.terms(x, mode)
    want = torch.einsum("tc,gnt->gnc", op.channel_codes(codes), held)
    want = torch.stack([want[c // 128, :, c] for c in range(512)])  # each channel reads its own group's P·scale
    got = op.emulate(codes, op.b8_layout(hi, lo), mode) * (512 if mode == 1 else 1)
    assert float((got - want).norm() / want.norm()) < 1e-12
    # the codes of other tokens (all 64 in reverse order) are caught
    bad = op.emulate(codes.flip(0), op.b8_layout(hi, lo), mode) * (512 if mode == 1 else 1)
    assert float((bad - want).norm() / want.norm()) > 1e-2


def test_two_terms_hold_p_scale_closely_and_fp16_order_is_a_permutation():
    codes, x = op.operands()
    for mode, bound in ((1, 2e-3), (2, 1e-4)):
        hi, lo, held, f = op.terms(x, mode)
        assert float(((held / f - x).norm() / x.norm())) < bound
        assert hi.dtype == lo.dtype == torch.uint8
    p16, held = op.mode0_p16(x)
    assert torch.equal(p16.sort(-1).values, held.to(torch.float16).sort(-1).values)
    assert not torch.equal(p16, held.to(torch.float16))  # reordered into the mma.sync k order


def test_b8_layout_puts_each_term_where_q8_at_reads_it():
    codes, x = op.operands()
    hi, lo, _, _ = op.terms(x, 2)
    b = op.b8_layout(hi, lo)
    for grp, s, n, k in ((0, 0, 0, 0), (1, 1, 17, 31), (3, 0, 9, 16), (2, 1, 31, 5)):
        term = hi if n < 16 else lo
        assert int(b[grp, s, (k >> 4) * 512 + (n >> 3) * 128 + (n & 7) * 16 + (k & 15)]) == int(term[grp, n % 16, 32 * s + k])


@pytest.mark.parametrize("mode", [1, 2])
def test_the_pretransposed_tile_gives_the_same_products(mode):
    """PRET=1: each thread's transposed words come from one 16-byte slot of the interleaved tile, and the products
    are those of the tokens' rows; a tile without the slot swizzle is caught."""
    codes, x = op.operands(seed=5)
    hi, lo, held, f = op.terms(x, mode)
    b8 = op.b8_layout(hi, lo)
    rows = op.emulate(codes, b8, mode)
    assert torch.equal(op.emulate(codes, b8, mode, pret=True), rows)
    tile = op.pretransposed(codes)
    assert sorted(tile.flatten().tolist()) == sorted(codes.flatten().tolist())
    assert int(tile[3, 2 ^ 4, 4 * 1 + 2]) == int(codes[4 * 2 + 2, 4 * 3 + 1])  # word 3 (odd), quad 2, column 13, token 10
    unswizzled = codes.view(16, 4, 64, 4).permute(2, 0, 3, 1).contiguous()
    assert not torch.equal(tile, unswizzled.view(64, 16, 16))
