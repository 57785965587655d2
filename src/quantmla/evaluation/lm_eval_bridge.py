"""lm-evaluation-harness bridge: any lm-eval task on an MLA checkpoint read through QuantMLACache.

Registered as lm-eval model ``quantmla``:

    lm_eval --model quantmla --model_args pretrained=DIR,content_bits=4,rope_bits=4 --tasks ...

or from Python: ``QuantMLALM(pretrained=DIR, content_bits=4, rope_bits=4)``. Every forward
(log-likelihood scoring) and every ``generate`` (generation tasks) gets a fresh quantized cache,
so all attention reads, the prefill included, see the quantized latent and RoPE key (with a full-precision
window, each query its own newest tokens unquantized: ``evaluation.decode_reads``). Without
bits, a calibrated checkpoint's own ``quantization_config`` is used; bits that disagree with it
are an error.
"""

from __future__ import annotations

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from quantmla.cache.config import QuantCacheConfig, resolve_cache_config
from quantmla.cache.hf_cache import QuantMLACache
from quantmla.evaluation.decode_reads import decode_logits


@register_model("quantmla")
class QuantMLALM(HFLM):
    def __init__(
        self,
        pretrained,
        content_bits: int | None = None,
        rope_bits: int | None = None,
        content_group: int = 64,
        rope_group: int = 32,
        fp_window: int = 0,
        **kwargs,
    ):
        kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(pretrained=pretrained, **kwargs)
        requested = None
        if content_bits is not None or rope_bits is not None:
            requested = QuantCacheConfig.of_bits(
                int(content_bits or 16), int(rope_bits or 16), int(content_group), int(rope_group), fp_window=int(fp_window)
            )
        self.quant = resolve_cache_config(self.model.config, requested)

    def new_cache(self) -> QuantMLACache:
        return QuantMLACache(self.model, self.quant)

    def _model_call(self, inps, attn_mask=None, labels=None):
        return decode_logits(self.model, inps, self.new_cache())  # a window is read per query, as decode steps do

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        generation_kwargs["past_key_values"] = self.new_cache()
        return super()._model_generate(context, max_length, stop, **generation_kwargs)
