"""The MLA spec: what any transformers MLA checkpoint caches, read from its config or model.

Notation (docs/design.md §1): latent rank d_c (``kv_lora_rank``), RoPE dim d_r (``qk_rope_head_dim``),
nope dim d_n, value dim d_v, n_h heads. The cache of every latent-caching family receives
``past_key_values.update(latent [B, 1, T, d_c], k_rope [B, 1, T, d_r], layer_idx)``.

RoPE pair layouts: ``rotate_half`` pairs channels (j, j + d_r/2); ``interleaved`` pairs (2j, 2j+1);
``none`` applies no rotation (kimi_linear's MLA layers are NoPE). The *weight* layout is how the
RoPE columns of ``kv_a_proj_with_mqa`` / the query projection pair up; the *cache* layout is how the
cached, rotated ``k_rope`` pairs up (``rope_interleave=True`` families permute interleaved weight
columns into rotate-half order before rotating).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

import torch

from quantmla.errors import NotMLAError, QuantMLAError


def pair_channels(d_r: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices (a_j, b_j), int64 [d_r/2] each, of RoPE frequency pair j = 0 .. d_r/2 − 1 in
    `layout`: "interleaved" pairs (2j, 2j+1), "rotate_half" pairs (j, j + d_r/2); "none" (no rotation)
    takes rotate_half's pairing, as any fixed pairing commutes with the identity. A rotation by angle
    φ_j maps (a, b) -> (a cos φ_j − b sin φ_j, a sin φ_j + b cos φ_j)."""
    if d_r % 2:
        raise QuantMLAError(f"the RoPE dim must be even, got {d_r}")
    j = torch.arange(d_r // 2)
    if layout == "interleaved":
        return 2 * j, 2 * j + 1
    if layout in ("rotate_half", "none"):
        return j, j + d_r // 2
    raise QuantMLAError(f"unknown RoPE pair layout {layout!r}; use 'rotate_half', 'interleaved' or 'none'")

# Families whose transformers implementation caches (latent, rope key) through Cache.update.
LATENT_CACHING = {
    "deepseek_v2", "deepseek_v3", "minicpm3", "glm4_moe_lite", "longcat_flash", "kimi_linear",
    "mistral4", "youtu", "axk1",
}
# Families with MLA weights whose transformers implementation caches expanded per-head K/V
# (sparse-attention indexers): the spec reads, but a latent cache cannot be attached.
EXPANDED_CACHING = {"deepseek_v32", "axk2", "glm5_next", "glm_moe_dsa", "hy_v4"}


class ExpandedCacheFamilyError(QuantMLAError):
    """The family has MLA weights but transformers caches expanded keys/values for it."""


@dataclass(frozen=True)
class MLASpec:
    family: str
    num_hidden_layers: int
    num_cache_layers: int  # cache slots; longcat_flash has two MLA blocks per decoder layer
    mla_layers: tuple[int, ...]  # cache slots that hold (latent, rope key)
    hidden_size: int
    num_heads: int
    d_c: int
    d_r: int
    d_n: int
    d_v: int
    q_lora_rank: int | None
    rope_weight_layout: str
    rope_cache_layout: str
    softmax_scale: float  # includes the YaRN mscale² factor where the family applies it
    latent_scale: float = 1.0  # longcat_flash multiplies the normed latent by sqrt(hidden / d_c)
    query_scale: float = 1.0  # longcat_flash multiplies the query by sqrt(hidden / q_lora_rank)
    caches_latent: bool = True
    max_positions: int | None = None  # config.max_position_embeddings: the context the model is built for
    # mistral4 with llama_4_scaling_beta β: the query at position p is scaled by 1 + β·log(1 + ⌊p / this⌋), so from
    # this many tokens on (``MLAView.position_query_scale``; None: no such scaling)
    scaled_query_from: int | None = None
    query_scale_beta: float = 0.0

    @property
    def num_pairs(self) -> int:
        return self.d_r // 2

    def pair_index(self, layout: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`pair_channels` of this model's RoPE dim in `layout` (default: the cache layout)."""
        return pair_channels(self.d_r, layout or self.rope_cache_layout)

    def bytes_per_token_bf16(self) -> int:
        return (self.d_c + self.d_r) * 2

    def to_dict(self) -> dict:
        return asdict(self)

    def require_latent_cache(self) -> None:
        if not self.caches_latent:
            raise ExpandedCacheFamilyError(
                f"transformers' {self.family} implementation caches expanded per-head keys and values "
                "(its sparse-attention indexer needs them), not the (latent, RoPE key) pair; QuantMLA's cache "
                "cannot be attached. Families with a latent cache: " + ", ".join(sorted(LATENT_CACHING))
            )


def _yarn_scale(config, qk_head_dim: int) -> float:
    scale = qk_head_dim**-0.5
    rp = getattr(config, "rope_parameters", None) or {}
    if rp.get("rope_type", "default") not in ("default", None):
        m_all = rp.get("mscale_all_dim", 0)
        factor = rp.get("factor", 1.0)
        if m_all and factor > 1:
            m = 0.1 * m_all * math.log(factor) + 1.0
            scale *= m * m
    return scale


ALWAYS_INTERLEAVED = ("longcat_flash", "deepseek_v32", "glm_moe_dsa", "axk2")
"""Families whose attention always rotates interleaved weight pairs (whatever their config says)."""
READS_ROPE_INTERLEAVE = ("deepseek_v3", "glm4_moe_lite", "mistral4", "youtu", "axk1")
"""Families whose attention rotates interleaved pairs where ``config.rope_interleave`` is set; the others (minicpm3,
hy_v4, glm5_next, ...) rotate halves whatever the config says."""


def _rope_layouts(family: str, config) -> tuple[str, str]:
    """(weight layout, cache layout) of the RoPE pairs, as the family's attention code rotates them."""
    if family == "deepseek_v2":
        return "interleaved", "interleaved"  # complex multiply on (2j, 2j+1)
    if family == "kimi_linear":
        return "none", "none"
    if family in ALWAYS_INTERLEAVED:
        return "interleaved", "rotate_half"
    if family in READS_ROPE_INTERLEAVE and getattr(config, "rope_interleave", None) is True:
        return "interleaved", "rotate_half"
    return "rotate_half", "rotate_half"


def is_mla_attention(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm"))


def mla_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Cache slot (the module's ``layer_idx``) -> MLA attention module."""
    found = {}
    for _, m in model.named_modules():
        if is_mla_attention(m):
            found[int(m.layer_idx)] = m
    return dict(sorted(found.items()))


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def spec_from_model(model: torch.nn.Module) -> MLASpec:
    config = _text_config(model.config)
    family = getattr(config, "model_type", type(model).__name__)
    mods = mla_modules(model)
    if not mods:
        missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim") if getattr(config, k, None) is None]
        why = f"its config has no {', '.join(missing)}" if missing else "no attention module has kv_a_proj_with_mqa/kv_b_proj"
        raise NotMLAError(
            f"{family!r} is not a Multi-Head Latent Attention model: {why}. QuantMLA needs MLA attention "
            "(a compressed latent and a decoupled RoPE key), as in deepseek_v2/v3, kimi, minicpm3, glm4_moe_lite, longcat_flash"
        )
    m = next(iter(mods.values()))
    d_n = int(config.qk_nope_head_dim)
    d_r = int(config.qk_rope_head_dim)
    w_layout, c_layout = _rope_layouts(family, config)
    scale = float(getattr(m, "scaling", _yarn_scale(config, d_n + d_r)))
    n_cache = max(len(getattr(config, "layer_types", None) or []), int(config.num_hidden_layers))
    n_cache = max(n_cache, max(mods) + 1)
    return MLASpec(
        family=family,
        num_hidden_layers=int(config.num_hidden_layers),
        num_cache_layers=n_cache,
        mla_layers=tuple(mods),
        hidden_size=int(config.hidden_size),
        num_heads=int(getattr(m, "num_heads", config.num_attention_heads)),
        d_c=int(config.kv_lora_rank),
        d_r=d_r,
        d_n=d_n,
        d_v=int(config.v_head_dim),
        q_lora_rank=getattr(config, "q_lora_rank", None),
        rope_weight_layout=w_layout,
        rope_cache_layout=c_layout,
        softmax_scale=scale,
        latent_scale=float(getattr(m, "mla_scale_kv_lora", 1.0)),
        query_scale=float(getattr(m, "mla_scale_q_lora", 1.0)),
        caches_latent=family not in EXPANDED_CACHING,
        max_positions=getattr(config, "max_position_embeddings", None),
        **_query_scaling(config),
    )


def _query_scaling(config) -> dict:
    """mistral4's position-dependent query scaling: where it starts (its original_max_position_embeddings) and its
    β (llama_4_scaling_beta); nothing where the config has no β."""
    rp = getattr(config, "rope_parameters", None) or {}
    beta = rp.get("llama_4_scaling_beta")
    if not beta or getattr(config, "model_type", None) != "mistral4":  # the one MLA family whose module applies it
        return {}
    start = int(rp.get("original_max_position_embeddings") or getattr(config, "max_position_embeddings"))
    return {"scaled_query_from": start, "query_scale_beta": float(beta)}


def spec_from_config(config) -> MLASpec:
    """Spec of a config without weights: the model is built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    tc = _text_config(config)
    if getattr(tc, "kv_lora_rank", None) is None or getattr(tc, "qk_rope_head_dim", None) is None:
        family = getattr(tc, "model_type", "?")
        raise NotMLAError(
            f"{family!r} is not a Multi-Head Latent Attention model: its config has no kv_lora_rank/qk_rope_head_dim. "
            "QuantMLA needs MLA attention (deepseek_v2/v3, kimi, minicpm3, glm4_moe_lite, longcat_flash, ...)"
        )
    from transformers import AutoModel

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # families without a causal-LM head class (e.g. mistral4)
            model = AutoModel.from_config(config)
    return spec_from_model(model)


def _require_mla_fields(cfg_file: str, raw: dict) -> None:
    """A latent-attention family's config.json must state kv_lora_rank and qk_rope_head_dim itself:
    transformers would fill in its own defaults (kv_lora_rank 512), which need not be this model's."""
    family = raw.get("model_type", "?")
    if family not in LATENT_CACHING | EXPANDED_CACHING:
        return  # other families: spec_from_config decides from the parsed config
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim") if text.get(k, raw.get(k)) is None]
    if missing:
        raise NotMLAError(
            f"{cfg_file} (model_type {family!r}) has no {' or '.join(missing)}: without it this is not a Multi-Head "
            "Latent Attention config (transformers would fill in its own default, not this model's); add the "
            "checkpoint's real value to config.json"
        )


def load_spec(path_or_obj) -> MLASpec:
    """Spec of a model, a config, or a checkpoint directory (reads config.json, and the headers of the
    safetensors weight files present: a truncated one is an error here, before any command's work)."""
    if isinstance(path_or_obj, MLASpec):
        return path_or_obj
    if isinstance(path_or_obj, torch.nn.Module):
        return spec_from_model(path_or_obj)
    if isinstance(path_or_obj, (str, os.PathLike)):
        path = os.fspath(path_or_obj)
        cfg_file = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"model path {path!r} does not exist (no config.json to read); pass a checkpoint "
                                    "directory holding config.json, e.g. models/qmla-ref-deepseek-v3")
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"{path!r} is not a checkpoint directory: no config.json found there; pass the "
                                    "directory that holds the model's config.json")
        from transformers import AutoConfig

        from quantmla.checks import check_weight_files

        try:
            with open(cfg_file) as f:
                raw = json.load(f)
        except ValueError as e:
            raise NotMLAError(f"{cfg_file} is not valid JSON ({e}); restore the checkpoint's config.json") from None
        if not isinstance(raw, dict):
            raise NotMLAError(f"{cfg_file} holds no JSON object; restore the checkpoint's config.json")
        _require_mla_fields(cfg_file, raw)
        check_weight_files(path)
        try:
            config = AutoConfig.from_pretrained(path)
        except (ValueError, KeyError) as e:
            raise NotMLAError(f"cannot read {cfg_file} (model_type {raw.get('model_type', '?')!r}) with transformers: "
                              f"{e}") from None
        return spec_from_config(config)
    return spec_from_config(path_or_obj)
