"""Quantized checkpoints: calibrated weights (transforms fused) + the cache formats in config.json.

``save_quantized(model, tokenizer, out_dir)`` writes safetensors through ``save_pretrained`` with
``quantization_config`` (the :class:`QuantCacheConfig` the transforms were fitted for) in
config.json, plus ``calibration_report.json`` when a report is given. ``load_quantized(path)``
reads it back; ``QuantMLACache(model)`` then takes its formats from the model config. Asking for
formats other than the checkpoint's raises :class:`QuantMLAError`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from quantmla import jsonfile
from quantmla.cache.config import QuantCacheConfig, resolve_cache_config
from quantmla.errors import NotMLAError, QuantMLAError

REPORT_FILE = "calibration_report.json"


def save_quantized(model, tokenizer, out_dir: str | os.PathLike, report=None, dtype: torch.dtype | None = None,
                   overwrite: bool = False) -> Path:
    """Write a calibrated model (and its tokenizer, if given) to `out_dir`; returns the path.

    The model config must carry the quantization_config that :func:`calibrate` set. `dtype`
    casts the saved weights (default: as they are; ``saved_state``): the model itself is left as it is. A directory that already holds a checkpoint is refused unless
    `overwrite`: then the new one is written beside it and swapped in whole (no file of the old one is left)."""
    import quantmla.hf_integration  # noqa: F401  (quant_method "quantmla" known to transformers)

    from quantmla.calibration.outdir import fresh_staging, holds_checkpoint, staging_dir, swap_in

    qc = QuantCacheConfig.from_model_config(model.config)
    if qc is None:
        raise QuantMLAError("the model has no quantization_config: run calibrate(model, ...) before save_quantized")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise QuantMLAError(f"output path {out} exists and is not a directory")
    if holds_checkpoint(out):
        if not overwrite:
            raise QuantMLAError(f"{out} already holds a checkpoint; pass overwrite=True (--overwrite) to replace it, "
                                "or choose another directory")
        save_quantized(model, tokenizer, fresh_staging(out), report=report, dtype=dtype)
        swap_in(staging_dir(out), out)
        return out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True, state_dict=saved_state(model, dtype))
    if dtype is not None:  # the config names the saved weights' dtype (save_pretrained wrote the model's)
        was = model.config.dtype
        model.config.dtype = dtype
        try:
            model.config.save_pretrained(str(out))
        finally:
            model.config.dtype = was
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    if report is not None:
        d = report.to_dict() if hasattr(report, "to_dict") else dict(report)
        jsonfile.write(out / REPORT_FILE, d)
    return out


def saved_state(model, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The model's state dict with its 16- and 32-bit float tensors cast to `dtype` (None: as they are), except those
    transformers keeps in fp32 at that dtype (``_keep_in_fp32_modules_strict`` for fp16 and bf16, and
    ``_keep_in_fp32_modules`` for fp16: e.g. deepseek_v3's router ``e_score_correction_bias``); tensors that share
    storage (tied embeddings) stay shared; 8-bit and integer tensors are left as they are."""
    import re

    state = model.state_dict()
    if dtype is None:
        return state
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) if dtype in (torch.float16, torch.bfloat16) else set()
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    fp32 = re.compile("|".join(map(re.escape, sorted(keep)))) if keep else None
    out, cast = {}, {}
    for name, t in state.items():
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            out[name] = t
            continue
        want = torch.float32 if fp32 is not None and fp32.search(name) else dtype
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), want)
        if key not in cast:
            cast[key] = t.to(want)
        out[name] = cast[key]
    return out


def load_quantized(path: str | os.PathLike, quant: QuantCacheConfig | None = None, *,
                   dtype: torch.dtype | None = None, device: str | torch.device | None = None, **from_pretrained_kwargs):
    """-> (model, tokenizer or None, QuantCacheConfig) of a checkpoint written by save_quantized.

    `quant`: the cache formats you intend to use; they must equal the checkpoint's (the transforms
    were fitted for those), else QuantMLAError. Without it the checkpoint's own formats are used.
    Extra keyword arguments go to ``AutoModelForCausalLM.from_pretrained``."""
    import quantmla.hf_integration  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {p}")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} has no config.json: not a checkpoint directory")
    config = AutoConfig.from_pretrained(str(p))
    if QuantCacheConfig.from_model_config(config) is None:
        raise QuantMLAError(f"{p} has no quantization_config in config.json: it was not written by `quantmla calibrate` "
                            "(load it with from_pretrained and pass a QuantCacheConfig to QuantMLACache instead)")
    qc = resolve_cache_config(config, quant)
    from quantmla.model.spec import load_spec

    qc.check_model(load_spec(str(p)))  # offsets and overrides fit the model; weight files complete (headers)
    kw = dict(from_pretrained_kwargs)
    if dtype is not None:
        kw["dtype"] = dtype
    model = AutoModelForCausalLM.from_pretrained(str(p), **kw).eval()
    if device is not None:
        model.to(device)
    try:
        tok = AutoTokenizer.from_pretrained(str(p))
    except (OSError, ValueError, TypeError):
        tok = None
    from quantmla.model.spec import mla_modules

    if not mla_modules(model):
        raise NotMLAError(f"{p} holds no MLA attention layers")
    return model, tok, qc


def check_cache_config(model, quant: QuantCacheConfig) -> QuantCacheConfig:
    """`quant` if it matches the calibrated model's quantization_config (or the model has none)."""
    return resolve_cache_config(model.config, quant)
