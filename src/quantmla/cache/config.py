"""The cache quantization config: default formats, per-layer overrides, full-precision window.

It is what ``quantmla calibrate`` writes into config.json as ``quantization_config`` and what
loading reads back to set up the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from quantmla.cache.layout import CacheFormat
from quantmla.errors import CacheConfigMismatchError, QuantMLAError
from quantmla.quant.format import PathFormat

QUANT_METHOD = "quantmla"


@dataclass(frozen=True)
class QuantCacheConfig:
    """content / rope: default path formats; layer_overrides: cache slot -> CacheFormat;
    fp_window: the most recent tokens kept unquantized (0: every read is quantized);
    method: how the checkpoint was prepared ("rtn", "hadamard", "quantmla", ...);
    rope_offsets: cache slot -> RoPE key offset c [d_r] (cache channel order), subtracted from every
    RoPE key before it is quantized and never added back: each query's logits all move by q_R·c,
    which softmax ignores, so attention is unchanged while the quantizer no longer spends its range
    on the keys' common (mostly low-frequency) component. Learned by ``quantmla calibrate``;
    rope_centring: False marks a calibration fitted on the keys as they are, without offsets (for
    runtimes that ignore rope_offsets; written as ``"rope_centring": false``)."""

    content: PathFormat = field(default_factory=lambda: PathFormat(4, 64))
    rope: PathFormat = field(default_factory=lambda: PathFormat(4, 32))
    layer_overrides: dict[int, CacheFormat] = field(default_factory=dict)
    fp_window: int = 0
    method: str = "rtn"
    rope_offsets: dict[int, tuple[float, ...]] = field(default_factory=dict)
    rope_centring: bool = True

    def __post_init__(self):
        if self.fp_window < 0:
            raise QuantMLAError(f"fp_window must be >= 0, got {self.fp_window}")

    @classmethod
    def of_bits(cls, content_bits: int, rope_bits: int, content_group: int = 64, rope_group: int = 32, **kw):
        """Affine integer formats (16 bits: unquantized)."""
        return cls(content=PathFormat(content_bits, content_group), rope=PathFormat(rope_bits, rope_group), **kw)

    def rope_offset(self, layer: int, d_r: int | None = None):
        """The RoPE key offset of a cache slot as a float32 tensor [d_r], or None."""
        c = self.rope_offsets.get(layer)
        if c is None:
            return None
        import torch

        if d_r is not None and len(c) != d_r:
            raise QuantMLAError(f"rope_offsets of cache slot {layer} has {len(c)} values but the RoPE key has {d_r} "
                                "channels: the quantization_config belongs to another model")
        return torch.tensor(c, dtype=torch.float32)

    def format_for(self, layer: int) -> CacheFormat:
        return self.layer_overrides.get(layer, CacheFormat(self.content, self.rope))

    def describe(self) -> str:
        s = CacheFormat(self.content, self.rope).describe()
        if self.layer_overrides:
            s += f" ({len(self.layer_overrides)} layer overrides)"
        if self.fp_window:
            s += f", last {self.fp_window} tokens unquantized"
        if self.rope_offsets:
            s += ", RoPE keys centred"
        return s

    def to_dict(self) -> dict:
        return {
            "quant_method": QUANT_METHOD,
            "content": self.content.to_dict(),
            "rope": self.rope.to_dict(),
            "layer_overrides": {str(k): v.to_dict() for k, v in self.layer_overrides.items()},
            "fp_window": self.fp_window,
            "method": self.method,
            **({"rope_offsets": {str(k): list(v) for k, v in self.rope_offsets.items()}} if self.rope_offsets else {}),
            **({} if self.rope_centring else {"rope_centring": False}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "QuantCacheConfig":
        if d.get("quant_method") != QUANT_METHOD:
            raise QuantMLAError(
                f"quantization_config has quant_method={d.get('quant_method')!r}, not {QUANT_METHOD!r}: "
                "this checkpoint was not prepared by quantmla calibrate"
            )
        return cls(
            content=PathFormat.from_dict(d["content"]),
            rope=PathFormat.from_dict(d["rope"]),
            layer_overrides={int(k): CacheFormat.from_dict(v) for k, v in d.get("layer_overrides", {}).items()},
            fp_window=int(d.get("fp_window", 0)),
            method=d.get("method", "rtn"),
            rope_offsets={int(k): tuple(float(x) for x in v) for k, v in d.get("rope_offsets", {}).items()},
            rope_centring=d.get("rope_centring", True) is not False,
        )

    @classmethod
    def from_model_config(cls, config) -> "QuantCacheConfig | None":
        qc = getattr(config, "quantization_config", None)
        if qc is None:
            return None
        return cls.from_dict(qc if isinstance(qc, dict) else qc.to_dict())

    def attach(self, model) -> None:
        """Record these formats in ``model.config`` (written to config.json by save_pretrained,
        read back by from_pretrained once quantmla is imported)."""
        import quantmla.hf_integration  # noqa: F401  (registers quant_method "quantmla")

        model.config.quantization_config = self.to_dict()


def resolve_cache_config(model_config, requested: QuantCacheConfig | None) -> QuantCacheConfig:
    """The cache config to serve `model_config` with.

    A checkpoint written by ``quantmla calibrate`` carries the formats its transforms were fitted
    for; asking for different formats is an error (the transforms would not match). A plain
    checkpoint takes whatever is requested (round-to-nearest on the untransformed weights).
    """
    stored = QuantCacheConfig.from_model_config(model_config)
    if requested is None:
        if stored is None:
            raise QuantMLAError(
                "no cache formats requested and the checkpoint has no quantization_config; "
                "give content/rope bits, or use a checkpoint written by `quantmla calibrate`"
            )
        return stored
    if stored is not None:
        check_matches(stored, requested)
        if stored.rope_offsets and not requested.rope_offsets:  # calibrated offsets come with the checkpoint
            return replace(requested, rope_offsets=stored.rope_offsets)
    return requested


def stored_cache_config(model_config) -> QuantCacheConfig | None:
    """The checkpoint's own cache formats if `quantmla calibrate` wrote it, else None (also for a
    quantization_config of another method, e.g. FP8 weights: that says nothing about the cache)."""
    qc = model_config.get("quantization_config") if isinstance(model_config, dict) else \
        getattr(model_config, "quantization_config", None)
    if qc is None:
        return None
    d = qc if isinstance(qc, dict) else qc.to_dict()
    if d.get("quant_method") != QUANT_METHOD:
        return None
    return QuantCacheConfig.from_dict(d)


def same_formats(a: QuantCacheConfig, b: QuantCacheConfig) -> bool:
    return (a.content, a.rope, a.layer_overrides) == (b.content, b.rope, b.layer_overrides)


def check_matches(stored: QuantCacheConfig, requested: QuantCacheConfig, fix: str | None = None) -> None:
    """Raise CacheConfigMismatchError unless `requested` has the formats a checkpoint was calibrated for."""
    if same_formats(stored, requested):
        return
    raise CacheConfigMismatchError(
        f"this checkpoint was calibrated ({stored.method}) for {stored.describe()}, but the cache requested is "
        f"{requested.describe()}; its fused transforms only fit the formats they were calibrated for. "
        + (fix or "Use the checkpoint's own formats (omit the bits), or calibrate the original checkpoint again for these")
    )
