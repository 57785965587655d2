"""Function-aligned calibration of MLA's two cache paths (docs/design.md §4) and quantized checkpoints.

Modules: ``options`` (:class:`CalibrationOptions`, shared by ``calibrate``, the streamed run and the
CLI), ``api`` (``calibrate`` and the per-layer fit), ``capture`` / ``content`` / ``rope`` /
``objectives`` / ``fakequant`` (what a fit is made of), ``checkpoint`` (save and load), ``outdir``
(one checkpoint per output directory), ``stream`` and ``distributed`` (layer-streamed runs),
``arguments`` / ``command`` / ``stream_command`` (``quantmla calibrate``).

>>> report = calibrate(model, calib_ids, QuantCacheConfig.of_bits(2, 4), method="quantmla")
>>> save_quantized(model, tokenizer, "out/")
>>> model, tokenizer, quant = load_quantized("out/")
>>> cache = QuantMLACache(model)            # formats from the checkpoint's quantization_config
"""

from quantmla.calibration.api import CalibrationReport, LayerReport, calibrate
from quantmla.calibration.checkpoint import check_cache_config, load_quantized, save_quantized
from quantmla.calibration.options import METHODS, PATHS, CalibrationOptions

__all__ = [
    "METHODS", "PATHS", "CalibrationOptions", "CalibrationReport", "LayerReport", "calibrate",
    "check_cache_config", "load_quantized", "save_quantized",
]
