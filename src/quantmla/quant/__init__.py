"""Quantizers: path formats, per-token channel-group quantization, bit packing."""

from quantmla.quant.format import BF16, PathFormat
from quantmla.quant.groupwise import Quantized, dequantize, fake_quant, quantize, quantize_dequantize
from quantmla.quant.packing import pack, unpack

__all__ = [
    "BF16", "PathFormat", "Quantized", "quantize", "dequantize", "quantize_dequantize", "fake_quant", "pack", "unpack",
]
