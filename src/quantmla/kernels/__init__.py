"""Low-bit MLA kernels (Triton) over the paged quantized cache: append, decode, read-back, prefill.

Public API (see ``api``): ``get_mla_metadata``, ``mla_decode_with_kvcache``, ``append_to_pages``,
``read_from_pages``, ``mla_prefill_attention``.
Triton is imported only when a kernel runs on CUDA tensors or under ``TRITON_INTERPRET=1``.
"""

from quantmla.kernels.api import (
    DecodeConfig,
    MLAMetadata,
    PrefillConfig,
    append_to_pages,
    check_layout_supported,
    decode_bytes,
    decode_flops,
    default_config,
    get_mla_metadata,
    mla_decode_with_kvcache,
    mla_prefill_attention,
    read_from_pages,
)

__all__ = [
    "DecodeConfig",
    "MLAMetadata",
    "PrefillConfig",
    "append_to_pages",
    "check_layout_supported",
    "decode_bytes",
    "decode_flops",
    "default_config",
    "get_mla_metadata",
    "mla_decode_with_kvcache",
    "mla_prefill_attention",
    "read_from_pages",
]
