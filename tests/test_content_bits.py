"""Content bits per layer at a fixed byte budget (calibration.bits) and the MIX rows of `quantmla eval`."""

import pytest
import torch

from quantmla.calibration.bits import allocate_content_bits, content_sensitivity
from quantmla.errors import QuantMLAError
from quantmla.evaluation.harness import RowSpec, named_config, prepare
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
