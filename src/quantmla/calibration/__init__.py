"""Function-aligned calibration of MLA's two cache paths (docs/design.md §4) and quantized checkpoints.

>>> report = calibrate(model, calib_ids, QuantCacheConfig.of_bits(2, 4), method="quantmla")
>>> save_quantized(model, tokenizer, "out/")
>>> model, tokenizer, quant = load_quantized("out/")
>>> cache = QuantMLACache(model)            # formats from the checkpoint's quantization_config
"""

from quantmla.calibration.api import METHODS, PATHS, CalibrationReport, LayerReport, calibrate
from quantmla.calibration.checkpoint import check_cache_config, load_quantized, save_quantized

__all__ = [
    "METHODS", "PATHS", "CalibrationReport", "LayerReport", "calibrate",
    "check_cache_config", "load_quantized", "save_quantized",
]
