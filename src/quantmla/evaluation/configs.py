"""The cache configurations a table row evaluates: a name, the content and RoPE path formats, and for
``MIX`` rows the average content bits spread over the layers by the error model (``calibration.bits``).

    named_config("INT4/INT4", 32, 16)   # content INT4/g32, RoPE INT4/g16
    named_config("FP8")                 # fp8_ds_mla, the cache users run on DeepSeek models
    named_config("MIX3/INT4", 32, 16)   # content INT2 or INT4 per layer, 3 bits on average
    named_config("MIX2.5@g64/INT4", 32, 16)  # the same, the INT4 layers' content at group 64
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.layout import CacheFormat, TokenLayout
from quantmla.errors import QuantMLAError
from quantmla.quant.format import BF16, PathFormat

@dataclass(frozen=True)
class CacheConfig:
    """A named cache format. `content` / `rope` per-token formats (BF16 = unquantized). mix: an average
    of that many content bits per value over the MLA layers, each layer storing `content` (the low
    width) or `mix_high`, chosen by the error model (``calibration.bits``); 0 = every layer `content`."""

    name: str
    content: PathFormat = BF16
    rope: PathFormat = BF16
    mix: float = 0.0
    mix_high: PathFormat | None = None

    @property
    def quantized(self) -> bool:
        return self.content.quantized or self.rope.quantized

    def quant(self, method: str = "rtn") -> QuantCacheConfig:
        return QuantCacheConfig(content=self.content, rope=self.rope, method=method)

    def describe(self) -> str:
        d = CacheFormat(self.content, self.rope).describe()
        return d + (f", content {self.mix_high.describe()} in the layers the error model picks for an average of "
                    f"{self.mix:g} content bits" if self.mix else "")

    def bytes_per_token(self, d_c: int, d_r: int, high_share: float | None = None) -> float:
        """Per token per MLA layer (a mix: at `high_share`, see mix_extra_bytes)."""
        layout = TokenLayout(d_c, d_r, CacheFormat(self.content, self.rope))
        return layout.bytes_per_token + self.mix_extra_bytes(d_c, high_share)

    def check_dims(self, d_c: int, where: str = "") -> None:
        """Raise UnsupportedFormatError unless every content format of this config (a mix: both widths)
        can store `d_c` channels (its group divides them)."""
        where = where or self.name
        if self.content.quantized:
            self.content.check_dim(d_c, f"{where}: the content path (--content-group, kv_lora_rank {d_c})")
        if self.mix:
            self.mix_high.check_dim(d_c, f"{where}: the content path of the {self.mix_high.describe()} layers "
                                         f"(kv_lora_rank {d_c})")

    def mix_extra_bytes(self, d_c: int, high_share: float | None = None) -> float:
        """Content bytes per token a mix adds over `content` in every layer (codes and metadata) with `high_share`
        of its layers at mix_high: the layers allocated (``high_share_of``), or None for the nominal share its
        average bits give (an allocation rounds to whole layers); 0 for a uniform config."""
        if not self.mix:
            return 0.0
        lo, hi = (f.code_bytes(d_c) + f.meta_bytes(d_c) for f in (self.content, self.mix_high))
        if high_share is None:
            high_share = (self.mix - self.content.bits) / (self.mix_high.bits - self.content.bits)
        return (hi - lo) * high_share

    def high_share_of(self, quant, slots) -> float | None:
        """The share of MLA `slots` whose content `quant` (a QuantCacheConfig) stores at mix_high; None for a
        uniform config or no quant."""
        if not self.mix or quant is None or not slots:
            return None
        return sum(quant.format_for(s).content != self.content for s in slots) / len(slots)

    def overrides(self, model, calib_ids: torch.Tensor, seed: int = 0) -> dict:
        """The layer overrides of a mix for `model` (the error model on calib_ids); {} for a uniform config."""
        if not self.mix:
            return {}
        from quantmla.calibration.bits import allocate_content_bits, content_sensitivity
        from quantmla.model.spec import load_spec

        self.check_dims(load_spec(model).d_c)  # before the error model's capture
        sens = content_sensitivity(model, calib_ids, self.content, self.mix_high, seed=seed)
        return allocate_content_bits(sens, self.mix, self.content, self.mix_high, self.rope)


def mix_config(avg_bits: float, rope_bits: int, content_group: int = 64, rope_group: int = 32,
               high_group: int | None = None) -> CacheConfig:
    """MIX<avg>/INT<r>: content INT2 or INT4 per layer for an average of avg_bits (between 2 and 4).
    high_group: the INT4 layers' content group; None: content_group, as the INT2 layers. Given, the
    name says it, MIX<avg>@g<high_group>/INT<r> (also when it equals content_group)."""
    from quantmla.calibration.bits import check_widths

    label = f"MIX{avg_bits:g}" + ("" if high_group is None else f"@g{high_group}")
    if high_group is not None:
        check_high_group(high_group, label)
    low, high = PathFormat(2, content_group), PathFormat(4, content_group if high_group is None else high_group)
    check_widths(low, high, avg_bits)
    r = BF16 if rope_bits == 16 else PathFormat(rope_bits, rope_group)
    return CacheConfig(f"{label}/{'BF16' if rope_bits == 16 else f'INT{rope_bits}'}", low, r, avg_bits, high)


def check_high_group(group: int, where: str = "MIX") -> None:
    """A MIX row's own content group for its INT4 layers: at least 4 channels (the CUDA decode kernel reads
    groups of whole multiples of 4 channels); PathFormat requires a power of two, and whether it divides
    the model's latent rank is checked against the model (CacheConfig.check_dims)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 4:
        raise QuantMLAError(f"{where}: the INT4 layers' content group must be at least 4 channels (a power of two: "
                            f"4, 8, 16, 32, 64, ...), got {group!r}")


def int_config(content_bits: int, rope_bits: int, content_group: int = 64, rope_group: int = 32) -> CacheConfig:
    c = BF16 if content_bits == 16 else PathFormat(content_bits, content_group)
    r = BF16 if rope_bits == 16 else PathFormat(rope_bits, rope_group)
    width = lambda b: "BF16" if b == 16 else f"INT{b}"  # noqa: E731
    name = f"{width(content_bits)}/{width(rope_bits)}"
    return CacheConfig(name, c, r)


def _fp8(content_group: int, rope_group: int) -> CacheConfig:
    """fp8_ds_mla (``cache.layout.FP8_DS_MLA``: e4m3 latent, one fp32 scale per 128 channels, bf16 RoPE),
    the cache users run on DeepSeek models; its layout is fixed, whatever the group settings."""
    from quantmla.cache.layout import FP8_DS_MLA

    return CacheConfig("FP8", FP8_DS_MLA.content, FP8_DS_MLA.rope)


# named cache formats beyond CONTENT/ROPE bit pairs: name -> (content_group, rope_group) -> CacheConfig
PRESETS: dict[str, Callable[[int, int], CacheConfig]] = {"BF16": lambda cg, rg: CacheConfig("BF16"), "FP8": _fp8}


def named_config(name: str, content_group: int = 64, rope_group: int = 32) -> CacheConfig:
    """A preset name (PRESETS: "BF16", "FP8"; any case), "<C>/<R>" with C, R in INT2, INT3, INT4, INT8,
    BF16 (content / RoPE), or "MIX<a>/<R>": content INT2 or INT4 per layer for an average of a bits, both
    at `content_group`; "MIX<a>@g<G>/<R>": the INT4 layers' content at group G."""
    up = name.upper()
    if up in PRESETS:
        return PRESETS[up](content_group, rope_group)
    parts = up.split("/")
    if len(parts) == 2 and parts[0].startswith("MIX") and parts[1][3:].isdigit() and parts[1].startswith("INT"):
        avg_text, at, group_text = parts[0][3:].partition("@")
        try:
            avg = float(avg_text)
        except ValueError:
            raise QuantMLAError(f"unknown cache config {name!r}: MIX takes an average of content bits, "
                                "e.g. MIX3/INT4 (MIX2.5@g64/INT4: the INT4 layers' content at group 64)") from None
        high_group = None
        if at:
            g = group_text.removeprefix("G")
            if not g.isdigit():
                raise QuantMLAError(f"unknown cache config {name!r}: after @ give the INT4 layers' content group in "
                                    "channels, e.g. MIX2.5@g64/INT4")
            high_group = int(g)
        return mix_config(avg, int(parts[1][3:]), content_group, rope_group, high_group)
    bits = []
    for p in parts:
        if p == "BF16":
            bits.append(16)
        elif p.startswith("INT") and p[3:].isdigit():
            bits.append(int(p[3:]))
        else:
            bits = []
            break
    if len(parts) != 2 or len(bits) != 2:
        raise QuantMLAError(f"unknown cache config {name!r}: use {', '.join(PRESETS)}, CONTENT/ROPE like INT4/INT4, "
                            "INT2/INT4, BF16/INT4, or MIX<average content bits>/ROPE like MIX3/INT4 (MIX2.5@g64/INT4: "
                            "the INT4 layers' content at group 64)")
    if bits == [16, 16]:  # nothing quantized: the BF16 reference, under its one name
        return PRESETS["BF16"](content_group, rope_group)
    return int_config(bits[0], bits[1], content_group, rope_group)
