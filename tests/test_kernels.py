"""Triton kernels under TRITON_INTERPRET=1 (CPU, small shapes): decode vs the
fp64 reference on fresh random inputs with NaN-poisoned outputs, odd lengths, page boundaries, empty
and length-1 sequences, split-KV + combine, multi-token queries, and clear errors for what the kernels
cannot run. The same checks at full shapes run on the GPU in test_kernels_gpu.py."""

import dataclasses
import os
import re

import pytest
import torch
import triton
import triton.language as tl
from helpers.cpu_decode import D_C, D_R, DEV, FORMATS, PAGE, check, make_cache, reference, run_decode

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout
from quantmla.cache.paged import PagePool, gather_sequences
from quantmla.errors import QuantMLAError, UnsupportedFormatError
from quantmla.kernels import (
    DecodeConfig,
    api,
    append_to_pages,
    check_layout_supported,
    get_mla_metadata,
    mla_decode_with_kvcache,
    schedule,
)
from quantmla.kernels.decode import _e4m3_to_f32, _f32_to_e4m3
from quantmla.quant import PathFormat
from quantmla.reference.absorbed import absorbed_attention

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)


# -- decode ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FORMATS))
def test_decode_matches_reference_varlen_with_splits(name):
    # empty, length-1, odd, page boundaries (16, 17, 32), longer than one split
    lens = [0, 1, 15, 16, 17, 32, 77, 300]
    lay, pool, bt, sl = make_cache(FORMATS[name], lens, seed=3)
    o, l, ro, rl, md = run_decode(lay, pool, bt, sl, H=4, SQ=1, chunk_tokens=32)
    assert md.max_splits > 1  # the combine kernel ran (the GPU's 128-token tiles split 300 tokens too)
    check(o, l, ro, rl)


@pytest.mark.parametrize("name", ["bf16", "int4/int4", "int2/int4", "int4/int8"])
@pytest.mark.parametrize("SQ", [2, 4])
def test_decode_multi_token_queries(name, SQ):
    lens = [1, 3, 18, 40]  # sequences shorter than S_q leave early queries with nothing to see
    lay, pool, bt, sl = make_cache(FORMATS[name], lens, seed=SQ)
    o, l, ro, rl, _ = run_decode(lay, pool, bt, sl, H=3, SQ=SQ, seed=SQ + 10)
    check(o, l, ro, rl)


@pytest.mark.parametrize("H", [16, 32])
def test_decode_head_counts(H):
    lens = [5, 33]
    lay, pool, bt, sl = make_cache(FORMATS["int4/int4"], lens, seed=H)
    o, l, ro, rl, md = run_decode(lay, pool, bt, sl, H=H, SQ=1, chunk_tokens=16)
    assert md.head_blocks == -(-H // md.config.block_m)
    check(o, l, ro, rl)


@pytest.mark.parametrize(
    "cfg",
    [
        DecodeConfig(block_m=16, block_n=16, num_stages=1, kernel="generic", deq=0),
        DecodeConfig(block_m=16, block_n=32, num_stages=1, kernel="generic", deq=1),
        DecodeConfig(block_m=32, block_n=16, num_stages=1, kernel="fused", unpack="tl"),
    ],
    ids=lambda c: c.describe(),
)
def test_decode_kernel_variants(cfg):
    lens = [2, 19, 48]
    lay, pool, bt, sl = make_cache(FORMATS["int2/int4"], lens, seed=7)
    o, l, ro, rl, _ = run_decode(lay, pool, bt, sl, H=2, SQ=2, config=cfg, chunk_tokens=32)
    check(o, l, ro, rl)


def test_large_rope_values_keep_precision():
    """Large RoPE keys (the case the project is about) must not lose precision in the score math."""
    lay, pool, bt, sl = make_cache(FORMATS["int4/int8"], [50], seed=11, scale=30.0)
    o, l, ro, rl, _ = run_decode(lay, pool, bt, sl, H=2, SQ=1, scale=0.05)
    check(o, l, ro, rl)


def test_non_causal_and_three_dim_queries():
    lay, pool, bt, sl = make_cache(FORMATS["int4/int4"], [9, 20], seed=5)
    g = torch.Generator().manual_seed(0)
    qc = torch.randn(2, 3, D_C, generator=g).to(DEV, torch.bfloat16)
    qr = torch.randn(2, 3, D_R, generator=g).to(DEV, torch.bfloat16)
    o, l = mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, 0.2, causal=False)
    assert o.shape == (2, 3, D_C) and l.shape == (2, 3)
    one = [torch.empty(2, 1, D_C, dtype=torch.bfloat16, device=DEV), torch.empty(2, 1, device=DEV)]
    o1, l1 = mla_decode_with_kvcache(qc[:, :1].contiguous(), qr[:, :1].contiguous(), pool.layer(0), bt, sl, lay, 0.2,
                                     causal=False, out=one[0], lse=one[1])
    assert o1.shape == (2, 1, D_C) and l1.shape == (2, 1)  # one head stays a dimension, as without out and lse
    assert o1.data_ptr() == one[0].data_ptr()
    torch.testing.assert_close(o1.float(), o[:, :1].float(), atol=2e-2, rtol=2e-2)
    c, k = gather_sequences(pool.layer(0), lay, bt, sl)
    ro, rl = absorbed_attention(qc[:, None].double(), qr[:, None].double(), c.double(), k.double(), 0.2, sl, causal=False)
    check(o[:, None], l[:, None], ro, rl)


def test_cpu_fallback_matches_kernel(monkeypatch):
    lay, pool, bt, sl = make_cache(FORMATS["int2/int4"], [7, 30], seed=9)
    o, l, ro, rl, _ = run_decode(lay, pool, bt, sl, H=2, SQ=2)
    monkeypatch.setattr(api, "interpreting", lambda: False)
    if DEV == "cuda":
        pytest.skip("the torch fallback is for CPU tensors")
    g = torch.Generator().manual_seed(1)
    qc = torch.randn(2, 2, 2, D_C, generator=g).to(torch.bfloat16)
    qr = torch.randn(2, 2, 2, D_R, generator=g).to(torch.bfloat16)
    fo, fl = mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, 0.125)
    torch.testing.assert_close(fo.float(), o.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fl, l, atol=1e-3, rtol=1e-3)
    # the reference checks its inputs as the kernels do: stale metadata, another head count, a narrow block table
    md = get_mla_metadata(torch.tensor([5, 30], dtype=torch.int32), 2, 2, lay)
    with pytest.raises(QuantMLAError, match=re.escape("made for sequence lengths [5, 30], not [7, 30]")):
        mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, 0.125, metadata=md)
    with pytest.raises(QuantMLAError, match="metadata was made for 4 heads"):
        mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, 0.125, metadata=get_mla_metadata(sl, 4, 2, lay))
    with pytest.raises(QuantMLAError, match="needs more than the 1 pages of its block-table row"):
        mla_decode_with_kvcache(qc, qr, pool.layer(0), bt[:, :1], sl, lay, 0.125)


# -- schedule and errors -----------------------------------------------------------------------------
def test_metadata_covers_every_token_once():
    lens = [0, 1, 100, 1000, 64]
    md = get_mla_metadata(torch.tensor(lens, dtype=torch.int32), 16, 1, None, num_sms=8, config=DecodeConfig(block_n=16, min_chunk=16))
    units = md.units.tolist()
    for b, n in enumerate(lens):
        mine = [u for u in units if u[0] == b]
        first, splits = md.seq_info[b].tolist()
        assert len(mine) == splits and units[first][0] == b
        assert all(u[3] == splits for u in mine)
        cover = sorted((u[1], u[2]) for u in mine)
        assert cover[0][0] == 0 and cover[-1][1] == n
        assert all(a[1] == b_[0] for a, b_ in zip(cover, cover[1:]))
    assert md.max_splits > 1


def test_metadata_for_other_lengths_is_refused():
    """Metadata cut for other lengths (an earlier step's, say) is refused naming both, before any launch: shorter
    units would drop tokens, longer ones read slots never written. The tensor it was cut from, unchanged, passes with
    no host read; another tensor of the same values passes once read; an in-place change is caught by its version."""
    lay, pool, bt, sl = make_cache(FORMATS["int4/int4"], [40, 50], seed=3)
    qc = torch.randn(2, 1, 4, D_C).to(DEV, torch.bfloat16)
    qr = torch.randn(2, 1, 4, D_R).to(DEV, torch.bfloat16)
    for stale in ([20, 50], [48, 50]):
        md = get_mla_metadata(torch.tensor(stale, dtype=torch.int32, device=DEV), 4, 1, lay)
        with pytest.raises(QuantMLAError, match=re.escape(f"made for sequence lengths {stale}, not [40, 50]")):
            mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, 0.125, metadata=md)
    mine = sl.clone()
    md = get_mla_metadata(mine, 4, 1, lay)
    o, l = mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, mine, lay, 0.125, metadata=md)
    o2, l2 = mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl.clone(), lay, 0.125, metadata=md)  # same values
    assert torch.equal(o, o2) and torch.equal(l, l2) and len(md.lengths) == 2
    mine[0] = 24  # in place: the version counter moves
    with pytest.raises(QuantMLAError, match=re.escape("not [24, 50]")):
        mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, mine, lay, 0.125, metadata=md)
    with torch.inference_mode():  # an inference tensor keeps no version counter: it is read at every call
        inf = sl.clone()
        md = get_mla_metadata(inf, 4, 1, lay)
        mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, inf, lay, 0.125, metadata=md)
        inf[0] = 24
        with pytest.raises(QuantMLAError, match=re.escape("made for sequence lengths [40, 50], not [24, 50]")):
            mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, inf, lay, 0.125, metadata=md)


def test_a_config_beside_metadata_must_be_the_metadatas():
    """A config passed beside metadata cut for another config is refused (the units follow the metadata's tiles);
    the metadata's own config passes."""
    lay, pool, bt, sl = make_cache(FORMATS["int4/int4"], [40, 50], seed=3)
    qc = torch.randn(2, 1, 4, D_C).to(DEV, torch.bfloat16)
    qr = torch.randn(2, 1, 4, D_R).to(DEV, torch.bfloat16)
    md = get_mla_metadata(sl, 4, 1, lay)
    other = dataclasses.replace(md.config, block_n=md.config.block_n * 2)
    with pytest.raises(QuantMLAError, match="differs from the metadata's"):
        mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, 0.125, metadata=md, config=other)
    mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, 0.125, metadata=md, config=md.config)


def test_strided_seq_lens_are_read_as_their_values():
    """An int32 seq_lens that is a strided view (a column of [B, 2]) decodes as its contiguous copy does."""
    lay, pool, bt, sl = make_cache(FORMATS["int4/int4"], [40, 50], seed=3)
    col = torch.stack([torch.tensor([7, 9], dtype=torch.int32, device=DEV), sl.to(torch.int32)], dim=1)[:, 1]
    assert col.stride() == (2,)
    qc = torch.randn(2, 1, 4, D_C).to(DEV, torch.bfloat16)
    qr = torch.randn(2, 1, 4, D_R).to(DEV, torch.bfloat16)
    o, l = mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, col, lay, 0.125)
    check(o, l, *reference(lay, pool, bt, sl, qc, qr, 0.125))


def test_inputs_off_the_caches_device_are_refused():
    """A query, block table or lengths on another device than the cache: a QuantMLAError naming it, before launch."""
    lay, pool, bt, sl = make_cache(FORMATS["int4/int4"], [40, 50], seed=3)
    qc = torch.randn(2, 1, 4, D_C).to(DEV, torch.bfloat16)
    qr = torch.randn(2, 1, 4, D_R).to(DEV, torch.bfloat16)
    args = dict(q_latent=qc, q_rope=qr, block_table=bt, seq_lens=sl)
    for name in args:
        moved = dict(args, **{name: args[name].to("meta")})
        with pytest.raises(QuantMLAError, match=f"^{name} is on meta, the cache on"):
            mla_decode_with_kvcache(moved["q_latent"], moved["q_rope"], pool.layer(0), moved["block_table"],
                                    moved["seq_lens"], lay, 0.125)


@pytest.mark.parametrize("name", ["bf16", "int4/int4", "int2/int4"])
def test_gpu_default_splits_at_small_batch(name, monkeypatch):
    """On the GPU a lone 1900-token sequence is cut into 128-token splits (15 programs, not 8 of 256:
    lab/results/decode_splits/h200.json), and the sweep's first candidate is the API default."""
    from quantmla_lab.bench.kernels import decode_speed as bench

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(bench, "DEV", "cuda")  # (the bench's candidates on a GPU)
    layout = PageLayout(TokenLayout(512, 64, bench.METHODS[name]), 64)
    cfg = api.default_config(16, layout, "cuda")
    assert bench.candidates(name, 16)[0] == cfg
    md = get_mla_metadata(torch.tensor([1900], dtype=torch.int32), 16, 1, layout, num_sms=132, config=cfg)
    spans = [u[2] - u[1] for u in md.units.tolist()]
    assert md.max_splits == 15 and sum(spans) == 1900 and min(spans) >= 100


@pytest.mark.parametrize(
    "fmt, match",
    [
        (CacheFormat(PathFormat(3, 32), PathFormat(4, 16)), "3-bit"),
        (CacheFormat(PathFormat(4, 32), PathFormat(3, 32)), "3-bit"),
    ],
)
def test_unsupported_formats_raise_before_launch(fmt, match):
    lay = PageLayout(TokenLayout(D_C, D_R, fmt), PAGE)
    pool = PagePool(lay, 2, device=DEV)
    before = pool.data.clone()
    with pytest.raises(UnsupportedFormatError, match=match):
        check_layout_supported(lay)
    with pytest.raises(UnsupportedFormatError, match=match):
        append_to_pages(pool.layer(0), lay, torch.tensor([0], device=DEV), torch.zeros(1, D_C, device=DEV), torch.zeros(1, D_R, device=DEV))
    q = torch.zeros(1, 1, 2, D_C, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedFormatError, match=match):
        mla_decode_with_kvcache(q, q[..., :D_R], pool.layer(0), pool.block_table([]) if False else torch.zeros(1, 1, dtype=torch.int32, device=DEV), torch.ones(1, dtype=torch.int32, device=DEV), lay, 0.1)
    assert torch.equal(pool.data, before)


def test_decode_outputs_checked_before_launch():
    """A caller's `out` / `lse` that the kernels could not write into as they are (shape, dtype, not contiguous) is a
    QuantMLAError naming it, before anything is written; the shapes it takes (4-D, or 3-D for 3-D queries) give the
    same outputs as those the API allocates."""
    lay, pool, bt, sl = make_cache(FORMATS["bf16"], [5, 70])
    g = torch.Generator().manual_seed(3)
    qc = torch.randn(2, 1, 4, D_C, generator=g).to(DEV, torch.bfloat16)
    qr = torch.randn(2, 1, 4, D_R, generator=g).to(DEV, torch.bfloat16)
    ref, ref_lse = mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, 0.1)
    bad = {"out": [torch.empty(2, 1, 4, D_C + 1, device=DEV), torch.empty(2, 1, 4, D_C, dtype=torch.int32, device=DEV),
                   torch.empty(2, 1, D_C, 4, device=DEV).transpose(-1, -2), torch.empty(2, 4, D_C, device=DEV)],
           "lse": [torch.empty(2, 1, 5, device=DEV), torch.empty(2, 1, 4, dtype=torch.bfloat16, device=DEV),
                   torch.empty(2, 1, 8, device=DEV)[..., ::2]]}
    for name, ts in bad.items():
        for t in ts:
            t.fill_(7)
            before = t.clone()
            with pytest.raises(QuantMLAError, match=rf"^{name} must be a contiguous"):
                mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, 0.1, **{name: t})
            assert torch.equal(t, before)
    out, lse = torch.empty(2, 1, 4, D_C, dtype=torch.bfloat16, device=DEV), torch.empty(2, 1, 4, device=DEV)
    o, l = mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, 0.1, out=out, lse=lse)
    assert o is out and l is lse and torch.equal(o, ref) and torch.equal(l, ref_lse)
    out3, lse3 = torch.empty(2, 4, D_C, dtype=torch.float32, device=DEV), torch.empty(2, 4, device=DEV)
    o, l = mla_decode_with_kvcache(qc[:, 0], qr[:, 0], pool.layer(0), bt, sl, lay, 0.1, out=out3, lse=lse3)
    assert torch.allclose(out3, ref[:, 0].float(), rtol=1e-2, atol=1e-2) and torch.equal(lse3, ref_lse[:, 0])


def test_unsupported_shapes_raise():
    with pytest.raises(UnsupportedFormatError, match="d_c"):
        check_layout_supported(PageLayout(TokenLayout(96, 32, CacheFormat()), PAGE))
    with pytest.raises(UnsupportedFormatError, match="d_r"):
        check_layout_supported(PageLayout(TokenLayout(64, 8, CacheFormat()), PAGE))
    with pytest.raises(UnsupportedFormatError, match="query tokens"):
        get_mla_metadata(torch.tensor([3]), 4, 17)


@pytest.mark.parametrize("name", ["bf16", "int4/int4", "int2/int8-sym-bf16meta"])
def test_decode_transposed_orientation(name):
    """The tokens-as-M ("swap AB") kernel: same results."""
    lens = [0, 1, 17, 40]
    lay, pool, bt, sl = make_cache(FORMATS[name], lens, seed=13)
    cfg = DecodeConfig(block_m=16, block_n=16, num_stages=1, orient="tokens")
    o, l, ro, rl, md = run_decode(lay, pool, bt, sl, H=3, SQ=2, config=cfg, chunk_tokens=16)
    assert "tokens" in md.variant
    check(o, l, ro, rl)


# -- the CUDA-graph decode schedule ------------------------------------------------------------------
@pytest.mark.parametrize("name,min_chunk", [("bf16", None), ("int4/int4", None), ("int4/int4", 64)])
def test_static_graph_plan_follows_real_lengths(name, min_chunk, monkeypatch):
    """A graph bucket's fixed-shape schedule, rewritten for the real lengths before a replay, covers every
    token once, deals the bucket's units out by length (a long sequence gets more splits than the bucket's
    S per row, a short one fewer; not the pool-wide worst case the graph was built for), says each
    sequence's units to the combine, and gives the reference attention, the same after a second update
    for other lengths (the combine's passes over more than its one-step block of splits included).
    Lengths scale with S x the config's shortest span (4 x 16 tokens in the interpreter, 8 x 128 for BF16
    on an H200), so the longest sequence needs more than S splits wherever the test runs; min_chunk 64
    is a GPU-like span under the interpreter."""
    import types

    import numpy as np

    from quantmla.serving.triton_backend import StaticDecodePlan

    monkeypatch.setattr(schedule, "num_sms_of", lambda device: 16)  # a GPU of 16 SMs: 4 splits a row for 4 rows
    H = 4
    lay = PageLayout(TokenLayout(D_C, D_R, FORMATS[name]), PAGE)

    def config(rows, layout, device):
        cfg = api.default_config(rows, layout, device)
        return cfg if min_chunk is None else dataclasses.replace(cfg, min_chunk=min_chunk)

    backend = types.SimpleNamespace(spec=types.SimpleNamespace(num_heads=H), device=torch.device(DEV),
                                    kinds={"k": lay}, decode_config=config)
    max_len = 8192
    plan = StaticDecodePlan(backend, b=4, max_len=max_len)  # a pool far longer than the sequences
    S, min_span, tile = plan.split["k"]
    md = plan.md["k"]
    assert S == md.max_splits > 1 and md.num_units == 4 * S
    f = S * min_span // 64  # 1 in the interpreter's default config
    for lens in ([1, 40 * f, 77 * f, 130 * f], [0, 3, 150 * f, 1]):
        assert (S + 1) * min_span < max(lens) <= max_len
        lay, pool, bt, sl = make_cache(FORMATS[name], lens, seed=5)
        plan.update(np.asarray(lens))
        units, info = md.units.cpu().tolist(), md.seq_info.cpu().tolist()
        used = sum(k for _, k in info)
        for b, n in enumerate(lens):
            first, k = info[b]
            mine = units[first: first + k]
            assert all(u[0] == b and u[3] == k for u in mine) and sum(u[0] == b for u in units[:used]) == k
            assert [t for u in mine for t in range(u[1], u[2])] == list(range(n))  # in order, once
            assert all(u[1] % tile == 0 for u in mine)  # splits start on key-tile boundaries
        assert max(k for _, k in info) > S  # the longest sequence takes more than its row's share
        rest = units[used:]
        assert rest and all(u[1] == u[2] and u[3] == 2 for u in rest)  # empty units, partial rows only
        g = torch.Generator().manual_seed(2)
        qc = torch.randn(len(lens), 1, H, D_C, generator=g).to(DEV, torch.bfloat16)
        qr = torch.randn(len(lens), 1, H, D_R, generator=g).to(DEV, torch.bfloat16)
        out = torch.full((len(lens), 1, H, D_C), float("nan"), dtype=torch.bfloat16, device=DEV)
        lse = torch.full((len(lens), 1, H), float("nan"), device=DEV)
        wide = torch.zeros(len(lens), max_len // PAGE, dtype=bt.dtype, device=bt.device)  # the graph's table width
        wide[:, : bt.shape[1]] = bt
        o, l = mla_decode_with_kvcache(qc, qr, pool.layer(0), wide, sl, lay, 0.125, metadata=md, out=out, lse=lse)
        ro, rl = reference(lay, pool, bt, sl, qc, qr, 0.125)
        check(o, l, ro, rl)


# -- read (prefill chunks) ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FORMATS))
def test_read_matches_the_reference_reader(name):
    """The read kernel gives the torch reader's dequantized values at scattered slots (fp32 out: to
    rounding; bf16 out: the same values rounded once), for every kernel format."""
    from quantmla.cache.paged import read_tokens
    from quantmla.kernels import read_from_pages

    fmt = FORMATS[name]
    lay = PageLayout(TokenLayout(D_C, D_R, fmt), PAGE)
    g = torch.Generator().manual_seed(7)
    pool = PagePool(lay, 6, device=DEV)
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, generator=g, dtype=torch.uint8))
    slots = torch.randperm(6 * PAGE, generator=g)[:37].to(DEV)
    append_to_pages(pool.layer(0), lay, slots, torch.randn(37, D_C, generator=g).to(DEV) * 3,
                    torch.randn(37, D_R, generator=g).to(DEV) * 10)
    ref_c, ref_r = read_tokens(pool.layer(0), lay, slots)
    c, r = read_from_pages(pool.layer(0), lay, slots, dtype=torch.float32, block_t=8)
    torch.testing.assert_close(c, ref_c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r, ref_r, rtol=1e-6, atol=1e-6)
    c16, r16 = read_from_pages(pool.layer(0), lay, slots)
    assert c16.dtype == torch.bfloat16
    torch.testing.assert_close(c16.float(), ref_c.bfloat16().float(), rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(r16.float(), ref_r.bfloat16().float(), rtol=1e-2, atol=1e-6)
    empty = read_from_pages(pool.layer(0), lay, slots[:0])
    assert empty[0].shape == (0, D_C) and empty[1].shape == (0, D_R)


def test_read_copies_slots_off_16_bytes(monkeypatch):
    """A view of slots that starts off 16 bytes (a step's later chunk in the engine's one slot array) reaches the
    read kernel as an aligned copy, so Triton never compiles the kernel for a second pointer alignment; the values
    are the reader's."""
    import quantmla.kernels.read as read_mod
    from quantmla.cache.paged import read_tokens
    from quantmla.kernels import read_from_pages

    lay = PageLayout(TokenLayout(D_C, D_R, FORMATS["int4/int4"]), PAGE)
    g = torch.Generator().manual_seed(9)
    pool = PagePool(lay, 4, device=DEV)
    every = torch.randperm(4 * PAGE, generator=g)[:21].to(DEV)
    append_to_pages(pool.layer(0), lay, every, torch.randn(21, D_C, generator=g).to(DEV),
                    torch.randn(21, D_R, generator=g).to(DEV))
    seen, real = [], read_mod._read_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(args[2].data_ptr() % 16)
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(read_mod, "_read_kernel", Spy())
    view = every[1:]  # int64 at offset 8 bytes
    assert view.data_ptr() % 16 == 8
    c, r = read_from_pages(pool.layer(0), lay, view, dtype=torch.float32)
    read_from_pages(pool.layer(0), lay, every, dtype=torch.float32)
    assert seen == [0, 0]
    ref_c, ref_r = read_tokens(pool.layer(0), lay, view)
    torch.testing.assert_close(c, ref_c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r, ref_r, rtol=1e-6, atol=1e-6)


@triton.jit
def _e4m3_roundtrip(Y, C, V, N: tl.constexpr):
    i = tl.arange(0, N)
    c = _f32_to_e4m3(tl.load(Y + i))
    tl.store(C + i, c)
    tl.store(V + i, _e4m3_to_f32(c))


def test_e4m3_conversions_match_torch_exactly():
    """The spelled-out e4m3 encode (round to nearest even) and decode agree with torch's float8_e4m3fn
    on every code and on fp32 values across the whole range, ties and subnormals included."""
    g = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes.view(torch.float8_e4m3fn).float().isfinite()
    exact = codes.view(torch.float8_e4m3fn).float()[finite]  # every finite e4m3 value
    ties = (exact[:-1] + exact[1:]) / 2  # halfway between neighbours (same sign)
    rand = torch.cat([torch.randn(2048, generator=g) * 100, torch.randn(2048, generator=g) * 1e-3]).clamp(-448, 448)
    y = torch.cat([exact, ties[(exact[:-1].sign() == exact[1:].sign())], rand])
    n = 1 << (y.numel() - 1).bit_length()
    y = torch.cat([y, torch.zeros(n - y.numel())]).to(DEV)
    c = torch.empty(n, dtype=torch.uint8, device=DEV)
    v = torch.empty(n, device=DEV)
    _e4m3_roundtrip[(1,)](y, c, v, n)
    ref = y.cpu().to(torch.float8_e4m3fn)
    assert torch.equal(c.cpu(), ref.view(torch.uint8))
    assert torch.equal(v.cpu(), ref.float())


def test_fp8_ds_mla_record_is_656_bytes():
    from quantmla.cache.layout import FP8_DS_MLA, preset

    tok = TokenLayout(512, 64, preset("fp8"))
    assert preset("FP8") == FP8_DS_MLA
    assert tok.field_bytes == {"content_codes": 512, "rope_codes": 128, "content_meta": 16, "rope_meta": 0}
    assert tok.bytes_per_token == 656


@pytest.mark.parametrize("name", ["int4/int4-page16", "int2/int4-page"])
def test_bench_candidates_start_from_the_triton_default_that_reads_the_layout(name, monkeypatch):
    """With the CUDA path off (QUANTMLA_DECODE_KERNEL=triton) a RoPE path per page decodes through the generic
    Triton kernel: the bench's first candidate is that default, not the fused tiling that cannot read the page's
    metadata (whose failed check dropped the method from the results)."""
    from quantmla_lab.bench.kernels import decode_speed as bench

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("QUANTMLA_DECODE_KERNEL", "triton")
    monkeypatch.setattr(bench, "DEV", "cuda")
    layout = PageLayout(TokenLayout(512, 64, bench.METHODS[name]), 64)
    cfg = api.default_config(16, layout, "cuda")
    cands = bench.candidates(name, 16)
    assert cfg.kernel == "generic" and cands[0] == cfg and len(cands) == len(set(cands))


@pytest.mark.parametrize("on", [True, False])
def test_bench_candidates_time_rope_pages_on_both_cuda_kernels(on, monkeypatch):
    """A RoPE path per page decodes by default on the tokens-as-M kernel (16 rows) or the heads-as-M kernel (128),
    as a per-token format does, so the bench's first candidate is that kernel; with the switches off
    (cuda.tokens_m_by_default, warpgroup_by_default) the default is the built tile, and the sweep times those kernels
    beside it."""
    from unittest import mock

    from quantmla.kernels import cuda
    from quantmla.kernels.cuda import build, tokens_m, warpgroup
    from quantmla_lab.bench.kernels import decode_speed as bench

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(bench, "DEV", "cuda")
    monkeypatch.setattr(tokens_m, "TM_ROPE_PAGE_DEFAULT", on)
    monkeypatch.setattr(warpgroup, "WG_ROPE_PAGE_DEFAULT", on)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        pages, per_token = bench.candidates("int4/int4-page16", 16), bench.candidates("int4/int4", 16)
        pages128 = bench.candidates("int4/int4-page16", 128)
    if on:
        assert pages[0].kernel == "cuda" and pages[0].tokens_m and all(c.kernel != "cuda" for c in pages[1:])
        assert pages128[0].kernel == "cuda" and pages128[0].warpgroup
        assert all(not (c.kernel == "cuda" and c.warpgroup) for c in pages128[1:])
    else:
        assert pages[0].kernel == "cuda" and not pages[0].tokens_m and pages[1].kernel == "cuda" and pages[1].tokens_m
        assert pages[2].kernel != "cuda"  # (no heads-as-M plan at 16 rows)
        assert not pages128[0].warpgroup and pages128[1].kernel == "cuda" and pages128[1].warpgroup
    assert per_token[0].tokens_m and all(c.kernel != "cuda" for c in per_token[1:])


def test_bench_kernel_smoke_run_writes_rows_figure_and_refuses_overwrite(tmp_path, capsys, monkeypatch):
    """`quantmla bench-kernel --smoke` (interpreter): one row per format with bytes, ratios and config, the
    goals, the commit and a figure beside the JSON; a second run into the same file is refused."""
    import json

    from quantmla.cli import main

    monkeypatch.setenv("QUANTMLA_PARTIALS", "fp32")  # recorded in the header (the runs take fp32 partials)
    out = tmp_path / "k.json"
    argv = ["bench-kernel", "--smoke", "--heads", "16", "--shapes", "1x40", "--methods", "bf16,fp8,int4/int4",
            "--no-sweep", "--warmup-ms", "1", "--rep-ms", "1", "--out", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"bf16", "fp8", "int4/int4"}
    assert rows["fp8"]["bytes_read"] < rows["bf16"]["bytes_read"] and rows["bf16"]["speedup_vs_bf16"] == 1.0
    assert all(c["ok"] for c in res["checks"]) and "goals" in res and "commit" in res and res["partials"] == "fp32"
    assert res["skipped"] == [] and res["decode_kernel"] == "auto"
    assert res["command"].startswith("quantmla bench-kernel")
    from quantmla_lab.bench.kernels.decode_speed import bench_command

    triton_only = bench_command(["quantmla", "bench-kernel", "--heads", "16"], "triton")
    assert triton_only == "QUANTMLA_DECODE_KERNEL=triton quantmla bench-kernel --heads 16"
    assert out.with_suffix(".png").stat().st_size > 0
    assert main(argv) == 2 and "--overwrite" in capsys.readouterr().err
