"""Registers ``quant_method: "quantmla"`` with transformers, so a calibrated checkpoint whose
config.json carries our ``quantization_config`` loads with plain ``from_pretrained``.

The weights of such a checkpoint are ordinary floating-point tensors (the transforms are fused
into them); only the KV cache is quantized, by :class:`quantmla.cache.hf_cache.QuantMLACache`,
which reads the formats back from ``model.config.quantization_config``. The quantizer therefore
leaves loading untouched.
"""

from __future__ import annotations

from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from quantmla.cache.config import QUANT_METHOD


class QuantMLAHFConfig(QuantizationConfigMixin):
    """transformers' view of our quantization_config: a dict carried through unchanged."""

    def __init__(self, **kwargs):
        self.quant_method = QUANT_METHOD
        self._fields = {k: v for k, v in kwargs.items() if k != "quant_method"}

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, **self._fields}

    def to_diff_dict(self) -> dict:
        return self.to_dict()

    def __repr__(self) -> str:
        return f"QuantMLAHFConfig({self.to_dict()})"


class QuantMLAHfQuantizer(HfQuantizer):
    """No-op at load time: the cache, not the weights, is quantized."""

    requires_calibration = False

    def _process_model_before_weight_loading(self, model, **kwargs):
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        return model

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    AUTO_QUANTIZATION_CONFIG_MAPPING.setdefault(QUANT_METHOD, QuantMLAHFConfig)
    AUTO_QUANTIZER_MAPPING.setdefault(QUANT_METHOD, QuantMLAHfQuantizer)


register()
