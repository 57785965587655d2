"""Tiny random-init configs of every latent-caching MLA family, for plumbing tests.

Dims keep MLA's structure (latent, decoupled RoPE key, nope/value heads) at toy sizes:
d_c 32, d_r 16, 4 heads, 2 decoder layers, vocab 128.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig

FAMILIES = (
    "deepseek_v2", "deepseek_v3", "deepseek_v3_rotate_half", "minicpm3", "glm4_moe_lite",
    "longcat_flash", "kimi_linear", "youtu",
)

_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
    n_group=1, topk_group=1, max_position_embeddings=512, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)

_FAMILY = {
    "deepseek_v2": dict(q_lora_rank=None),
    "deepseek_v3": dict(rope_interleave=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    "deepseek_v3_rotate_half": dict(rope_interleave=False),
    "minicpm3": dict(),
    "glm4_moe_lite": dict(rope_interleave=True),
    "longcat_flash": dict(num_layers=1, num_hidden_layers=2, head_dim=16, ffn_hidden_size=96, expert_ffn_hidden_size=32,
                          zero_expert_num=2, moe_topk=2, n_routed_experts=4),
    "kimi_linear": dict(num_hidden_layers=3, q_lora_rank=None, num_local_experts=4,
                        linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3], "head_dim": 16,
                                            "num_heads": 4, "short_conv_kernel_size": 4}),
    "youtu": dict(rope_interleave=True),
}


def tiny_config(family: str, **overrides):
    """A transformers config of `family` at toy size (fp32, eager attention)."""
    if family not in _FAMILY:
        raise KeyError(f"no tiny config for {family!r}; known: {FAMILIES}")
    model_type = "deepseek_v3" if family.startswith("deepseek_v3") else family
    kw = {**_COMMON, **_FAMILY[family], **overrides}
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dtype).eval()
    # random-init norms are all ones; perturb them so transforms and scales are really exercised
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.mul_(1 + 0.3 * torch.randn_like(p)).abs_().add_(0.1)
    return model
