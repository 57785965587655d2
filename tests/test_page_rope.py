"""A RoPE path grouped per page (PathFormat(grouping="page"), one metadata set per page or per block of tokens)
in the paged cache: the layout's per-page section, the reference writer against the evaluation cache's per-page
quantizer (cache.rope_channel), the read and decode kernels (TRITON_INTERPRET=1 on CPU) against the fp64 oracle,
and clear errors."""

import os

import pytest
import torch

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout
from quantmla.cache.paged import PagePool, gather_sequences, read_tokens, write_tokens, write_tokens_staged
from quantmla.cache.rope_channel import RopeChannelCache, RopeChannelFormat, quantize_pages
from quantmla.errors import QuantMLAError, UnsupportedFormatError
from quantmla.kernels import append_to_pages, get_mla_metadata, mla_decode_with_kvcache, read_from_pages
from quantmla.quant import BF16, PathFormat
from quantmla.reference.absorbed import absorbed_attention

D_C, D_R, PAGE = 64, 32, 16
PAGE_INT4 = PathFormat(4, 1, grouping="page")
FORMATS = {
    "int4/int4·page": CacheFormat(PathFormat(4, 32), PAGE_INT4),
    "int2/int4·page g2": CacheFormat(PathFormat(2, 32), PathFormat(4, 2, grouping="page")),
    "int4/int8s·page": CacheFormat(PathFormat(4, 16), PathFormat(8, 1, "symmetric", grouping="page")),
    "bf16/int2·page": CacheFormat(BF16, PathFormat(2, 1, grouping="page")),
    "int2 clipped/int4·page g2 clipped": CacheFormat(PathFormat(2, 32, clip=0.875),
                                                     PathFormat(4, 2, grouping="page", clip=0.9375)),
    "int4/int4·page/4": CacheFormat(PathFormat(4, 32), PathFormat(4, 1, grouping="page", block=4)),
    "int2/int4s·page/8 g2 bf16": CacheFormat(PathFormat(2, 32), PathFormat(4, 2, "symmetric", "bfloat16",
                                                                            grouping="page", block=8)),
    "int4 f32/int4·page f32": CacheFormat(PathFormat(4, 16, meta_dtype="float32"),  # fp32 metadata, kept unrounded
                                          PathFormat(4, 1, meta_dtype="float32", grouping="page")),
    "int2/int8s·page/4 f32": CacheFormat(PathFormat(2, 32), PathFormat(8, 2, "symmetric", "float32", grouping="page",
                                                                       block=4)),
}
kernels = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                             reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the engine tests' tiny model lives on the CPU, where the Triton kernels run only interpreted
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the tiny model runs on the CPU: the Triton kernels need TRITON_INTERPRET=1")


def test_layout_holds_the_page_metadata_once_per_page():
    lay = PageLayout(TokenLayout(512, 64, CacheFormat(PathFormat(4, 128), PathFormat(4, 1, grouping="page"))), 64)
    assert lay.token.field_bytes["rope_meta"] == 0
    assert lay.page_field_bytes == {"rope_page_meta": 64 * 2 * 2}  # d_r channels x (scale, zero) x fp16
    assert lay.offsets["rope_page_meta"] == lay.offsets["rope_meta"]  # the empty per-token section takes no bytes
    assert lay.page_bytes == 64 * (256 + 32 + 16) + 256
    per_token = PageLayout(TokenLayout(512, 64, CacheFormat(PathFormat(4, 128), PathFormat(4, 64))), 64)
    assert lay.page_bytes == per_token.page_bytes  # at d_r 64: one page's channels cost what per-token g64 costs
    f = PathFormat(4, 1, grouping="page")
    assert PathFormat.from_dict(f.to_dict()) == f and "grouping" not in PathFormat(4, 64).to_dict()
    assert f.bytes_per_token(64, page_size=64) == 32 + 4 and f.describe() == "INT4/g1·page"


def test_layout_holds_a_metadata_set_per_block():
    """Block 16 of a 64-token page: four sets, block-major, 256 B each at d_r 64 (INT4, fp16 scale and zero)."""
    def layout(rope):
        return PageLayout(TokenLayout(512, 64, CacheFormat(PathFormat(4, 128), rope)), 64)

    f = PathFormat(4, 1, grouping="page", block=16)
    whole, blocked = layout(PathFormat(4, 1, grouping="page")), layout(f)
    assert blocked.page_field_bytes["rope_page_meta"] == 4 * whole.page_field_bytes["rope_page_meta"] == 4 * 256
    assert blocked.page_bytes == whole.page_bytes + 3 * 256 and blocked.rope_meta_block == 16
    assert whole.rope_meta_block == 64 and layout(PathFormat(4, 64)).rope_meta_block == 0
    assert f.bytes_per_token(64, page_size=64) == 32 + 256 / 16 and f.page_meta_bytes(64, 64) == 1024
    assert f.describe() == "INT4/g1·page/16" and PathFormat.from_dict(f.to_dict()) == f and f.to_dict()["block"] == 16
    assert "block" not in PathFormat(4, 1, grouping="page").to_dict()
    assert layout(PathFormat(4, 1, grouping="page", block=64)).page_bytes == whole.page_bytes  # one set: the page
    with pytest.raises(UnsupportedFormatError, match="blocks of 128 tokens do not divide the page of 64 tokens"):
        layout(PathFormat(4, 1, grouping="page", block=128))
    with pytest.raises(UnsupportedFormatError, match="block must be an integer"):
        PathFormat.from_dict({"bits": 4, "group_size": 1, "grouping": "page", "block": "16"})


@pytest.mark.parametrize("bad, match", [
    (dict(bits=8, group_size=1, mode="fp8", grouping="page"), "integer codes"),
    (dict(bits=16, grouping="page"), "no groups"),
    (dict(bits=4, group_size=1, grouping="sequence"), "grouping must be one of"),
    (dict(bits=4, group_size=32, block=16), "for grouping 'page'.*use block 0, or grouping 'page'"),
    (dict(bits=4, group_size=1, grouping="page", block=12), "block must be 0 .* or a power of two"),
])
def test_bad_per_page_formats_are_refused(bad, match):
    with pytest.raises(UnsupportedFormatError, match=match):
        PathFormat(**bad)


def test_content_path_cannot_be_grouped_per_page():
    with pytest.raises(UnsupportedFormatError, match="RoPE-path format"):
        TokenLayout(64, 32, CacheFormat(PathFormat(4, 1, grouping="page"), PathFormat(4, 16)))


def _fill(pool, lay, seqs, g, chunk=lambda i: 1):
    """Write sequences token chunk by chunk, as a decode loop would: each write passes the full-precision
    RoPE keys of every page it touches (the tokens so far). Returns {seq: (latent, k_rope)}."""
    data = {}
    for s, n in seqs.items():
        x = torch.randn(n, lay.token.d_c, generator=g) * 2 + 0.3
        k = torch.randn(n, lay.token.d_r, generator=g) * 3
        k[:, 0] += 8 * torch.cos(0.05 * torch.arange(n))  # a large slowly turning channel pair
        k[:, 1] += 8 * torch.sin(0.05 * torch.arange(n))
        data[s] = (x, k)
        pool.reserve(s, 0)  # an empty sequence still has a (page-less) row
        done, i = 0, 0
        while done < n:
            m = min(chunk(i), n - done)
            slots = pool.append_slots(s, m)
            pages = pool.pages_of(s)
            ps = lay.page_size
            page_rope = {pages[p]: k[p * ps: min(done + m, (p + 1) * ps)]
                         for p in range(done // ps, (done + m - 1) // ps + 1)}
            write_tokens(pool.layer(0), lay, slots.to(pool.buffer.device), x[done: done + m].to(pool.buffer.device),
                         k[done: done + m], page_rope=page_rope)
            done, i = done + m, i + 1
    return data


@pytest.mark.parametrize("mode", ["affine", "symmetric"])
@pytest.mark.parametrize("page, block", [(PAGE, 0), (PAGE, 4), (64, 16)])
def test_writer_matches_the_evaluation_cache_in_any_chunking(mode, page, block):
    """Token by token or in uneven chunks, the pages hold exactly the keys that quantize_pages (the
    evaluation cache's per-page quantizer) gives at pages of the block: an unfinished page, or block, is
    quantized over the tokens it holds."""
    rope = RopeChannelFormat(4, block or page, mode)
    fmt = CacheFormat(PathFormat(4, 32), PathFormat(4, 1, mode, grouping="page", block=block))
    lay = PageLayout(TokenLayout(D_C, D_R, fmt), page)
    for n, chunk in ((37, lambda i: 1), (53, lambda i: (5, 16, 1, 9)[i % 4]), (32, lambda i: 32), (30, lambda i: 7)):
        g = torch.Generator().manual_seed(n)
        pool = PagePool(lay, 8)
        pool.data.copy_(torch.randint(0, 256, pool.data.shape, generator=g, dtype=torch.uint8))
        pool.append_slots("other", 3)  # pages out of order
        (x, k), = _fill(pool, lay, {0: n}, g, chunk).values()
        bt, sl = pool.block_table([0]), pool.seq_lens([0])
        _, kr = gather_sequences(pool.layer(0), lay, bt, sl)
        assert torch.equal(kr[0], quantize_pages(k, rope)), n
        assert (kr[0] - k).abs().max() > 0  # quantized, not copied
        if block:  # a set per block, not one per page
            assert not torch.equal(kr[0], quantize_pages(k, RopeChannelFormat(4, page, mode)))


def test_writer_errors_name_what_is_missing():
    lay = PageLayout(TokenLayout(D_C, D_R, FORMATS["int4/int4·page"]), PAGE)
    pool = PagePool(lay, 2)
    slots = pool.append_slots(0, 3)
    x, k = torch.zeros(3, D_C), torch.ones(3, D_R)
    with pytest.raises(QuantMLAError, match="grouped per page: pass page_rope"):
        write_tokens(pool.layer(0), lay, slots, x, k)
    page = pool.pages_of(0)[0]
    with pytest.raises(QuantMLAError, match="holds 2 tokens; the slots write offset 2"):
        write_tokens(pool.layer(0), lay, slots, x, k, page_rope={page: k[:2]})
    with pytest.raises(QuantMLAError, match="no \\[n, 32\\] keys for page"):
        write_tokens(pool.layer(0), lay, slots, x, k, page_rope={page + 1: k})


@kernels
@pytest.mark.parametrize("name", list(FORMATS))
def test_read_kernel_gives_the_reference_values(name):
    lay = PageLayout(TokenLayout(D_C, D_R, FORMATS[name]), PAGE)
    g = torch.Generator().manual_seed(5)
    pool = PagePool(lay, 8, device=DEV)
    _fill(pool, lay, {0: 40, 1: 21}, g, lambda i: 3)
    slots = torch.tensor([p * PAGE + o for s in (0, 1) for p in pool.pages_of(s) for o in range(PAGE)
                          if (pool.pages_of(s).index(p) * PAGE + o) < pool.seq_len(s)], device=DEV)
    ref_c, ref_r = read_tokens(pool.layer(0), lay, slots)
    c, r = read_from_pages(pool.layer(0), lay, slots, dtype=torch.float32, block_t=8)
    torch.testing.assert_close(c, ref_c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r, ref_r, rtol=1e-6, atol=1e-6)


@kernels
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("SQ", [1, 3])
def test_decode_matches_the_fp64_oracle(name, SQ):
    """Empty, length-1, odd and page-boundary lengths, a split sequence, NaN-poisoned outputs."""
    lay = PageLayout(TokenLayout(D_C, D_R, FORMATS[name]), PAGE)
    g = torch.Generator().manual_seed(11 + SQ)
    lens = [0, 1, 15, 16, 17, 77]
    pool = PagePool(lay, sum(lay.pages_for(n) for n in lens) + 3, device=DEV)
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, generator=g, dtype=torch.uint8))
    pool.append_slots("pad", 5)
    _fill(pool, lay, dict(enumerate(lens)), g, lambda i: (1, 7, 16)[i % 3])
    ids = list(range(len(lens)))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    B, H = len(lens), 4
    qc = torch.randn(B, SQ, H, D_C, generator=g).to(DEV, torch.bfloat16)
    qr = torch.randn(B, SQ, H, D_R, generator=g).to(DEV, torch.bfloat16)
    out = torch.full((B, SQ, H, D_C), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse = torch.full((B, SQ, H), float("nan"), device=DEV)
    md = get_mla_metadata(sl, H, SQ, lay, chunk_tokens=32)
    o, l = mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, 0.125, metadata=md, out=out, lse=lse)
    c, k = gather_sequences(pool.layer(0), lay, bt, sl)
    ro, rl = absorbed_attention(qc.double(), qr.double(), c.double(), k.double(), 0.125, sl)
    assert not torch.isnan(o).any() and not torch.isnan(l).any()
    empty = torch.isinf(rl)
    assert torch.equal(torch.isinf(l).cpu(), empty.cpu()) and torch.all(o.float()[empty] == 0)
    assert ((o.double() - ro).norm() / ro.norm()) < 2e-2
    assert (l.double() - rl)[~empty].abs().max().item() < 2e-2


def test_per_token_caches_refuse_page_groups():
    """Nothing quantizes a per-page format per token: the config, the engine's backends and quantize() say so."""
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.model.spec import load_spec
    from quantmla.model.tiny import tiny_model
    from quantmla.quant.groupwise import quantize
    from quantmla.serving.backends import TorchPagedBackend

    with pytest.raises(QuantMLAError, match="store per-token groups"):
        QuantCacheConfig(PathFormat(4, 32), PAGE_INT4)
    with pytest.raises(ValueError, match="quantize_page"):
        quantize(torch.ones(2, 32), PAGE_INT4)
    spec = load_spec(tiny_model("deepseek_v3"))
    with pytest.raises(UnsupportedFormatError, match="group the RoPE path per page"):
        TorchPagedBackend(spec, {0: CacheFormat(PathFormat(4, 16), PathFormat(4, 1, grouping="page"))}, 4, 16, "cpu",
                          torch.float32)


def _append_steps(lay, lens, chunks, g, kernel=True):
    """Pools written two ways from the same keys, several sequences per call (each one's tokens contiguous,
    a padding slot between them): the append path with a stage, and the reference writer given each page's
    keys. Returns both pools' bytes."""
    from quantmla.kernels import api

    pool_a, pool_b = PagePool(lay, 24, device=DEV), PagePool(lay, 24, device=DEV)
    noise = torch.randint(0, 256, pool_a.data.shape, generator=g, dtype=torch.uint8).to(DEV)
    pool_a.data.copy_(noise), pool_b.data.copy_(noise)
    keys = {s: torch.randn(n, D_R, generator=g) * 3 for s, n in enumerate(lens)}
    lat = {s: torch.randn(n, D_C, generator=g) for s, n in enumerate(lens)}
    stage = torch.full((len(lens) + 2, PAGE, D_R), float("nan"), dtype=torch.bfloat16, device=DEV)
    done = [0] * len(lens)
    for step in range(max(len(c) for c in chunks)):
        slots, rows, xs, ks, page_rope = [], [], [], [], {}
        for s in range(len(lens)):
            if step >= len(chunks[s]):
                continue
            m = chunks[s][step]
            new_a = pool_a.append_slots(s, m)
            pool_b.append_slots(s, m)
            slots += [new_a, torch.tensor([-1])]
            rows += [torch.full((m + 1,), s + 1)]
            xs += [lat[s][done[s]: done[s] + m], torch.zeros(1, D_C)]
            ks += [keys[s][done[s]: done[s] + m], torch.zeros(1, D_R)]
            pages = pool_b.pages_of(s)
            end = done[s] + m
            for p in range(done[s] // PAGE, (end - 1) // PAGE + 1):
                page_rope[pages[p]] = keys[s][p * PAGE: min(end, (p + 1) * PAGE)].bfloat16().float()
            done[s] = end
        slots, rows = torch.cat(slots).to(DEV), torch.cat(rows).to(DEV)
        x, k = torch.cat(xs).to(DEV, torch.bfloat16), torch.cat(ks).to(DEV, torch.bfloat16)
        if kernel:
            api.append_to_pages(pool_a.layer(0), lay, slots, x, k, rope_stage=stage, stage_rows=rows)
        else:
            write_tokens_staged(pool_a.layer(0), lay, slots, x.float(), k, stage, rows)
        write_tokens(pool_b.layer(0), lay, slots, x.float(), k.float(), page_rope=page_rope)
    return pool_a, pool_b


@kernels
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("kernel", [True, False])
def test_append_with_a_stage_is_bit_exact_with_the_reference_writer(name, kernel):
    """Decode-like single tokens and prefill-like chunks that cross pages, two sequences per call: the append
    path (stage + per-page requantization; the Triton kernels or their torch form) writes the same bytes as
    the reference writer given each page's keys."""
    lay = PageLayout(TokenLayout(D_C, D_R, FORMATS[name]), PAGE)
    g = torch.Generator().manual_seed(len(name))
    chunks = [[5, 1, 1, 20, 1, 1, 16], [1, 1, 33, 1]]
    a, b = _append_steps(lay, [sum(c) for c in chunks], chunks, g, kernel)
    assert torch.equal(a.data.cpu(), b.data.cpu())


@kernels
def test_append_without_a_stage_says_what_it_needs():
    lay = PageLayout(TokenLayout(D_C, D_R, FORMATS["int4/int4·page"]), PAGE)
    pool = PagePool(lay, 2, device=DEV)
    slots = pool.append_slots(0, 2).to(DEV)
    x, k = torch.zeros(2, D_C, device=DEV), torch.zeros(2, D_R, device=DEV)
    with pytest.raises(QuantMLAError, match="pass rope_stage"):
        append_to_pages(pool.layer(0), lay, slots, x, k)
    with pytest.raises(QuantMLAError, match="rope_stage must be"):
        append_to_pages(pool.layer(0), lay, slots, x, k, rope_stage=torch.zeros(2, 8, D_R), stage_rows=torch.zeros(2))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
def test_engine_serves_rope_pages_as_the_evaluation_cache_reads_them(backend):
    """EngineConfig(rope_pages=True) runs end to end and its greedy outputs agree with transformers generate()
    on RopeChannelCache (the evaluation's per-page cache): prompts and outputs crossing pages, chunked
    prefill, several sequences a step, the Triton backend through the padded (graph) step paths. Greedy
    tokens of the tiny model do not tell per-page from per-token RoPE groups; the logits test below does."""
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.model.tiny import tiny_model
    from quantmla.serving.engine import Engine, EngineConfig
    from quantmla_lab.bench.serving.agreement import engine_agreement

    model = tiny_model("deepseek_v3")
    quant = QuantCacheConfig.of_bits(4, 4, 32, 16)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 16, 23, 40)]
    graphs = "emulate" if backend == "triton" else False
    rep, stats = engine_agreement(
        model, quant, prompts, 21, tie_tol=1e-3, backend=backend, cuda_graphs=graphs, rope_pages=True,
        max_num_batched_tokens=24, cache_factory=lambda: RopeChannelCache(model, quant, RopeChannelFormat(4, 16)))
    assert rep.ok and rep.exact >= 3, rep.details
    assert stats["backend"] == backend and (backend == "torch" or stats["graph_steps"] > 0)
    with Engine(model, EngineConfig(quant=quant, kv_budget_bytes=1 << 20, page_size=16, rope_pages=True,
                                    max_num_seqs=8, backend="torch")) as eng:
        assert eng.stage_bytes == 9 * 16 * eng.spec.d_r * 4 * len(eng.formats)  # the stage is in the budget
        assert eng.pool_pages == ((1 << 20) - eng.stage_bytes) // eng.page_bytes
        assert all(f.rope.per_page for f in eng.formats.values())


@pytest.mark.parametrize("block", [0, 4])
def test_engine_logits_are_the_evaluation_cache_logits(block):
    """Every generated token's logits (fp32, torch backend) equal generate()'s on RopeChannelCache to float
    rounding, the RoPE scales per page (block 0) or per block of 4 tokens (EngineConfig.rope_block, the
    evaluation cache's 4-token pages), and the engine's per-token RoPE groups (rope_pages off) are measurably
    further from them.
    Whole prompts in one step: generate() quantizes a prompt's last page over all its tokens before any of
    them reads it, while a prompt prefilled in chunks lets its earlier chunks read that page quantized over
    the tokens so far, which moves later logits by about 1e-3 here."""
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.model.tiny import tiny_model
    from quantmla.serving.engine import Engine, EngineConfig
    from quantmla.serving.scheduler import SamplingParams
    from quantmla_lab.bench.serving.agreement import reference_generate

    model = tiny_model("deepseek_v3")
    quant = QuantCacheConfig.of_bits(4, 4, 32, 16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 30)]
    rfmt = RopeChannelFormat(4, block or 16)
    refs = [reference_generate(model, quant, p, 20, lambda: RopeChannelCache(model, quant, rfmt)) for p in prompts]
    gaps = {}
    for pages in (True, False):
        with Engine(model, EngineConfig(quant=quant, num_pages=32, page_size=16, max_num_batched_tokens=64,
                                        backend="torch", keep_logits=True, rope_pages=pages,
                                        rope_block=block if pages else 0)) as eng:
            assert all(f.rope.block == (block if pages else 0) for f in eng.formats.values())
            outs = eng.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
        gap = 0.0
        for o, (toks, scores) in zip(outs, refs):
            n = next((j for j, (a, b) in enumerate(zip(o.output_ids, toks)) if a != b), len(toks))
            gap = max(gap, max(float((torch.as_tensor(o.logits[j]).float() - scores[j]).abs().max()) for j in range(n)))
        gaps[pages] = gap
    assert gaps[True] < 1e-4 and gaps[False] > 100 * gaps[True], gaps


def test_engine_refuses_rope_blocks_it_cannot_store():
    """rope_block needs rope_pages and a block that divides the page: a clear error before any pool exists."""
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.model.tiny import tiny_model
    from quantmla.serving.engine import Engine, EngineConfig
    from quantmla_lab.bench.serving.throughput import rope_pages_method

    model = tiny_model("deepseek_v3")
    quant = QuantCacheConfig.of_bits(4, 4, 32, 16)
    for extra, match in ((dict(rope_block=4), "needs rope_pages=True"),
                         (dict(rope_pages=True, rope_block=32), "do not divide the page of 16 tokens"),
                         (dict(rope_pages=True, rope_block=6), "a power of two")):
        with pytest.raises(QuantMLAError, match=match):
            Engine(model, EngineConfig(quant=quant, num_pages=8, page_size=16, backend="torch", **extra))
    assert [rope_pages_method(m) for m in ("int4/int4", "int4/int4-page", "int2/int4-page16", "int4/int4-pagex")] == [
        ("int4/int4", None), ("int4/int4", 0), ("int2/int4", 16), ("int4/int4-pagex", None)]


def test_engine_with_rope_pages_survives_preemption():
    """A tight budget preempts sequences (their stage rows go back, a recompute takes new ones): the outputs
    equal a roomy run's, through the padded decode and prefill step paths."""
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.model.tiny import tiny_model
    from quantmla.serving.engine import Engine, EngineConfig
    from quantmla.serving.scheduler import SamplingParams

    model = tiny_model("deepseek_v3")
    quant = QuantCacheConfig.of_bits(4, 4, 32, 16)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (40, 3, 25, 50, 12)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    with Engine(model, EngineConfig(quant=quant, num_pages=100, page_size=16, backend="torch", rope_pages=True)) as e:
        ref = e.generate(prompts, params)
    with Engine(model, EngineConfig(quant=quant, num_pages=7, page_size=16, max_num_batched_tokens=20, backend="torch",
                                    cuda_graphs="emulate", graph_buckets=(1, 2, 4), rope_pages=True, max_num_seqs=4)) as e:
        got = e.generate(prompts, params)
        assert e.stats.scheduler.preemptions > 0 and e.stats.graph_steps > 0 and e.stats.prefill_graph_steps > 0
        assert sorted(e.stage._free) == [1, 2, 3, 4]  # every row back once the job is done
    assert [o.output_ids for o in got] == [o.output_ids for o in ref]
