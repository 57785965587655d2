"""The decode-in-graph bench's command line (lab/quantmla_lab/bench/kernels/decode_in_graph.py): its plans' keywords
and macros, and bad input refused with the fix before any device is looked at."""

import pytest

from quantmla_lab.bench.kernels import decode_in_graph as dig


def test_plans_split_tiling_keywords_from_build_macros():
    assert dig.parse_plan("") == {}
    assert dig.parse_plan("specialized=0,token_blocks=2") == {"specialized": False, "token_blocks": 2}
    assert dig.parse_plan("WS_REGS=0,ctas_per_sm=1") == {"macros": {"WS_REGS": 0}, "ctas_per_sm": 1}


@pytest.mark.parametrize("spec", ["foo=1", "token_blocks=x", "WS_REGS", "specialized=-1"])
def test_a_bad_plan_is_refused_with_its_form(spec):
    with pytest.raises(SystemExit, match="KEY=INT"):
        dig.parse_plan(spec)


def test_configs_are_cuda_config_keywords():
    assert dig.parse_config("") == {}
    assert dig.parse_config("tokens_m=1,ctas_per_sm=1") == {"tokens_m": True, "ctas_per_sm": 1}


@pytest.mark.parametrize("spec", ["ctas=1", "ctas_per_sm=one", "WS=1"])
def test_a_bad_config_is_refused_with_its_form(spec):
    with pytest.raises(SystemExit, match="KEY=INT"):
        dig.parse_config(spec)


def test_combine_blocks_take_the_apis_splits_a_step():
    from quantmla.kernels import schedule

    assert dig.parse_blocks("") is None and dig.combine_for(None, 33) is None
    assert dig.parse_blocks("1x64") == (1, 64)
    shape = dig.combine_for((1, 64), 33)  # 64 splits of one row's 64 channels fit one step
    assert shape == schedule.CombineShape(1, 64, 64, True)
    wide = dig.combine_for((16, 64), 264)  # a tile of COMBINE_TILE: 4 splits a step, two passes
    assert wide.block_s == schedule.COMBINE_TILE // (16 * 64) and not wide.one_step
    wide.check(16, 512)


@pytest.mark.parametrize("spec", ["1x48", "64", "ax2", "0x64", "1x1024"])
def test_bad_combine_blocks_are_refused_with_their_form(spec):
    with pytest.raises(SystemExit, match="ROWSxCHANNELS"):
        dig.parse_blocks(spec)


@pytest.mark.parametrize("argv,says", [
    (["--shapes", "8y2048"], "BATCHxCONTEXT"),
    (["--methods", "int5/int4"], "5-bit"),
    (["--layers", "0"], "must be positive"),
    (["--plans", "bogus=1"], "KEY=INT"),
    (["--configs", "", "bogus=1"], "KEY=INT"),
    (["--combine-blocks", "3x64"], "ROWSxCHANNELS"),
])
def test_bad_input_is_refused_before_the_device(argv, says):
    with pytest.raises(SystemExit, match=says):
        dig.main(argv)
