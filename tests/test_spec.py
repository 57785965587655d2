"""The MLA spec of every family; clear errors for non-MLA checkpoints."""

import json

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from quantmla.errors import NotMLAError
from quantmla.model.spec import ExpandedCacheFamilyError, load_spec
from quantmla.model.tiny import FAMILIES, tiny_model

EXPECTED_LAYOUTS = {
    "deepseek_v2": ("interleaved", "interleaved"),
    "deepseek_v3": ("interleaved", "rotate_half"),
    "deepseek_v3_rotate_half": ("rotate_half", "rotate_half"),
    "minicpm3": ("rotate_half", "rotate_half"),
    "glm4_moe_lite": ("interleaved", "rotate_half"),
    "longcat_flash": ("interleaved", "rotate_half"),
    "kimi_linear": ("none", "none"),
    "youtu": ("interleaved", "rotate_half"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_of_tiny_models(family):
    spec = load_spec(tiny_model(family))
    assert (spec.d_c, spec.d_r, spec.d_n, spec.d_v, spec.num_heads) == (32, 16, 16, 16, 4)
    assert (spec.rope_weight_layout, spec.rope_cache_layout) == EXPECTED_LAYOUTS[family]
    assert spec.caches_latent
    if family == "kimi_linear":
        assert spec.mla_layers == (1,) and spec.num_cache_layers == 3  # only the full-attention layer is MLA
    else:
        assert spec.mla_layers == (0, 1)
    assert (spec.latent_scale != 1.0) == (family == "longcat_flash")
    a, b = spec.pair_index()
    assert sorted(torch.cat([a, b]).tolist()) == list(range(16))


def test_yarn_mscale_enters_softmax_scale():
    spec = load_spec(tiny_model("deepseek_v3"))
    plain = load_spec(tiny_model("deepseek_v3_rotate_half"))
    assert spec.softmax_scale > plain.softmax_scale == pytest.approx(32**-0.5)


@pytest.mark.parametrize(
    "family, kw",
    [
        ("deepseek_v2", {}),
        ("deepseek_v3", {}),
        ("minicpm3", {}),
        ("glm4_moe_lite", {}),
        ("longcat_flash", {}),
        ("kimi_linear", {}),
        ("mistral4", {}),
        ("youtu", {}),
        ("deepseek_v32", {}),
    ],
)
def test_spec_of_full_size_configs_without_weights(family, kw):
    spec = load_spec(AutoConfig.for_model(family, **kw))  # built on the meta device: no memory
    assert spec.d_c in (256, 512) and spec.d_r in (32, 64)
    if family == "deepseek_v32":
        assert not spec.caches_latent
        with pytest.raises(ExpandedCacheFamilyError, match="expanded per-head keys"):
            spec.require_latent_cache()


def test_checkpoint_directory(tmp_path):
    tiny_model("deepseek_v3").save_pretrained(tmp_path / "ckpt")
    assert load_spec(tmp_path / "ckpt").family == "deepseek_v3"


def test_non_mla_checkpoint_is_a_clear_error(tmp_path):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(NotMLAError, match="not a Multi-Head Latent Attention model.*kv_lora_rank"):
        load_spec(tmp_path)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_spec(tmp_path / "nope")


def test_unknown_model_type_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    with pytest.raises(NotMLAError, match="not_a_model"):
        load_spec(tmp_path)


def test_mistral4_query_scaling_bounds_what_the_latent_path_serves_and_calibrates():
    """mistral4 with llama_4_scaling_beta scales queries from original_max_position_embeddings on, which the MLAView
    path does not apply: the spec says where, and the engine and calibration refuse longer contexts (the view's
    attention matched the module's only below it)."""
    from transformers.models.mistral4.modeling_mistral4 import Mistral4ForCausalLM

    from quantmla.cache.config import QuantCacheConfig
    from quantmla.calibration import calibrate
    from quantmla.errors import QuantMLAError
    from quantmla.model.tiny import _COMMON
    from quantmla.serving.engine import Engine, EngineConfig

    cfg = AutoConfig.for_model("mistral4", **_COMMON)
    cfg.rope_parameters = {**cfg.rope_parameters, "llama_4_scaling_beta": 0.5, "original_max_position_embeddings": 8}
    torch.manual_seed(0)
    model = Mistral4ForCausalLM(cfg).eval()
    assert load_spec(model).scaled_query_from == 8 and load_spec(tiny_model("deepseek_v3")).scaled_query_from is None
    with pytest.raises(QuantMLAError, match="scales its queries from position 8 on"):
        Engine(model, EngineConfig(num_pages=4, page_size=16, backend="torch", max_model_len=16))
    from quantmla.serving.scheduler import Request, SamplingParams

    with Engine(model, EngineConfig(num_pages=4, page_size=16, backend="torch", cuda_graphs=False)) as eng:
        out = {o.request_id: o for o in eng.generate(
            [Request("ok", [5] * 6, SamplingParams(max_new_tokens=3, ignore_eos=True)),
             Request("long", [5] * 9, SamplingParams(max_new_tokens=2, ignore_eos=True))])}
    assert out["ok"].finish_reason == "length" and out["long"].finish_reason == "error"
    assert "needs 10 positions, but mistral4 scales its queries from position 8 on" in out["long"].error
    ids = torch.randint(3, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(QuantMLAError, match="calibration rows of 12 tokens: mistral4 scales its queries"):
        calibrate(model, ids, QuantCacheConfig.of_bits(4, 4, 32, 16), progress=False)
