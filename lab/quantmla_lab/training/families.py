"""Configurations of the four reference MLA families (transformers classes, dense MLPs).

All reference models share the MLA core the project studies: ``d_c = kv_lora_rank = 128``,
``d_r = qk_rope_head_dim = 32``, 8 heads, hidden 192, 4 layers, SwiGLU MLP 512, vocab 3072,
tied embeddings (about 2.7-2.9 M parameters, under 6 MiB in bf16). The 6 MiB budget forces
``qk_nope_head_dim = 32`` (the families use 2-3x ``d_r``); what each family keeps:

=============  ==========  ============================  ===========================================
family         q path      RoPE pair layout              other
=============  ==========  ============================  ===========================================
deepseek_v2    q_proj      (2j, 2j+1) via view_as_complex  DeepSeek-V2-Lite: no q_lora, theta 1e4
deepseek_v3    q_lora 128  (2j, 2j+1) rope_interleave    YaRN x4 over 1024 (mscale 1, all_dim 1)
minicpm3       q_lora 128  (j, j+16) rotate-half         scale_emb 12, scale_depth 1.4
glm4_moe_lite  q_lora 128  (2j, 2j+1) rope_interleave    theta 1e6, v_head_dim 48 > nope (GLM: v>nope)
=============  ==========  ============================  ===========================================

deepseek_v3 is trained like its family extends context: the first phase (1024-token rows)
uses plain RoPE, the second (4096-token rows) switches to YaRN (factor 4 over the original
1024 positions) — :func:`short_context_rope` / :func:`set_rope`.
"""

from __future__ import annotations

FAMILIES = ("deepseek_v2", "deepseek_v3", "minicpm3", "glm4_moe_lite")
MODEL_NAMES = {
    "deepseek_v2": "qmla-ref-deepseek-v2",
    "deepseek_v3": "qmla-ref-deepseek-v3",
    "minicpm3": "qmla-ref-minicpm3",
    "glm4_moe_lite": "qmla-ref-glm4-moe-lite",
}
ROPE_LAYOUT = {
    "deepseek_v2": "interleaved pairs (2j, 2j+1): transformers 5.17 deepseek_v2 applies RoPE with "
    "torch.view_as_complex on the last dim reshaped (..., d_r/2, 2)",
    "deepseek_v3": "interleaved pairs (2j, 2j+1): rope_interleave=True",
    "minicpm3": "rotate-half pairs (j, j + d_r/2)",
    "glm4_moe_lite": "interleaved pairs (2j, 2j+1): rope_interleave=True",
}

SIZES = {
    # the shipped reference models
    "ref": dict(hidden=192, layers=4, heads=8, d_c=128, d_r=32, nope=32, v=32, inter=512, q_lora=128, max_pos=4096),
    # CPU experiments (learning-dynamics checks at short context)
    "small": dict(hidden=128, layers=4, heads=8, d_c=64, d_r=16, nope=16, v=16, inter=320, q_lora=64, max_pos=1024),
    # CI / CPU smoke tests: same code paths, tiny
    "tiny": dict(hidden=64, layers=2, heads=4, d_c=32, d_r=16, nope=16, v=16, inter=128, q_lora=32, max_pos=512),
    # DeepSeek-V2-Lite's cache geometry (d_c 512, d_r 64, 16 heads, no query LoRA), deepseek_v2 family only;
    # about 10 M parameters (20 MB in bf16): trained and evaluated on the GPU, not shipped in git
    "deepseek-geometry": dict(hidden=256, layers=4, heads=16, d_c=512, d_r=64, nope=64, v=64, inter=512, q_lora=None,
                              max_pos=4096),
}
SIZE_FAMILIES = {"deepseek-geometry": ("deepseek_v2",)}
"""Sizes that fit only some families (the others have a query LoRA)."""


def model_name(family: str, size: str = "ref") -> str:
    """The model directory name: the shipped name for the "ref" size, that name and the size otherwise."""
    return MODEL_NAMES[family] if size == "ref" else f"{MODEL_NAMES[family]}-{size}"


def yarn_parameters(max_pos: int, factor: float = 4.0, theta: float = 10000.0) -> dict:
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": factor,
        "original_max_position_embeddings": int(max_pos // factor),
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


def make_config(family: str, vocab_size: int, size: str = "ref"):
    """The final (shipped) configuration of ``family``."""
    import transformers

    s = SIZES[size]
    if family not in SIZE_FAMILIES.get(size, FAMILIES):
        raise ValueError(f"size {size!r} fits the families {', '.join(SIZE_FAMILIES[size])}, not {family!r}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["heads"],
        kv_lora_rank=s["d_c"],
        qk_rope_head_dim=s["d_r"],
        qk_nope_head_dim=s["nope"],
        v_head_dim=s["v"],
        max_position_embeddings=s["max_pos"],
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attention_bias=False,
    )
    if family == "deepseek_v2":
        return transformers.DeepseekV2Config(
            q_lora_rank=None,
            first_k_dense_replace=s["layers"],  # every layer dense
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=s["inter"] // 4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rms_norm_eps=1e-6,
            **common,
        )
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            q_lora_rank=s["q_lora"],
            first_k_dense_replace=s["layers"],
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=s["inter"] // 4,
            rope_interleave=True,
            rope_parameters=yarn_parameters(s["max_pos"]),
            rms_norm_eps=1e-6,
            **common,
        )
    if family == "minicpm3":
        return transformers.MiniCPM3Config(
            q_lora_rank=s["q_lora"],
            scale_emb=12,
            scale_depth=1.4,
            dim_model_base=s["hidden"],  # logits_scaling = 1 at this width
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rms_norm_eps=1e-5,
            **common,
        )
    if family == "glm4_moe_lite":
        common = dict(common, v_head_dim=s["v"] + s["v"] // 2)
        return transformers.Glm4MoeLiteConfig(
            q_lora_rank=s["q_lora"],
            mlp_layer_types=["dense"] * s["layers"],
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=s["inter"] // 4,
            rope_interleave=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            rms_norm_eps=1e-5,
            **common,
        )
    raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")


def short_context_rope(config) -> dict | None:
    """RoPE parameters of the short-context phase, or None when they are the final ones."""
    rp = dict(config.rope_parameters)
    if rp.get("rope_type") == "yarn":
        return {"rope_type": "default", "rope_theta": rp["rope_theta"]}
    return None


def set_rope(model, rope_parameters: dict) -> None:
    """Switch a model's RoPE (rotary module + softmax scale) to ``rope_parameters`` in place."""
    config = model.config
    config.rope_parameters = dict(rope_parameters)
    inner = model.model
    old = inner.rotary_emb
    new = type(old)(config=config)
    inner.rotary_emb = new.to(old.inv_freq.device)
    mod = __import__(type(model).__module__, fromlist=["yarn_apply_mscale"])
    for layer in inner.layers:
        attn = layer.self_attn
        attn.scaling = mod.yarn_apply_mscale(config.rope_parameters, attn.qk_head_dim ** (-0.5))


def describe(config) -> dict:
    """The MLA shape summary recorded in cards."""
    return {
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "kv_lora_rank (d_c)": config.kv_lora_rank,
        "qk_rope_head_dim (d_r)": config.qk_rope_head_dim,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "v_head_dim": config.v_head_dim,
        "q_lora_rank": getattr(config, "q_lora_rank", None),
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_parameters": dict(config.rope_parameters),
        "rope_layout": ROPE_LAYOUT[config.model_type],
        "bf16_cache_bytes_per_token_per_layer": 2 * (config.kv_lora_rank + config.qk_rope_head_dim),
    }
