"""Synthetic sharded checkpoints with random weights, written layer by layer (peak memory: one layer):
what the streamed-calibration tests and the calibration scaling benchmark calibrate."""

from __future__ import annotations

import os

import torch

from quantmla.calibration.stream.files import INDEX_NAME, ShardEntry, atomic_write_json, write_safetensors_streamed
from quantmla.calibration.stream.source import EXPERT_RE


def _split_experts(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fused expert parameter -> per-expert tensors in transformers' saved (checkpoint) naming."""
    m = EXPERT_RE.match(name)
    if not m or t.dim() != 3:
        return {name: t}
    out = {}
    for e in range(t.shape[0]):
        if m["proj"] == "gate_up_proj":
            half = t.shape[1] // 2
            out[f"{m['pre']}.{e}.gate_proj.weight"] = t[e, :half].clone()
            out[f"{m['pre']}.{e}.up_proj.weight"] = t[e, half:].clone()
        else:
            out[f"{m['pre']}.{e}.down_proj.weight"] = t[e].clone()
    return out


@torch.no_grad()
def _random_init(module: torch.nn.Module, g: torch.Generator) -> None:
    for name, p in sorted(module.named_parameters()) + sorted(module.named_buffers()):
        if not p.is_floating_point():
            continue
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and p.dim() == 1:
            p.copy_((1 + 0.3 * torch.randn(p.shape, generator=g)).abs() + 0.1)
        elif p.dim() >= 2:
            fan_in = p.shape[-1]
            std = 1.0 if "embed" in name else fan_in ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)
        elif leaf in ("inv_freq", "original_inv_freq", "embed_scale"):
            continue
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def write_random_checkpoint(config, path: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """A sharded safetensors checkpoint of `config` with random weights, one shard per decoder
    layer plus one for the rest, written layer by layer (peak memory: one layer). Experts are
    stored per expert, as transformers saves them. Returns {"bytes", "max_layer_bytes"}."""
    from transformers import AutoModelForCausalLM

    os.makedirs(path, exist_ok=True)
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = model.base_model
    per_expert = any("mlp.experts.*.gate_proj.weight" in (getattr(c, "source_patterns", None) or [])
                     for c in get_checkpoint_conversion_mapping(config.model_type) or [])
    prefix = model.base_model_prefix + "."
    weight_map, total, max_layer = {}, 0, 0

    def dump(module, mprefix, file, g):
        nonlocal total
        module.to_empty(device="cpu")
        _random_init(module, g)
        sd = {}
        for k, v in module.state_dict().items():
            if k.rsplit(".", 1)[-1] in module_nonpersistent(module):
                continue
            for n, t in (_split_experts(mprefix + k, v) if per_expert else {mprefix + k: v}).items():
                sd[n] = t.to(dtype) if t.is_floating_point() else t
        entries = [ShardEntry(n, t.dtype, tuple(t.shape), lambda t=t: t) for n, t in sd.items()]
        write_safetensors_streamed(os.path.join(path, file), entries)
        module.to_empty(device="meta")
        nb = sum(t.numel() * t.element_size() for t in sd.values())
        total += nb
        for n in sd:
            weight_map[n] = file
        return nb

    for i, layer in enumerate(base.layers):
        g = torch.Generator().manual_seed(seed * 100003 + i)
        max_layer = max(max_layer, dump(layer, f"{prefix}layers.{i}.", f"model-layer-{i:05d}.safetensors", g))
    g = torch.Generator().manual_seed(seed * 100003 + 99991)
    rest = torch.nn.ModuleDict()
    for name, child in base.named_children():
        if name != "layers" and any(True for _ in child.parameters()):
            rest[name] = child
    extra = {f"{prefix}{k}": v for k, v in rest.named_children()}
    if model.get_output_embeddings() is not None and not getattr(config, "tie_word_embeddings", False):
        extra["lm_head"] = model.get_output_embeddings()
    holder = torch.nn.ModuleDict({k.replace(".", "__"): v for k, v in extra.items()})
    holder.to_empty(device="cpu")
    _random_init(holder, g)
    sd = {}
    for k, v in holder.state_dict().items():
        mod_key, rest_key = k.split(".", 1)
        if rest_key in ("inv_freq", "original_inv_freq", "embed_scale"):
            continue
        sd[mod_key.replace("__", ".") + "." + rest_key] = v.to(dtype) if v.is_floating_point() else v
    write_safetensors_streamed(os.path.join(path, "model-extra.safetensors"),
                               [ShardEntry(n, t.dtype, tuple(t.shape), lambda t=t: t) for n, t in sd.items()])
    for n in sd:
        weight_map[n] = "model-extra.safetensors"
    total += sum(t.numel() * t.element_size() for t in sd.values())
    holder.to_empty(device="meta")
    config.save_pretrained(path)
    atomic_write_json(os.path.join(path, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    return {"bytes": total, "max_layer_bytes": max_layer}


def module_nonpersistent(module: torch.nn.Module) -> set[str]:
    out = set()
    for m in module.modules():
        out |= set(m._non_persistent_buffers_set)
    return out
