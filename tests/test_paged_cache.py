"""The page pool (allocation, free list, block tables, allocated bytes) and the reference writer/reader."""

import pytest
import torch

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout
from quantmla.cache.paged import (
    OutOfPagesError,
    PagePool,
    compression_report,
    gather_sequences,
    read_fields,
    read_tokens,
    slots_for,
    write_tokens,
)
from quantmla.quant import PathFormat, quantize_dequantize

INT4 = CacheFormat(PathFormat(4, 128), PathFormat(4, 64))
INT2 = CacheFormat(PathFormat(2, 128), PathFormat(4, 64))


def small_layout(fmt=CacheFormat(PathFormat(4, 16), PathFormat(4, 16)), page=16):
    return PageLayout(TokenLayout(64, 32, fmt), page)


def test_pool_allocates_frees_and_reuses_pages():
    lay = small_layout()
    pool = PagePool(lay, num_pages=6, layers=2)
    s0 = pool.append_slots("a", 17)  # 2 pages
    s1 = pool.append_slots("b", 16)  # 1 page
    assert pool.used_pages == 3 and pool.free_pages == 3
    assert pool.seq_len("a") == 17 and len(pool.pages_of("a")) == 2
    # slots are page * page_size + offset, distinct, and page boundaries fall where expected
    assert len(set(s0.tolist()) | set(s1.tolist())) == 33
    pa = pool.pages_of("a")
    assert s0[15].item() == pa[0] * 16 + 15 and s0[16].item() == pa[1] * 16
    s0b = pool.append_slots("a", 1)  # still inside page 2
    assert pool.used_pages == 3 and s0b.item() == pa[1] * 16 + 1
    pool.free("a")
    assert pool.free_pages == 5 and "a" not in pool
    pool.append_slots("c", 80)  # 5 pages: reuses a's
    assert pool.free_pages == 0
    with pytest.raises(OutOfPagesError, match="free"):
        pool.append_slots("d", 1)
    assert "d" not in pool and pool.sequences == ["b", "c"]  # a sequence refused its pages is not added


def test_block_table_and_lengths():
    lay = small_layout()
    pool = PagePool(lay, 10)
    pool.append_slots(0, 40)
    pool.append_slots(1, 1)
    pool.append_slots(2, 0)
    bt = pool.block_table([0, 1, 2])
    assert bt.dtype == torch.int32 and bt.shape == (3, 3)
    assert bt[0].tolist() == pool.pages_of(0) and bt[1, 0].item() == pool.pages_of(1)[0]
    assert pool.seq_lens([0, 1, 2]).tolist() == [40, 1, 0]
    slots = slots_for(bt, torch.tensor([0, 0, 1]), torch.tensor([0, 33, 0]), 16)
    assert slots.tolist() == [pool.pages_of(0)[0] * 16, pool.pages_of(0)[2] * 16 + 1, pool.pages_of(1)[0] * 16]


@pytest.mark.parametrize("lens", [[1], [64, 65], [4096, 1, 130]])
def test_allocated_bytes_match_the_layout_definition(lens):
    lay = PageLayout(TokenLayout(512, 64, INT4))
    pool = PagePool(lay, sum(lay.pages_for(n) for n in lens), layers=3, device="meta")
    for i, n in enumerate(lens):
        pool.append_slots(i, n)
    assert pool.allocated_bytes() == lay.allocated_bytes(lens, layers=3)


def test_compression_from_allocated_bytes():
    rows = {r["tokens"]: r for r in compression_report(512, 64, INT4)}
    assert set(rows) == {4096, 32768, 131072}
    assert rows[131072]["bytes_per_token"] == 308
    assert rows[131072]["compression"] >= 3.59
    assert {r["tokens"]: r for r in compression_report(512, 64, INT2)}[131072]["compression"] >= 5.5
    # allocated bytes include the last partial page and the tables
    assert rows[4096]["allocated_bytes"] == PageLayout(TokenLayout(512, 64, INT4)).allocated_bytes(4096)


FORMATS = [
    CacheFormat(),
    CacheFormat(PathFormat(4, 16), PathFormat(4, 16)),
    CacheFormat(PathFormat(2, 32), PathFormat(8, 32)),
    CacheFormat(PathFormat(4, 64, "symmetric"), PathFormat(4, 16, meta_dtype="bfloat16")),
    CacheFormat(PathFormat(3, 32), PathFormat(8, 16, "fp8")),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.describe())
def test_writer_reader_round_trip(fmt):
    torch.manual_seed(0)
    lay = small_layout(fmt)
    pool = PagePool(lay, 8)
    pool.data.random_(0, 256)  # garbage outside written records must not matter
    before = pool.data.clone()
    slots = pool.append_slots("s", 37)
    x = torch.randn(37, 64) * 3 + 1
    r = torch.randn(37, 32)
    write_tokens(pool.layer(0), lay, slots, x, r)
    c, k = read_tokens(pool.layer(0), lay, slots)
    xr = x.to(torch.bfloat16).float() if not fmt.content.quantized else x
    rr = r.to(torch.bfloat16).float() if not fmt.rope.quantized else r
    torch.testing.assert_close(c, quantize_dequantize(xr, fmt.content).float(), rtol=0, atol=0)
    torch.testing.assert_close(k, quantize_dequantize(rr, fmt.rope).float(), rtol=0, atol=0)
    # only the written records changed
    changed = (pool.data != before).reshape(-1).nonzero().squeeze(1)
    fields = read_fields(pool.layer(0), lay, slots)
    assert changed.numel() <= sum(f.numel() for f in fields.values())


def test_negative_slots_are_skipped_and_gather_pads_with_zeros():
    lay = small_layout()
    pool = PagePool(lay, 4)
    pool.data.fill_(0xFF)
    slots = pool.append_slots(0, 20)
    x, r = torch.randn(20, 64), torch.randn(20, 32)
    s2 = slots.clone()
    s2[5] = -1
    write_tokens(pool.layer(0), lay, s2, x, r)
    c, k = gather_sequences(pool.layer(0), lay, pool.block_table([0]), torch.tensor([20]), max_len=24)
    assert c.shape == (1, 24, 64) and torch.all(c[0, 20:] == 0)
    assert torch.isnan(c[0, 5]).any() or not torch.isfinite(c[0, 5]).all()  # never written: 0xFF bytes
    ref, _ = read_tokens(pool.layer(0), lay, slots[:5])
    torch.testing.assert_close(c[0, :5], ref)


def test_pool_rejects_wrong_page_tensor():
    lay = small_layout()
    with pytest.raises(Exception, match="uint8"):
        write_tokens(torch.zeros(4, lay.page_bytes, dtype=torch.float16), lay, torch.tensor([0]), torch.zeros(1, 64), torch.zeros(1, 32))


def test_slot_of_gives_one_address_for_ints_arrays_and_tensors():
    """A token's slot is its page's id times the page size plus its offset, whichever form the positions take."""
    import numpy as np

    from quantmla.cache.paged import slot_of

    pages, ps = [7, 3, 12, 5], 16
    pos = [0, 15, 16, 33, 63]
    want = [7 * 16, 7 * 16 + 15, 3 * 16, 12 * 16 + 1, 5 * 16 + 15]
    assert [slot_of(pages, p, ps) for p in pos] == want and all(type(slot_of(pages, p, ps)) is int for p in pos)
    assert slot_of(pages, np.array(pos), ps).tolist() == want
    assert slot_of(pages, torch.tensor(pos), ps).tolist() == want
    assert slot_of(np.array(pages), np.array(pos), ps).tolist() == want
