"""QuantMLA: low-bit dual-path KV caching for Multi-Head Latent Attention models.

MLA caches two things per token and layer: the content latent ``c`` (``kv_lora_rank`` wide) and the
shared RoPE key ``k_R`` (``qk_rope_head_dim`` wide). QuantMLA quantizes the two paths separately.
"""

__version__ = "0.1.0"


def _register_with_transformers() -> None:
    try:
        import quantmla.hf_integration  # noqa: F401
    except ImportError:  # transformers missing or too old: the rest still imports
        pass


_register_with_transformers()
