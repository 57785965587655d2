"""The combine step of a split decode: its program shapes (``schedule.combine_blocks``, ``CombineShape``), the kernel
against an fp64 log-sum-exp merge, any shape merging a decode as the default does, bad shapes refused before launch,
and an engine's eager decode calls taking its CUDA graphs' shapes (so a mixed step compiles no other variant)."""

import os

import pytest
import torch
from helpers.cpu_decode import DEV, FORMATS, check, make_cache, run_decode

from quantmla.cache.config import QuantCacheConfig
from quantmla.errors import QuantMLAError
from quantmla.kernels import decode, partials, schedule
from quantmla.kernels.schedule import CombineShape
from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.graphs import EngineObserver, decode_buckets
from quantmla.serving.scheduler import SamplingParams
from quantmla_lab.bench.serving.agreement import compare

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
def test_combine_blocks_read_every_split_in_one_step_where_it_fits():
    """A step's 1 to 64 sequences of at most 256 splits merge in one load round; a lone sequence's 264 in steps;
    sequences of 64 splits or more (33 rounds up to 64) take a row's whole channels a program, 64 or, where that leaves
    under two programs an SM or overfills the tile, 32."""
    for B, splits in [(8, 33), (32, 8), (64, 4), (1, 128), (8, 32), (7, 36), (1, 256), (13, 20)]:
        br, bd, bs = schedule.combine_blocks(B, 16, 512, splits, 132)
        assert schedule.combine_one_step(splits, bs) and bs * br * bd <= schedule.COMBINE_ONE_STEP_TILE
        assert B * -(-16 // br) * (512 // bd) >= 256  # still about two programs an SM
        assert (br == 1) == (splits > 32), (B, splits, br)  # a row a program from 64 splits (rounded up) on
    assert schedule.combine_blocks(7, 16, 512, 36, 132) == (1, 64, 64)
    assert schedule.combine_blocks(1, 16, 512, 256, 132) == (1, 32, 256)  # 128 programs of 64 channels: too few
    assert schedule.combine_blocks(1, 128, 512, 64, 132) == (1, 64, 64)
    assert schedule.combine_blocks(32, 16, 512, 8, 132) == (16, 32, 8)  # few splits: channels narrowed first
    assert schedule.combine_blocks(8, 128, 512, 8, 132) == (8, 32, 8)  # many rows, 8 to 63 splits: 8 x 32 at most
    assert schedule.combine_blocks(4, 128, 512, 16, 132) == (8, 32, 16)
    assert schedule.combine_blocks(16, 128, 512, 4, 132) == (16, 64, 4)  # .. not at 4 splits
    for d_c in (96, 160, 48):  # channel blocks divide any d_c (a power of two of it)
        for splits in (8, 64):
            br, bd, bs = schedule.combine_blocks(1, 16, d_c, splits, 132)
            assert d_c % bd == 0 and bd & (bd - 1) == 0, (d_c, splits, bd)
            schedule.CombineShape(br, bd, bs, True).check(16, d_c)
    br, bd, bs = schedule.combine_blocks(1, 16, 512, 264, 132)
    assert not schedule.combine_one_step(264, bs) and bs * br * bd == schedule.COMBINE_TILE
    br, bd, bs = schedule.combine_blocks(13, 16, 512, 20, 132, one_step=False)  # the two-pass blocks, for benchmarks
    assert not schedule.combine_one_step(20, bs) and bs * br * bd == schedule.COMBINE_TILE


@pytest.mark.parametrize("one_step", [True, False])
def test_combine_merges_partials_like_fp64(one_step):
    """The combine kernel in one step (every split in one tile) and in several, against an fp64 log-sum-exp merge:
    sequences of 0 (written directly), 1, 3 and 9 splits, empty units (lse -inf), rows past R, NaN-poisoned output."""
    from quantmla.kernels.decode import _mla_combine_kernel

    g = torch.Generator().manual_seed(7)
    R, DC, counts = 3, 32, [9, 1, 3, 0, 9]
    info, first = [], 0
    for n in counts:
        info.append((first, n))
        first += n
    po = torch.randn(first, R, DC, generator=g) * 3
    plse = torch.randn(first, R, generator=g) * 4
    plse[2, 1] = plse[5] = float("-inf")  # empty units: one row of one, every row of another
    plse[first - 9:first - 6] = float("-inf")
    plse[10:13, 0] = float("-inf")  # a row whose every split is empty
    out = torch.full((len(counts), R, DC), float("nan"), device=DEV)
    lse = torch.full((len(counts), R), float("nan"), device=DEV)
    block_r, block_d = 4, 16
    block_s = 16 if one_step else 4
    assert schedule.combine_one_step(max(counts), block_s) == one_step
    _mla_combine_kernel[(len(counts), -(-R // block_r), DC // block_d)](
        po.to(DEV), plse.to(DEV), torch.tensor(info, dtype=torch.int32, device=DEV), out, lse, R, D_C=DC,
        BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_S=block_s, ONE_STEP=one_step)
    out, lse = out.cpu(), lse.cpu()
    for b, (f, n) in enumerate(info):
        if n <= 1:  # written by the decode kernel itself: the combine leaves it alone
            assert torch.isnan(out[b]).all() and torch.isnan(lse[b]).all()
            continue
        l64, o64 = plse[f:f + n].double(), po[f:f + n].double()
        ref_lse = torch.logsumexp(l64, 0)  # [R]
        w = torch.exp(l64 - ref_lse[None]).nan_to_num(0.0)  # rows with every split empty have weight 0
        ref_o = (w[:, :, None] * o64).sum(0)
        empty = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse[b]), empty)
        assert torch.allclose(lse[b][~empty].double(), ref_lse[~empty], rtol=0, atol=1e-5)
        assert torch.allclose(out[b].double(), ref_o, rtol=1e-5, atol=1e-5)




def test_combine_undoes_the_fp16_partials_power_of_two():
    """fp16 partials (partials.partial_dtype) hold o·2^-PARTIAL_FP16_SHIFT: merged, they give the fp64 merge of the
    fp32 partials within fp16's rounding, partials of up to 1.8e5 (past fp16's 65504) included."""
    from quantmla.kernels.decode import _mla_combine_kernel

    g = torch.Generator().manual_seed(11)
    R, DC, info = 2, 32, [(0, 5), (5, 2)]  # (first unit, splits) of two sequences
    po = 6e4 + 1.2e5 * torch.rand(7, R, DC, generator=g)
    po[5:] *= -1e-3  # small values too: fp16's relative rounding, not the shift, bounds them
    plse = torch.randn(7, R, generator=g)
    po16 = (po * 2.0 ** -partials.PARTIAL_FP16_SHIFT).half()
    assert torch.isfinite(po16).all() and not torch.isfinite(po.half()).all()  # the shift is what keeps them finite
    out = torch.full((2, R, DC), float("nan"), device=DEV)
    lse = torch.full((2, R), float("nan"), device=DEV)
    _mla_combine_kernel[(2, 1, 1)](po16.to(DEV), plse.to(DEV), torch.tensor(info, dtype=torch.int32, device=DEV), out,
                                   lse, R, D_C=DC, BLOCK_R=2, BLOCK_D=DC, BLOCK_S=8, ONE_STEP=True)
    for b, (f, n) in enumerate(info):
        l64, o64 = plse[f:f + n].double(), po[f:f + n].double()
        ref_lse = torch.logsumexp(l64, 0)
        ref_o = (torch.exp(l64 - ref_lse[None])[:, :, None] * o64).sum(0)
        assert torch.allclose(out[b].cpu().double(), ref_o, rtol=2 ** -11, atol=0)
        assert torch.allclose(lse[b].cpu().double(), ref_lse, rtol=0, atol=1e-5)


def test_combine_merges_bf16_partials_of_any_range():
    """bf16 partials (raw bf16 and FP8 caches) merge as they are, no power of two to undo: values from 1e-30 to 1e30,
    far past fp16's range, give the fp64 merge of the same bf16 values within fp32 arithmetic, and the fp64 merge of
    the unrounded partials within bf16's rounding (2^-8 relative)."""
    from quantmla.kernels.decode import _mla_combine_kernel

    g = torch.Generator().manual_seed(13)
    R, DC, info = 2, 32, [(0, 6), (6, 3)]
    po = torch.randn(9, R, DC, generator=g) * torch.logspace(-30, 30, DC)[None, None, :]
    plse = torch.randn(9, R, generator=g)
    pob = po.bfloat16()
    out = torch.full((2, R, DC), float("nan"), device=DEV)
    lse = torch.full((2, R), float("nan"), device=DEV)
    _mla_combine_kernel[(2, 1, 1)](pob.to(DEV), plse.to(DEV), torch.tensor(info, dtype=torch.int32, device=DEV), out,
                                   lse, R, D_C=DC, BLOCK_R=2, BLOCK_D=DC, BLOCK_S=8, ONE_STEP=True)
    for b, (f, n) in enumerate(info):
        l64 = plse[f:f + n].double()
        ref_lse = torch.logsumexp(l64, 0)
        w = torch.exp(l64 - ref_lse[None])[:, :, None]
        got = out[b].cpu().double()
        scale = (w * po[f:f + n].double().abs()).sum(0)  # the merge's magnitude, channel by channel
        assert torch.isfinite(got).all()
        assert ((got - (w * pob[f:f + n].double()).sum(0)).abs() <= 1e-6 * scale).all()
        assert ((got - (w * po[f:f + n].double()).sum(0)).abs() <= 2 ** -8 * scale).all()
        assert torch.allclose(lse[b].cpu().double(), ref_lse, rtol=0, atol=1e-5)


def test_partials_are_fp16_only_where_the_content_codes_bound_them(monkeypatch):
    """partial_dtype by setting: fp16 for integer content codes of up to 4 bits with fp16 metadata (affine or
    symmetric, any RoPE path) and, for raw bf16, FP8, 8-bit codes and bf16 or fp32 metadata, bf16 under "auto" (the
    default) and "bf16", fp32 under "fp16", at any row count (16 to 128: the heads-as-M kernels too); "fp32"
    everywhere; every CUDA plan of a layout writes the dtype its workspace has (PART_KIND),
    a launch with a workspace of another dtype is refused before any launch, and an unknown setting names the ones
    there are."""
    from helpers.cuda_plans import plan

    from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout
    from quantmla.kernels import cuda
    from quantmla.quant import BF16, PathFormat

    bounded = {"int4/int4": CacheFormat(PathFormat(4, 128), PathFormat(4, 64)),
               "int2/int4": CacheFormat(PathFormat(2, 128), PathFormat(4, 64)),
               "int4-sym/bf16": CacheFormat(PathFormat(4, 64, "symmetric"), BF16),
               "int4/int8": CacheFormat(PathFormat(4, 64), PathFormat(8, 64))}
    wide = {"bf16": CacheFormat(BF16, BF16), "fp8": CacheFormat(PathFormat(8, 128, "fp8", "float32"), BF16),
            "int8/int4": CacheFormat(PathFormat(8, 64), PathFormat(4, 64)),
            "int4-bf16meta": CacheFormat(PathFormat(4, 64, "affine", "bfloat16"), PathFormat(4, 64)),
            "int4-fp32meta": CacheFormat(PathFormat(4, 64, "affine", "float32"), PathFormat(4, 64))}
    f16, b16, f32 = torch.float16, torch.bfloat16, torch.float32
    # setting: (bounded, wide) under 64 rows, then at 64 rows or more (the same since 16-bit partials pay at 128 rows)
    want_of = {"auto": ((f16, b16), (f16, b16)), "bf16": ((f16, b16), (f16, b16)),
               "fp16": ((f16, f32), (f16, f32)), "fp32": ((f32, f32), (f32, f32))}
    cases = ((16, {}, 0), (16, {"tokens_m": False}, 0), (63, {"tokens_m": False}, 0), (64, {"warpgroup": True}, 1),
             (128, {"warpgroup": True}, 1), (128, {"tokens_m": False}, 1))
    for setting, wants in want_of.items():
        monkeypatch.setenv("QUANTMLA_PARTIALS", setting)
        for rows, tiling, many in cases:
            for want, fmts in zip(wants[many], (bounded, wide)):
                for name, fmt in fmts.items():
                    lay = PageLayout(TokenLayout(512, 64, fmt), 64)
                    assert partials.partial_dtype(lay) == want, (setting, name, rows)
                    p = plan(fmt, rows, **tiling)[1]
                    if p is not None:
                        assert cuda.partial_kind(p) == want, (setting, name, rows, tiling)
    int4 = PageLayout(TokenLayout(512, 64, bounded["int4/int4"]), 64)
    bf16 = PageLayout(TokenLayout(512, 64, wide["bf16"]), 64)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("QUANTMLA_PARTIALS")
        assert partials.partials_setting() == "auto"  # the default
        assert partials.partial_dtype(int4) == f16 and partials.partial_dtype(bf16) == b16
        mp.setenv("QUANTMLA_PARTIALS", " FP32")
        assert partials.partial_dtype(int4) == f32 and partials.partials_setting() == "fp32"
        mp.setenv("QUANTMLA_PARTIALS", "half")
        with pytest.raises(QuantMLAError, match="QUANTMLA_PARTIALS='half': use 'auto'.*'bf16'.*'fp16'.*'fp32'"):
            partials.partial_dtype(int4)
    monkeypatch.delenv("QUANTMLA_PARTIALS")
    assert dict(plan("bf16", 16, tokens_m=False)[1].macros)["PART_KIND"] == 2
    assert dict(plan("bf16", 128, warpgroup=True)[1].macros)["PART_KIND"] == 2
    lay, p = plan("int4/int4", 16, tokens_m=True)
    assert dict(p.macros)["PART_KIND"] == 1 and dict(p.macros)["PART_SHIFT"] == partials.PARTIAL_FP16_SHIFT
    lse = torch.zeros(4, 16)
    args = (None, None, None, None, None, None, None, None, None, lse, torch.zeros(4, 16, 512), torch.zeros(4, 16),
            1, 16, 1, 16, 1, 0.1)
    with pytest.raises(ValueError, match="writes torch.float16 partials into a torch.float32 workspace"):
        cuda.launch_decode(p, (4, 1), args, torch.device("cuda"))
    with pytest.MonkeyPatch.context() as mp:  # a plan made under another setting is not handed out again
        mp.setenv("QUANTMLA_PARTIALS", "fp32")
        assert cuda.partial_kind(plan("int4/int4", 16, tokens_m=True)[1]) == torch.float32


def test_decode_splits_of_latents_past_fp16s_range(monkeypatch):
    """An INT4 cache (fp16 metadata: zero about 2.5e4, scale about 1e4) of latent values up to 1.8e5: the split decode
    writes fp16 partials (its workspace) whose merged output is finite, within the same bound of the fp64 oracle as
    any decode, and the unsplit call's within bf16 rounding. The queries are small so that scores stay near 1."""
    from helpers.cpu_decode import D_C, D_R, PAGE, reference

    from quantmla.cache.layout import PageLayout, TokenLayout
    from quantmla.cache.paged import PagePool
    from quantmla.kernels import append_to_pages, get_mla_metadata, mla_decode_with_kvcache

    monkeypatch.setenv("QUANTMLA_PARTIALS", "fp16")
    g = torch.Generator().manual_seed(4)
    lay = PageLayout(TokenLayout(D_C, D_R, FORMATS["int4/int4"]), PAGE)
    lens, H = [70, 1, 33], 4
    pool = PagePool(lay, sum(lay.pages_for(n) for n in lens) + 2, device=DEV)
    for i, n in enumerate(lens):
        x, r = 2e4 + 1.6e5 * torch.rand(n, D_C, generator=g), torch.randn(n, D_R, generator=g)
        append_to_pages(pool.layer(0), lay, pool.append_slots(i, n).to(DEV), x.to(DEV), r.to(DEV))
    bt, sl = pool.block_table([0, 1, 2]), pool.seq_lens([0, 1, 2])
    qc = (torch.randn(3, 1, H, D_C, generator=g) * 1e-4).to(DEV, torch.bfloat16)
    qr = (torch.randn(3, 1, H, D_R, generator=g) * 1e-4).to(DEV, torch.bfloat16)
    runs = []
    for chunk in (16, 1 << 20):
        md = get_mla_metadata(sl, H, 1, lay, chunk_tokens=chunk)
        runs.append((md, *mla_decode_with_kvcache(qc, qr, pool.layer(0), bt, sl, lay, 0.125, metadata=md)))
    (split, o, l), (whole, o1, _) = runs
    assert split.max_splits > 1 and whole.max_splits == 1
    po, _ = split.partials(H, D_C, partials.partial_dtype(lay), pool.layer(0).device)  # the API's, not a new one
    assert po.dtype == torch.float16 and sum(isinstance(k, tuple) for k in split.workspace) == 1
    ro, rl = reference(lay, pool, bt, sl, qc, qr, 0.125)
    assert ro.abs().max() > 65504 and torch.isfinite(o).all()
    check(o, l, ro, rl)
    assert torch.allclose(o.float(), o1.float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("shape", [CombineShape(1, 16, 2, True), CombineShape(4, 64, 4, False),
                                   CombineShape(2, 32, 16, True), CombineShape(16, 8, 1, False)])
def test_any_combine_shape_merges_a_decode_like_the_default(shape):
    """Sequences of up to 10 splits merged by programs of other shapes (fewer splits a step than a sequence has, with
    and without one_step; more rows a block than the call has): within the same bound of the fp64 oracle as the
    default, NaN-poisoned outputs all written, and within fp32 summation order of the default's output."""
    lay, pool, bt, sl = make_cache(FORMATS["int4/int4"], [0, 1, 17, 40, 150], seed=5)
    o, l, ro, rl, md = run_decode(lay, pool, bt, sl, H=3, SQ=2, chunk_tokens=16)
    assert md.max_splits == 10 and md.combine is None
    o2, l2, ro2, rl2, md2 = run_decode(lay, pool, bt, sl, H=3, SQ=2, chunk_tokens=16, combine=shape)
    assert md2.combine == shape
    check(o2, l2, ro2, rl2)
    assert torch.allclose(o2.float(), o.float(), rtol=0, atol=1e-2) and torch.equal(torch.isinf(l2), torch.isinf(l))
    assert torch.allclose(l2[~torch.isinf(l)], l[~torch.isinf(l)], rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape,match", [(CombineShape(3, 16, 2, True), "powers of two"),
                                         (CombineShape(4, 128, 2, True), "divide d_c")])
def test_bad_combine_shapes_raise_before_launch(shape, match, monkeypatch):
    from quantmla.kernels import api

    lay, pool, bt, sl = make_cache(FORMATS["bf16"], [40, 9], seed=2)
    launched = []
    spy = type("Spy", (), {"__getitem__": lambda s, g: launched.append(g)})()
    monkeypatch.setattr(decode, "_mla_combine_kernel", spy)
    monkeypatch.setattr(api, "launch_decode", lambda *a: launched.append("decode"))
    with pytest.raises(QuantMLAError, match=match):
        run_decode(lay, pool, bt, sl, H=2, SQ=1, chunk_tokens=16, combine=shape)
    assert not launched  # neither the decode kernel nor the combine


class _CombineSpy:
    """Stands in for the combine kernel: records each launch's rows, most splits and constexprs, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(po, plse, seq_info, out, lse, R, **kw):
            self.calls.append(dict(B=grid[0], R=R, D_C=kw["D_C"], max_splits=int(seq_info[:, 1].max()),
                                   shape=CombineShape(kw["BLOCK_R"], kw["BLOCK_D"], kw["BLOCK_S"], kw["ONE_STEP"])))
            return self.kernel[grid](po, plse, seq_info, out, lse, R, **kw)
        return launch


class _StepKinds(EngineObserver):
    """Tags the combine launches of each step with the step's kind."""

    def __init__(self, spy):
        self.spy, self.seen, self.kinds = spy, 0, []

    def step_end(self, timing):
        self.kinds += [timing.kind] * (len(self.spy.calls) - self.seen)
        self.seen = len(self.spy.calls)


def test_eager_decode_rows_take_their_graph_buckets_combine_shape(v3, monkeypatch):
    """Decode rows riding in eager mixed steps (1 to 4 of them) launch the combine kernel only in shapes that the decode
    graphs' replays launch it in, where their own rows and splits would give other shapes. With 8 "SMs", bucket 8 has
    one split a row and launches no combine, so 3 or 4 rows take bucket 2's shape; a bucket list in which no graph
    launches it gives None (the call's own shape). Outputs as generate()."""
    from quantmla.kernels import api
    from quantmla.serving.triton_backend import bucket_splits, decode_tiling

    spy = _CombineSpy(decode._mla_combine_kernel)
    monkeypatch.setattr(decode, "_mla_combine_kernel", spy)
    sms = 8  # the CPU interpreter's schedule takes 4: too few for the buckets' shapes to differ from the rows' own
    for mod in (schedule, api):
        monkeypatch.setattr(mod, "num_sms_of", lambda device: sms)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (20, 22, 25, 100, 90)]
    quant = QuantCacheConfig.of_bits(4, 4, 32, 16)
    cfg = EngineConfig(quant=quant, page_size=16, num_pages=40, backend="triton", cuda_graphs="emulate",
                       graph_buckets=(1, 2, 8), max_num_batched_tokens=32, prefill_graphs=False, overlap_steps=False)
    with Engine(v3, cfg) as eng:
        watch = _StepKinds(spy)
        eng.observers.append(watch)
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
        be, max_len = eng.backend, eng.max_pages_per_seq * cfg.page_size
        (lay,) = be.kinds.values()
        H = v3.config.num_attention_heads
        splits = {b: bucket_splits(decode_tiling(be, lay, b, max_len), H, b, max_len, sms)[0]
                  for b in decode_buckets(eng)}
        assert splits[8] == 1 and splits[2] > 1 and splits[1] > 1, splits
        assert set(be.graph_combine((8,), max_len).values()) == {None}
        assert be.graph_combine((8, 2, 1), max_len) == be.graph_combine((2, 1), max_len)
    rep = compare(v3, quant, prompts, [o.output_ids for o in outs], 8, 2e-2)
    assert rep.exact + rep.ties == len(prompts) and rep.ok, rep.details
    eager = [c for c, k in zip(spy.calls, watch.kinds) if k == "eager"]
    replays = {c["shape"] for c, k in zip(spy.calls, watch.kinds) if k == "graph_decode"}
    assert {c["B"] for c in eager} >= {1, 3} and replays, (eager, replays)
    assert {c["shape"] for c in eager} <= replays, (eager, replays)
    own = {schedule.combine_shape(c["B"], c["R"], c["D_C"], c["max_splits"], sms) for c in eager}
    assert own - replays, "every eager call's own shape is a replay's too (this would show nothing)"


@pytest.mark.parametrize("sms", [4, 132])
def test_bucket_splits_are_the_static_plans(sms, monkeypatch):
    """bucket_splits, which the eager rows' shapes come from without building plans, gives the splits that
    get_mla_metadata cuts a bucket's max_len rows into at one wave of programs (the static plan's; its graph launches
    the combine exactly where they are more than 1), for INT4/INT4 and BF16 tilings."""
    import types

    from quantmla.cache.layout import PageLayout, TokenLayout
    from quantmla.kernels import api
    from quantmla.serving.triton_backend import StaticDecodePlan, bucket_splits, decode_tiling

    monkeypatch.setattr(schedule, "num_sms_of", lambda device: sms)
    seen = set()
    for name in ("int4/int4", "bf16"):
        lay = PageLayout(TokenLayout(64, 32, FORMATS[name]), 16)
        for H in (4, 16):
            backend = types.SimpleNamespace(spec=types.SimpleNamespace(num_heads=H), device=torch.device(DEV),
                                            kinds={"k": lay}, decode_config=None)
            for b in (1, 3, 8, 32):
                for max_len in (16, 1000, 20480):
                    cfg = decode_tiling(backend, lay, b, max_len)
                    S = bucket_splits(cfg, H, b, max_len, sms)[0]
                    # independently: one wave's splits of a max_len row, cut by get_mla_metadata itself
                    span = -(-max(cfg.min_chunk, 1) // cfg.block_n) * cfg.block_n
                    want = max(1, min(max(1, sms * cfg.ctas_per_sm // -(-H // cfg.block_m)) // b, -(-max_len // span)))
                    md = api.get_mla_metadata(torch.full((b,), max_len, dtype=torch.int32), H, 1, lay, config=cfg,
                                              chunk_tokens=-(-max_len // want))
                    assert S == md.max_splits and md.num_units == b * S, (name, H, b, max_len)
                    plan = StaticDecodePlan(backend, b, max_len)
                    assert plan.split["k"][0] == S and plan.md["k"].combine == api.combine_shape(b, H, 64, S, sms)
                    seen.add(S > 1)
    assert seen == {True, False}
