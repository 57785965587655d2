"""The cache layout: byte arithmetic (docs/design.md §5), page alignment, compression."""

import pytest

from quantmla.cache.command import table
from quantmla.cache.layout import ALIGN, CacheFormat, PageLayout, TokenLayout, compression, preset
from quantmla.errors import UnsupportedFormatError
from quantmla.quant import BF16, PathFormat


def test_design_example_308_bytes():
    t = TokenLayout(512, 64, CacheFormat(PathFormat(4, 128), PathFormat(4, 64)))
    assert t.field_bytes == {"content_codes": 256, "rope_codes": 32, "content_meta": 16, "rope_meta": 4}
    assert t.bytes_per_token == 308
    assert TokenLayout(512, 64, CacheFormat(BF16, BF16)).bytes_per_token == 1152


@pytest.mark.parametrize("g", [32, 64, 128])
def test_bytes_per_token_table(g):
    rows = {r["format"]: r for r in table(512, 64)}
    assert rows["BF16"]["bytes_per_token"] == 1152
    rg = min(g, 64)
    meta_c, meta_r = 512 // g * 4, 64 // rg * 4
    assert rows[f"INT8/INT8 g{g}"]["bytes_per_token"] == 512 + 64 + meta_c + 64 // rg * 4
    assert rows[f"INT4/INT4 g{g}"]["bytes_per_token"] == 256 + 32 + meta_c + meta_r
    assert rows[f"INT2/INT4 g{g}"]["bytes_per_token"] == 128 + 32 + meta_c + meta_r


@pytest.mark.parametrize("page_size", [1, 16, 64, 100])
@pytest.mark.parametrize("rope", [PathFormat(4, 32), PathFormat(4, 1, grouping="page"),
                                  PathFormat(4, 1, grouping="page", block=1)])
def test_page_sections_are_aligned_and_disjoint(page_size, rope):
    t = TokenLayout(512, 64, CacheFormat(PathFormat(2, 64), rope))
    p = PageLayout(t, page_size)
    ends = []
    for name, off in p.offsets.items():
        assert off % ALIGN == 0
        size = page_size * t.field_bytes[name] if name in t.field_bytes else p.page_field_bytes[name]
        ends.append((off, off + size))
    ends.sort()
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))
    assert p.page_bytes % ALIGN == 0 and p.page_bytes >= ends[-1][1]


@pytest.mark.parametrize("block,sets", [(0, 1), (64, 1), (16, 4), (1, 64)])
def test_rope_meta_sets_split_the_page_section(block, sets):
    """A RoPE path per channel per page holds page_size / block metadata sets: one set is the section's share
    (a fp16 scale and zero point per channel, 64 x 4 bytes), and per-token metadata has none."""
    p = PageLayout(TokenLayout(512, 64, CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page",
                                                                                   block=block))), 64)
    assert p.rope_meta_set_bytes == 64 * 2 * 2 and p.page_field_bytes["rope_page_meta"] == sets * 64 * 2 * 2
    per_token = PageLayout(TokenLayout(512, 64, CacheFormat(PathFormat(4, 128), PathFormat(4, 64))), 64)
    assert per_token.rope_meta_set_bytes == 0


def test_compression_counts_pages_and_tables():
    fmt = CacheFormat(PathFormat(4, 128), PathFormat(4, 64))
    assert compression(512, 64, fmt, 131072) >= 3.59
    assert compression(512, 64, CacheFormat(PathFormat(2, 128), PathFormat(4, 64)), 131072) >= 5.5
    # a 1-token sequence still allocates a whole page of each
    p = PageLayout(TokenLayout(512, 64, fmt))
    assert p.allocated_bytes(1) == p.page_bytes + 4 + 4
    assert p.allocated_bytes([65, 64], layers=2) == 3 * p.page_bytes * 2 + 3 * 4 + 2 * 4


def test_layout_rejects_formats_that_do_not_fit():
    with pytest.raises(UnsupportedFormatError, match="RoPE path"):
        TokenLayout(512, 64, CacheFormat(PathFormat(4, 64), PathFormat(4, 128)))


def test_decode_bytes_count_every_byte_of_the_pages_read():
    """The bytes a decode reads (benchmarks' GB/s): full pages of every format, per-page RoPE metadata included
    (it was left out: 304 instead of 308 bytes a token for INT4/INT4 with RoPE per channel per page), plus the
    queries and block tables."""
    from quantmla.kernels.schedule import decode_bytes

    page_rope = CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page"))
    for fmt in (preset("bf16"), preset("fp8"), preset("int4/int4"), preset("int2/int4"), page_rope):
        lay = PageLayout(TokenLayout(512, 64, fmt), 64)
        queries, tables = 16 * (512 + 64) * 2, 2048 * 4 + 4
        assert decode_bytes([131072], lay, 16, 1) == 2048 * lay.page_bytes + queries + tables, fmt


def test_a_tile_covers_whole_rope_sets_or_lies_in_one():
    """The kernels' plans ask the layout whether a tile of their size reads whole metadata sets of a page or lies in
    one: per-token metadata always; 16-token sets for 16-, 32- and 64-token tiles; a 16-token tile inside a 32-token
    set or a whole 128-token page's set; never a 24-token tile over 16-token sets (one and a half)."""
    def lay(block, page=64):
        return PageLayout(TokenLayout(512, 64, CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page",
                                                                                           block=block))), page)

    per_token = PageLayout(TokenLayout(512, 64, CacheFormat(PathFormat(4, 128), PathFormat(4, 64))), 64)
    assert all(per_token.tile_covers_rope_sets(n) for n in (16, 32, 64))
    assert lay(16).tile_covers_rope_sets(32) and lay(16).tile_covers_rope_sets(64) and lay(16).tile_covers_rope_sets(16)
    assert lay(32).tile_covers_rope_sets(16) and lay(0, 128).tile_covers_rope_sets(64)
    assert not lay(16, 48).tile_covers_rope_sets(24)  # a 24-token tile over 16-token sets: one and a half
