"""Content bits per layer at a fixed byte budget (calibration.bits) and the MIX rows of `quantmla eval`."""

import os

import pytest
import torch

from quantmla.calibration.bits import allocate_content_bits, content_sensitivity
from quantmla.errors import QuantMLAError
from quantmla.evaluation.configs import named_config
from quantmla.evaluation.harness import RowSpec, prepare
from quantmla.model.spec import load_spec
from quantmla.model.tiny import tiny_model
from quantmla.quant import PathFormat

LOW, HIGH, ROPE = PathFormat(2, 16), PathFormat(4, 16), PathFormat(4, 8)


def test_allocation_gives_the_high_width_to_the_largest_gains():
    sens = {0: (0.10, 0.01), 1: (0.50, 0.02), 2: (0.05, 0.04), 3: (0.50, 0.01)}  # gains .09 .48 .01 .49
    assert set(allocate_content_bits(sens, 3.0, LOW, HIGH, ROPE)) == {1, 3}
    assert set(allocate_content_bits(sens, 2.5, LOW, HIGH, ROPE)) == {3}
    over = allocate_content_bits(sens, 3.5, LOW, HIGH, ROPE)
    assert set(over) == {0, 1, 3} and all(f.content == HIGH and f.rope == ROPE for f in over.values())
    tied = {5: (0.2, 0.1), 2: (0.2, 0.1), 7: (0.2, 0.1), 4: (0.2, 0.1)}
    assert set(allocate_content_bits(tied, 3.0, LOW, HIGH, ROPE)) == {2, 4}  # equal gains: the lower slots


@pytest.mark.parametrize("avg,low,high,match", [
    (2.0, LOW, HIGH, "not between"), (4.0, LOW, HIGH, "not between"), (5.0, LOW, HIGH, "not between"),
    (3.0, HIGH, LOW, "must be below"), (3.0, LOW, PathFormat(8, 128, "fp8", "float32"), "integer formats"),
])
def test_allocation_rejects_bad_budgets(avg, low, high, match):
    with pytest.raises(QuantMLAError, match=match):
        allocate_content_bits({0: (0.1, 0.0)}, avg, low, high, ROPE)


def test_sensitivity_is_larger_at_the_lower_width():
    torch.manual_seed(0)
    model = tiny_model("deepseek_v3")
    ids = torch.randint(3, 128, (4, 24))
    sens = content_sensitivity(model, ids, LOW, HIGH)
    assert sorted(sens) == sorted(load_spec(model).mla_layers)
    for lo, hi in sens.values():
        assert lo > hi > 0


def test_mix_row_stores_each_layer_at_its_width():
    torch.manual_seed(0)
    model = tiny_model("deepseek_v3")
    spec = load_spec(model)
    ids = torch.randint(3, 128, (4, 24))
    cfg = named_config("MIX3/INT4", 16, 8)
    assert (cfg.content.bits, cfg.mix_high.bits, cfg.mix) == (2, 4, 3.0)
    row = RowSpec(cfg, "rtn")
    lo, hi = (named_config(n, 16, 8) for n in ("INT2/INT4", "INT4/INT4"))
    for method in ("rtn", "quantmla-rope-channel"):  # per-token RoPE groups, and RoPE per channel per page
        ends = [RowSpec(c, method).bytes_per_token(spec) for c in (lo, hi)]
        assert RowSpec(cfg, method).bytes_per_token(spec) == sum(ends) / 2
    quant, _ = prepare(model, row, ids)
    high = set(quant.layer_overrides)
    assert len(high) == round(len(spec.mla_layers) / 2) and high <= set(spec.mla_layers)
    cache = row.cache_factory(quant)(model)
    bits = {layer.layer_idx: layer.fmt.content.bits for layer in cache.mla_layers()}
    assert bits == {s: 4 if s in high else 2 for s in spec.mla_layers}
    with pytest.raises(QuantMLAError, match="content bits per layer"):
        RowSpec(cfg, "kivi")
    with pytest.raises(QuantMLAError, match="MIX takes an average"):
        named_config("MIXx/INT4")
    with pytest.raises(QuantMLAError, match="not between"):
        named_config("MIX4/INT4")


def test_mix_row_records_its_allocation():
    """An evaluated MIX row says which slots stored which width (the allocation depends on the data)."""
    from quantmla.evaluation.harness import EvalData, evaluate_row

    torch.manual_seed(0)
    model = tiny_model("deepseek_v3")
    spec = load_spec(model)
    ids = torch.randint(3, 128, (4, 24))
    data = EvalData(ppl=ids[:1], seq_len=24, retrieval={}, calib_ids=ids)
    row = RowSpec(named_config("MIX3/INT4", 16, 8), "rtn")
    out = evaluate_row(model, None, row, data, spec=spec, ppl_fn=lambda *a, **k: {"bits_per_byte": 1.0})
    bits = out["content_bits_by_slot"]
    assert sorted(int(s) for s in bits) == sorted(spec.mla_layers) and sorted(bits.values()).count(4) == len(bits) // 2
    assert "in the layers the error model picks" in out["format"]


# -- MIX<a>@g<G>/<R>: the INT4 layers' content at their own group ---------------------------------------


def test_mix_high_group_is_parsed_and_named():
    cfg = named_config("MIX2.5@g64/INT4", 32, 16)
    assert cfg.name == "MIX2.5@g64/INT4" and cfg.mix == 2.5
    assert (cfg.content, cfg.mix_high, cfg.rope) == (PathFormat(2, 32), PathFormat(4, 64), PathFormat(4, 16))
    assert "content INT4/g64 in the layers the error model picks" in cfg.describe()
    for spelling in ("mix2.5@G64/int4", "MIX2.5@64/INT4"):
        assert named_config(spelling, 32, 16) == cfg
    same_group = named_config("MIX2.5@g32/INT4", 32, 16)  # the group given, the name says it
    assert same_group.name == "MIX2.5@g32/INT4" and same_group.mix_high == PathFormat(4, 32)
    plain = named_config("MIX2.5/INT4", 32, 16)  # without @: the high width at the content group, as before
    assert plain.name == "MIX2.5/INT4" and plain.mix_high == PathFormat(4, 32)
    assert named_config("MIX3/INT4").mix_high == PathFormat(4, 64)  # the defaults: content group 64


@pytest.mark.parametrize("model", ["qmla-ref-deepseek-v2", "qmla-ref-deepseek-v3", "qmla-ref-minicpm3",
                                   "qmla-ref-glm4-moe-lite"])
def test_mix_at_group_64_stores_the_baselines_bytes(model):
    """On the shipped models (d_c 128, d_r 32, g32/g16) the one INT4 layer in four at group 64 spends the
    6 B a token that RoPE keys per channel per page save: 72 B, the INT2/INT4 baselines' bytes."""
    from quantmla.corpus.datasets import models_root

    spec = load_spec(str(models_root() / model))
    assert (spec.d_c, spec.d_r, len(spec.mla_layers)) == (128, 32, 4)
    cfg = named_config("MIX2.5@g64/INT4", 32, 16)
    assert cfg.mix_extra_bytes(spec.d_c) == 6.0  # (64 + 2·4) − (32 + 4·4) = 24 B in one layer of four

    def bytes_of(name, method):  # KIVI's token block at the RoPE group, as `quantmla eval` sets it (equal bytes)
        return RowSpec(named_config(name, 32, 16), method, kivi_block=16).bytes_per_token(spec)

    assert bytes_of("MIX2.5@g64/INT4", "quantmla-rope-channel") == 72.0
    assert {bytes_of("INT2/INT4", m) for m in ("rtn", "kivi", "hadamard")} == {72.0}
    assert bytes_of("INT2/INT4", "quantmla-rope-channel") == 66.0
    assert bytes_of("MIX2.5/INT4", "quantmla-rope-channel") == 74.0  # the INT4 layer at g32
    assert bytes_of("MIX2.5@g64/INT4", "rtn") == 78.0  # per-token RoPE groups: 72 + 6


@pytest.mark.parametrize("name,match", [
    ("MIX2.5@g6/INT4", "power of two"), ("MIX2.5@g2/INT4", "at least 4 channels"),
    ("MIX2.5@g0/INT4", "at least 4 channels"), ("MIX2.5@/INT4", "after @ give"),
    ("MIX2.5@gx/INT4", "after @ give"), ("MIX2.5@g-8/INT4", "after @ give"), ("MIX4@g64/INT4", "not between"),
])
def test_bad_mix_high_groups_are_refused(name, match):
    with pytest.raises(QuantMLAError, match=match):
        named_config(name, 32, 16)


def test_a_high_group_that_does_not_divide_d_c_fails_before_the_error_model(monkeypatch):
    from quantmla.calibration import bits
    from quantmla.errors import UnsupportedFormatError

    cfg = named_config("MIX3@g64/INT4", 8, 8)  # the tiny model's d_c is 32
    with pytest.raises(UnsupportedFormatError, match="INT4/g64 layers .*group_size 64 does not divide its 32"):
        cfg.check_dims(32)
    cfg.check_dims(128)
    monkeypatch.setattr(bits, "content_sensitivity", lambda *a, **k: pytest.fail("the error model ran"))
    with pytest.raises(UnsupportedFormatError, match="does not divide"):
        prepare(tiny_model("deepseek_v3"), RowSpec(cfg, "rtn"), torch.randint(3, 128, (2, 8)))


def test_eval_refuses_a_high_group_that_does_not_divide_d_c_before_loading(tmp_path, capsys, monkeypatch):
    from quantmla.cli import main
    from quantmla.corpus.datasets import models_root

    monkeypatch.setattr("quantmla.model.load.load_model", lambda *a, **k: pytest.fail("weights were read"))
    out = tmp_path / "out"
    rc = main(["eval", str(models_root() / "qmla-ref-deepseek-v3"), "--rows", "MIX2.5@g256/INT4:quantmla-rope-channel",
               "--groups", "32/16", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    assert "MIX2.5@g256/INT4" in err and "group_size 256 does not divide its 128 channels" in err
    assert not out.exists()


@pytest.mark.parametrize("method", ["rtn", "quantmla-rope-channel"])
def test_the_chosen_layer_stores_the_high_group(method):
    """The error model's layer gets CacheFormat(INT4 at the high group, the row's RoPE format); calibration
    fits for it, the cache stores it, the row's JSON says it; the other layer keeps INT2 at the content group."""
    from quantmla.evaluation.harness import EvalData, evaluate_row

    torch.manual_seed(0)
    model = tiny_model("deepseek_v3")
    spec = load_spec(model)
    ids = torch.randint(3, 128, (4, 24))
    cfg = named_config("MIX3@g32/INT4", 8, 8)  # d_c 32: INT2/g8 in one layer, INT4/g32 in the other
    row = RowSpec(cfg, method)
    seen = []

    def calibrate(model, calib_ids, quant, **kw):  # what calibration is asked to fit for (no fit: fast)
        seen.append(quant)

    quant, _ = prepare(model, row, ids, calibrate_fn=calibrate)
    assert len(quant.layer_overrides) == 1
    (high,) = quant.layer_overrides
    assert quant.layer_overrides[high].content == PathFormat(4, 32)
    assert quant.layer_overrides[high].rope == PathFormat(4, 8)
    assert quant.format_for(1 - high).content == PathFormat(2, 8)
    if method != "rtn":
        assert seen == [quant]
    cache = row.cache_factory(quant)(model)
    stored = {layer.layer_idx: layer.fmt.content for layer in cache.mla_layers()}
    assert stored == {high: PathFormat(4, 32), 1 - high: PathFormat(2, 8)}
    data = EvalData(ppl=ids[:1], seq_len=24, retrieval={}, calib_ids=ids)
    out = evaluate_row(model, None, row, data, spec=spec, ppl_fn=lambda *a, **k: {"bits_per_byte": 1.0},
                       calibrate_fn=calibrate)
    assert out["config"] == "MIX3@g32/INT4" and "content INT4/g32 in the layers" in out["format"]
    assert out["content_format_by_slot"] == {str(high): "INT4/g32", str(1 - high): "INT2/g8"}
    assert out["content_bits_by_slot"] == {str(high): 4, str(1 - high): 2}
    # nominal bytes: half the layers' content from 8 + 2·4·2 = 24 B to 16 + 1·2·2 = 20 B
    low_row = RowSpec(named_config("INT2/INT4", 8, 8), method).bytes_per_token(spec)
    assert out["bytes_per_token"] == low_row + (20 - 24) / 2


def test_paged_engine_serves_layers_of_different_content_groups():
    """The paged cache reads per-layer formats as it reads any layout: with one layer at INT4/g32 and the
    other at INT2/g8 (RoPE per channel per page), each slot's pages have that slot's layout, and every
    generated token's logits equal generate()'s on the evaluation cache (RopeChannelCache) of the same
    overrides (torch backend, fp32)."""
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.cache.layout import CacheFormat
    from quantmla.cache.rope_channel import RopeChannelCache, RopeChannelFormat
    from quantmla.serving.engine import Engine, EngineConfig
    from quantmla.serving.scheduler import SamplingParams
    from quantmla_lab.bench.serving.agreement import reference_generate

    model = tiny_model("deepseek_v3")
    quant = QuantCacheConfig(content=PathFormat(2, 8), rope=PathFormat(4, 8),
                             layer_overrides={1: CacheFormat(PathFormat(4, 32), PathFormat(4, 8))})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 30)]
    refs = [reference_generate(model, quant, p, 20, lambda: RopeChannelCache(model, quant, RopeChannelFormat(4, 16)))
            for p in prompts]
    with Engine(model, EngineConfig(quant=quant, num_pages=32, page_size=16, max_num_batched_tokens=64,
                                    backend="torch", keep_logits=True, rope_pages=True)) as eng:
        assert eng.formats[1].content == PathFormat(4, 32) and eng.formats[0].content == PathFormat(2, 8)
        lay = eng.backend.layouts
        assert lay[1].token.fmt.content.group_size == 32 and lay[0].token.fmt.content.group_size == 8
        assert lay[1].page_bytes != lay[0].page_bytes
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    gap = 0.0
    for o, (toks, scores) in zip(outs, refs):
        n = next((j for j, (a, b) in enumerate(zip(o.output_ids, toks)) if a != b), len(toks))
        assert n > 0
        gap = max(gap, max(float((torch.as_tensor(o.logits[j]).float() - scores[j]).abs().max()) for j in range(n)))
    assert gap < 1e-4, gap


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_kernels_serve_layers_of_different_content_groups():
    """The same per-layer formats through the append and decode kernels (one layout kind per slot, the padded
    graph step paths): greedy outputs agree with generate() on RopeChannelCache. Interpreted on CPU; on a GPU
    (TRITON_INTERPRET=0) the model and the engine run on it, with the kernels the API chooses there."""
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.cache.layout import CacheFormat
    from quantmla.cache.rope_channel import RopeChannelCache, RopeChannelFormat
    from quantmla_lab.bench.serving.agreement import engine_agreement

    model = tiny_model("deepseek_v3")
    if os.environ.get("TRITON_INTERPRET") != "1":
        model = model.cuda()
    quant = QuantCacheConfig(content=PathFormat(2, 8), rope=PathFormat(4, 8),
                             layer_overrides={1: CacheFormat(PathFormat(4, 32), PathFormat(4, 8))})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 23, 40)]
    rep, stats = engine_agreement(
        model, quant, prompts, 12, tie_tol=1e-3, backend="triton", cuda_graphs="emulate", rope_pages=True,
        max_num_batched_tokens=24, cache_factory=lambda: RopeChannelCache(model, quant, RopeChannelFormat(4, 16)))
    assert rep.ok and rep.exact >= 2, rep.details
    assert stats["backend"] == "triton" and stats["graph_steps"] > 0
