"""Quantities with one definition each: the RoPE pair layout, the checkpoint's stored cache formats,
and the compression ratio, whichever entry point asks."""

import pytest
import torch
from transformers import PretrainedConfig

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.layout import CacheFormat, compression
from quantmla.cache.paged import compression_report
from quantmla.errors import QuantMLAError
from quantmla.model.spec import load_spec, pair_channels
from quantmla.model.tiny import tiny_config
from quantmla.quant import PathFormat
from quantmla.transforms.rope import pair_channels as rope_pair_channels


def test_pair_layout_has_one_definition():
    assert rope_pair_channels is pair_channels
    for family, layout in (("deepseek_v3", "interleaved"), ("deepseek_v2", "rotate_half")):
        spec = load_spec(tiny_config(family))
        for lay in ("interleaved", "rotate_half", "none"):
            a, b = spec.pair_index(lay)
            ra, rb = pair_channels(spec.d_r, lay)
            assert torch.equal(a, ra) and torch.equal(b, rb)
    assert torch.equal(pair_channels(6, "interleaved")[1], torch.tensor([1, 3, 5]))
    assert torch.equal(pair_channels(6, "rotate_half")[1], torch.tensor([3, 4, 5]))
    with pytest.raises(QuantMLAError, match="unknown RoPE pair layout"):
        spec.pair_index("sideways")
    with pytest.raises(QuantMLAError, match="even"):
        pair_channels(5, "interleaved")


def test_stored_cache_formats_from_a_config_object_or_its_json():
    q = QuantCacheConfig.of_bits(4, 4, 32, 16)
    as_json = {"model_type": "deepseek_v3", "quantization_config": q.to_dict()}
    obj = PretrainedConfig(quantization_config=q.to_dict())
    assert QuantCacheConfig.from_model_config(as_json) == q == QuantCacheConfig.from_model_config(obj)
    fp8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}  # FP8 weights: nothing about the cache
    assert QuantCacheConfig.from_model_config(fp8) is None
    assert QuantCacheConfig.from_model_config({"model_type": "x"}) is None
    assert QuantCacheConfig.from_model_config(PretrainedConfig(quantization_config=fp8["quantization_config"])) is None
    import quantmla.cache.config as config

    assert not hasattr(config, "stored_cache_config")  # one name for it


def test_compression_report_ratio_is_the_layout_ratio():
    fmt = CacheFormat(PathFormat(4, 128), PathFormat(4, 64))
    for row in compression_report(512, 64, fmt, (100, 4096, 131072), 64):
        assert row["compression"] == compression(512, 64, fmt, row["tokens"], 64)
        assert row["compression"] == row["bf16_allocated_bytes"] / row["allocated_bytes"]
