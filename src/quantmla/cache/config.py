"""The cache quantization config: default formats, per-layer overrides, full-precision window.

It is what ``quantmla calibrate`` writes into config.json as ``quantization_config`` and what
loading reads back to set up the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from quantmla.cache.layout import CacheFormat
from quantmla.errors import CacheConfigMismatchError, QuantMLAError
from quantmla.quant.format import PathFormat

QUANT_METHOD = "quantmla"
# the fields of a quantization_config (to_dict writes them; from_dict refuses any other)
_KEYS = frozenset({"quant_method", "content", "rope", "layer_overrides", "fp_window", "method", "rope_offsets",
                   "rope_centring"})


def centre_rope_keys(k_rope: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """The RoPE path's write-time transform, the one place it happens: ``k_R − c`` with a cache slot's
    offset ``c`` [d_r] (``QuantCacheConfig.rope_offset``), computed in fp32 and returned in k_rope's
    dtype; k_rope unchanged when the slot has no offset. Both the transformers cache and the serving
    engine call it before they quantize."""
    if offset is None:
        return k_rope
    return (k_rope.float() - offset.to(k_rope.device)).to(k_rope.dtype)


@dataclass(frozen=True)
class QuantCacheConfig:
    """content / rope: default path formats; layer_overrides: cache slot -> CacheFormat;
    fp_window: the most recent tokens kept unquantized (0: every read is quantized);
    method: how the checkpoint was prepared ("rtn", "hadamard", "quantmla", ...);
    rope_offsets: cache slot -> RoPE key offset c [d_r] (cache channel order), subtracted from every
    RoPE key before it is quantized and never added back: each query's logits all move by q_R·c,
    which softmax ignores, so attention is unchanged while the quantizer no longer spends its range
    on the keys' common (mostly low-frequency) component. Learned by ``quantmla calibrate``; a slot
    mapped to None is stored uncentred (centring did not help it). Empty: no slot is centred.

    On disk (``to_dict``) a centred config lists every fitted slot under ``"rope_offsets"`` (null for
    an uncentred one) and a config without centring says so with ``"rope_centring": false``;
    ``from_dict`` refuses a config with neither, since a runtime that drops the offsets changes the
    model's outputs. :meth:`check_model` refuses offsets that do not fit a model."""

    content: PathFormat = field(default_factory=lambda: PathFormat(4, 64))
    rope: PathFormat = field(default_factory=lambda: PathFormat(4, 32))
    layer_overrides: dict[int, CacheFormat] = field(default_factory=dict)
    fp_window: int = 0
    method: str = "rtn"
    rope_offsets: dict[int, tuple[float, ...] | None] = field(default_factory=dict)

    def __post_init__(self):
        if self.fp_window < 0:
            raise QuantMLAError(f"fp_window must be >= 0, got {self.fp_window}")
        paged = [f for f in (self.content, self.rope, *(x for o in self.layer_overrides.values() for x in (o.content, o.rope)))
                 if f.per_page]
        if paged:
            raise QuantMLAError(
                f"{paged[0].describe()}: this config's caches (the transformers cache, the serving engine) store "
                "per-token groups; RoPE groups per page are the paged layout's format (cache.paged.write_tokens with "
                "page_rope) and the evaluation cache cache.rope_channel.RopeChannelCache (method quantmla-rope-channel)")
        for slot, c in self.rope_offsets.items():
            if c is not None and not all(math.isfinite(x) for x in c):
                raise QuantMLAError(f"rope_offsets of cache slot {slot} hold NaN or Inf values: the quantization_config "
                                    "is corrupt; calibrate the original checkpoint again")
        if not self.centred:  # one form for "no slot centred": the empty dict
            object.__setattr__(self, "rope_offsets", {})

    @property
    def centred(self) -> bool:
        """Whether any cache slot's RoPE keys are centred (stored minus an offset)."""
        return any(c is not None for c in self.rope_offsets.values())

    @property
    def quantizes(self) -> bool:
        """Whether any path of any slot is quantized (False: a 16-bit reference cache)."""
        return any(f.content.quantized or f.rope.quantized
                   for f in (CacheFormat(self.content, self.rope), *self.layer_overrides.values()))

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
        if self.centred:
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
            **({"rope_offsets": {str(k): None if v is None else list(v) for k, v in sorted(self.rope_offsets.items())}}
               if self.centred else {"rope_centring": False}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "QuantCacheConfig":
        """The config of a config.json's ``quantization_config``; every missing or malformed field is
        a QuantMLAError naming it (nothing falls back to a default that changes the outputs)."""
        if not isinstance(d, dict) or d.get("quant_method") != QUANT_METHOD:
            got = d.get("quant_method") if isinstance(d, dict) else d
            raise QuantMLAError(
                f"quantization_config has quant_method={got!r}, not {QUANT_METHOD!r}: "
                "this checkpoint was not prepared by quantmla calibrate"
            )
        where = "quantization_config"
        for k in ("content", "rope"):
            if k not in d:
                raise QuantMLAError(f"{where} has no {k!r} format (the {k} path's bits and group size): config.json is "
                                    "incomplete; calibrate the original checkpoint again, or restore the field, e.g. "
                                    f'"{k}": {{"bits": 4, "group_size": {64 if k == "content" else 32}}}')
        unknown = sorted(set(d) - _KEYS)
        if unknown:
            raise QuantMLAError(f"{where} has unknown fields {unknown} (known: {sorted(_KEYS)}): a misspelt field "
                                "would be read as absent; correct config.json, or calibrate the checkpoint again")
        overrides = d.get("layer_overrides") or {}
        fp_window = d.get("fp_window", 0)
        if not isinstance(fp_window, int) or isinstance(fp_window, bool):
            raise QuantMLAError(f"{where}: fp_window must be an integer number of tokens, got {fp_window!r}")
        return cls(
            content=PathFormat.from_dict(d["content"], f"{where}, content"),
            rope=PathFormat.from_dict(d["rope"], f"{where}, rope"),
            layer_overrides={_slot(k, f"{where}, layer_overrides"): CacheFormat.from_dict(v, f"{where}, layer_overrides[{k}]")
                             for k, v in overrides.items()},
            fp_window=fp_window,
            method=d.get("method", "rtn"),
            rope_offsets=_offsets_from_dict(d),
        )

    def check_model(self, spec) -> None:
        """Raise QuantMLAError unless these formats and offsets fit the model of `spec` (an MLASpec):
        overrides and offsets only for the model's MLA cache slots, offsets of d_r values, and, when
        the RoPE keys are centred, an entry (an offset or null) for every slot whose RoPE path is quantized."""
        slots = set(spec.mla_layers)
        belongs = "the quantization_config belongs to another model (calibrate this model for it)"
        stray = sorted(set(self.layer_overrides) - slots)
        if stray:
            raise QuantMLAError(f"layer overrides for cache slots {stray}, but the model's MLA slots are "
                                f"{sorted(slots)}: {belongs}")
        stray = sorted(set(self.rope_offsets) - slots)
        if stray:
            raise QuantMLAError(f"rope_offsets for cache slots {stray}, but the model's MLA slots are "
                                f"{sorted(slots)}: {belongs}")
        for s in self.rope_offsets:
            self.rope_offset(s, spec.d_r)
        if not self.centred:
            return
        missing = [s for s in sorted(slots) if s not in self.rope_offsets and self.format_for(s).rope.quantized]
        if missing:
            raise QuantMLAError(
                f"rope_offsets has no entry for cache slots {missing} (of {sorted(slots)}): their RoPE keys would be "
                "stored uncentred, unlike what the checkpoint was calibrated for; the quantization_config is "
                "incomplete. Calibrate the original checkpoint again (a slot stored uncentred is listed as null)"
            )

    @classmethod
    def from_model_config(cls, config) -> "QuantCacheConfig | None":
        """The checkpoint's own cache formats if `quantmla calibrate` wrote it, else None: no
        quantization_config, or one of another method (e.g. FP8 weights: that says nothing about the
        cache). ``config``: a transformers config, or config.json as a dict."""
        qc = config.get("quantization_config") if isinstance(config, dict) else \
            getattr(config, "quantization_config", None)
        if qc is None:
            return None
        d = qc if isinstance(qc, dict) else qc.to_dict()
        if d.get("quant_method") != QUANT_METHOD:
            return None
        return cls.from_dict(d)

    def attach(self, model) -> None:
        """Record these formats in ``model.config`` (written to config.json by save_pretrained, read back
        by from_pretrained: importing quantmla registers quant_method "quantmla" with transformers, see
        quantmla/hf_integration.py)."""
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
        return reconcile(stored, requested)
    return requested


def reconcile(stored: QuantCacheConfig, requested: QuantCacheConfig, fix: str | None = None) -> QuantCacheConfig:
    """`requested` for a checkpoint calibrated as `stored`: the same formats (CacheConfigMismatchError
    otherwise), always with the checkpoint's RoPE offsets (taken from `stored` when `requested` has
    none; offsets other than the checkpoint's are refused)."""
    check_matches(stored, requested, fix)
    if requested.centred and requested.rope_offsets != stored.rope_offsets:
        raise CacheConfigMismatchError(
            "the cache config carries RoPE offsets other than the calibrated checkpoint's; leave rope_offsets "
            "empty (the checkpoint's own are used) or use the checkpoint they were calibrated with")
    return replace(requested, rope_offsets=stored.rope_offsets)


def same_formats(a: QuantCacheConfig, b: QuantCacheConfig) -> bool:
    """The same formats on every path of every layer; unquantized (16-bit) paths are equal whatever their other
    fields say (a group size means nothing where nothing is grouped)."""
    def key(q: QuantCacheConfig):
        plain = lambda p: "16-bit" if not p.quantized else p  # noqa: E731
        return (plain(q.content), plain(q.rope),
                {s: (plain(f.content), plain(f.rope)) for s, f in q.layer_overrides.items()})

    return key(a) == key(b)


def check_matches(stored: QuantCacheConfig, requested: QuantCacheConfig, fix: str | None = None) -> None:
    """Raise CacheConfigMismatchError unless `requested` has the formats a checkpoint was calibrated for."""
    if same_formats(stored, requested):
        return
    raise CacheConfigMismatchError(
        f"this checkpoint was calibrated ({stored.method}) for {stored.describe()}, but the cache requested is "
        f"{requested.describe()}; its fused transforms only fit the formats they were calibrated for. "
        + (fix or "Use the checkpoint's own formats (omit the bits), or calibrate the original checkpoint again for these")
    )


def _slot(key, where: str) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        raise QuantMLAError(f"{where}: {key!r} is not a cache slot number") from None


def _offsets_from_dict(d: dict) -> dict[int, tuple[float, ...] | None]:
    """The RoPE offsets of a quantization_config dict (see QuantCacheConfig): present, or explicitly
    absent with ``"rope_centring": false``; anything else is refused."""
    centring, raw = d.get("rope_centring"), d.get("rope_offsets")
    if centring is not None and not isinstance(centring, bool):
        raise QuantMLAError(f"quantization_config: rope_centring must be true or false, got {centring!r}")
    if centring is False:
        if raw:
            raise QuantMLAError('quantization_config says "rope_centring": false but carries rope_offsets: it '
                                "contradicts itself; calibrate the original checkpoint again")
        return {}
    if not raw:
        raise QuantMLAError(
            "quantization_config has no rope_offsets: a checkpoint calibrated with RoPE centring reads wrongly without "
            "them (its RoPE keys would be stored uncentred). Calibrate the original checkpoint again; if it was "
            'calibrated without centring (--no-rope-center, --method hadamard/rtn), add "rope_centring": false')
    if not isinstance(raw, dict):
        raise QuantMLAError(f"quantization_config: rope_offsets must map cache slots to lists of numbers, got {type(raw).__name__}")
    out = {}
    for k, v in raw.items():
        slot = _slot(k, "quantization_config, rope_offsets")
        if v is not None and not (isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                              for x in v)):
            raise QuantMLAError(f"rope_offsets of cache slot {slot} must be a list of numbers (or null), got {v!r}")
        out[slot] = None if v is None else tuple(float(x) for x in v)
    return out
