"""Reference implementations in fp32/fp64 (oracles for the kernels)."""

from quantmla.reference.absorbed import absorbed_attention
from quantmla.reference.prefill import prefill_attention

__all__ = ["absorbed_attention", "prefill_attention"]
