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


def test_mistral4_query_scaling_is_applied_where_it_starts():
    """mistral4 with llama_4_scaling_beta scales its rotated queries by 1 + β·log(1 + ⌊p / 8⌋) from position 8 on
    (original_max_position_embeddings): the view's attention with ``scale_queries`` equals the module's over 30
    positions (and without it does not), the engine's tokens and logits equal generate()'s past position 8 (within
    2e-3; 0.022 apart without the scale), and calibration takes rows longer than 8."""
    from transformers.models.mistral4.modeling_mistral4 import Mistral4ForCausalLM

    from quantmla.cache.config import QuantCacheConfig
    from quantmla.calibration import calibrate
    from quantmla.model.capture import capture_attention_inputs
    from quantmla.model.spec import mla_modules
    from quantmla.model.tiny import _COMMON
    from quantmla.model.view import MLAView
    from quantmla.reference import absorbed_attention
    from quantmla.serving.engine import BF16_CONFIG, Engine, EngineConfig
    from quantmla.serving.scheduler import SamplingParams
    from quantmla_lab.bench.serving.agreement import reference_generate

    cfg = AutoConfig.for_model("mistral4", **_COMMON)
    cfg.rope_parameters = {**cfg.rope_parameters, "llama_4_scaling_beta": 0.5, "original_max_position_embeddings": 8}
    torch.manual_seed(0)
    model = Mistral4ForCausalLM(cfg).eval()
    spec = load_spec(model)
    assert (spec.scaled_query_from, spec.query_scale_beta) == (8, 0.5)
    assert load_spec(tiny_model("deepseek_v3")).scaled_query_from is None
    ids = torch.randint(3, 100, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), capture_attention_inputs(model, outputs=True) as rec:
        model(ids)
    pos = torch.arange(30)
    for slot, module in mla_modules(model).items():
        r, view = rec[slot][0], MLAView(module, spec)
        assert torch.equal(view.position_query_scale(torch.tensor([0, 7, 8, 16, 24])),
                           1 + 0.5 * torch.log(torch.tensor([1.0, 1.0, 2.0, 3.0, 4.0])))
        with torch.no_grad():
            p = view.parts(r["hidden"], r["position_embeddings"])
            q = (p["q_nope"].transpose(1, 2), p["q_rope"].transpose(1, 2))  # [B, S, H, d]
            for qs, agrees in ((view.scale_queries(pos, *q), True), (q, False)):
                o, _ = absorbed_attention(view.absorb(qs[0].transpose(1, 2)).transpose(1, 2), qs[1], p["latent"],
                                          p["k_rope"], spec.softmax_scale)
                close = torch.allclose(view.output(o), r["output"], rtol=1e-4, atol=1e-5)
                assert close == agrees, (slot, agrees)
    prompts = [ids[0, :9].tolist(), ids[1, :20].tolist()]
    for quant in (BF16_CONFIG, QuantCacheConfig.of_bits(4, 4, 32, 16)):
        cfg = EngineConfig(quant=quant, num_pages=8, page_size=16, max_num_batched_tokens=16, backend="torch",
                           keep_logits=True)
        with Engine(model, cfg) as eng:
            outs = eng.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
        for prompt, o in zip(prompts, outs):  # each step's logits, positions 9 to 31, as generate() computes them
            toks, scores = reference_generate(model, quant, prompt, 12)
            assert o.output_ids == toks
            torch.testing.assert_close(torch.stack([torch.as_tensor(x) for x in o.logits]).float(), scores,
                                       rtol=0, atol=2e-3)
    calibrate(model, ids[:, :12], QuantCacheConfig.of_bits(4, 4, 32, 16), progress=False)  # rows past position 8
