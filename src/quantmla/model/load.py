"""Finding, checking and loading an MLA checkpoint directory, with a clear error before any weight is read.

``resolve_model(name)`` turns a shipped model's name into its directory, ``check_model_dir(path)`` returns the
directory's :class:`MLASpec` from its config alone, and ``load_model(path)`` returns ``(model, tokenizer)``.
"""

from __future__ import annotations

import os

import torch

from quantmla.errors import QuantMLAError
from quantmla.model.spec import MLASpec, load_spec


def resolve_model(name: str) -> str:
    """A checkpoint directory: ``name`` itself where it is a path, else the shipped reference model of that name
    (``models/<name>``, or under ``QUANTMLA_MODELS``)."""
    if os.path.isdir(name) or os.sep in name or name.startswith("."):
        return name
    from quantmla.corpus.datasets import models_root

    return str(models_root() / name)


def check_model_dir(path: str) -> MLASpec:
    """The spec of a checkpoint directory, or a clear error (missing path, no config, not MLA)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (train one with `quantmla train-reference` "
                                "or pass a checkpoint directory)")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is a file; pass the checkpoint directory that holds config.json")
    spec = load_spec(path)  # FileNotFoundError without config.json, NotMLAError for non-MLA models
    spec.require_latent_cache()
    return spec


def load_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model, tokenizer) from a checkpoint directory, in ``dtype`` on ``device``, eval mode."""
    check_model_dir(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as e:
        raise QuantMLAError(f"{path}: cannot load the weights ({e}); the checkpoint directory must hold them "
                            "(model.safetensors or its shards) next to config.json") from None
    model = model.to(device).eval()
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise QuantMLAError(f"{path}: no usable tokenizer ({e}); the checkpoint directory must hold its tokenizer files") from None
    return model, tok
