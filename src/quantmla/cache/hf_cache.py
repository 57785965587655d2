"""``QuantMLACache``: a transformers ``Cache`` that stores MLA's two paths quantized.

Every latent-caching MLA family calls ``past_key_values.update(latent, k_rope, layer_idx)`` with
latent [B, 1, T, d_c] and k_rope [B, 1, T, d_r]. Each MLA layer here quantizes the new tokens
(per its ``CacheFormat``), stores packed codes and group metadata, and returns the *dequantized*
history including the new tokens — so every attention read, prefill included, sees the quantized
cache. With per-token codes and no full-precision window a prefill reads it as token-by-token decode steps
would. With a window of W tokens a decode query at position t reads tokens (t − W, t] unquantized and the older
ones quantized; one forward hands every query the same history, so ``QuantMLALayer.doubled_reads()`` (a context
manager, per-token codes only) makes an update of an empty layer return every token twice, quantized then
unquantized, [B, 1, 2T, ·], for a forward whose attention mask picks each query's own reading
(``evaluation.decode_reads``). RoPE blocks quantized over several tokens (kivi, rope_channel) are read as decode
steps a forward a token (``QuantMLALayer.exact_prefill``). Non-MLA layers (e.g. kimi_linear's linear attention)
get transformers' own layer classes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    get_layer_types_and_kwargs,
)

from quantmla.cache.config import QuantCacheConfig, centre_rope_keys, reconcile
from quantmla.cache.layout import CacheFormat, TokenLayout
from quantmla.errors import QuantMLAError
from quantmla.model.spec import MLASpec, load_spec
from quantmla.quant.format import PathFormat
from quantmla.quant.groupwise import Quantized, check_finite, dequantize, quantize


class _PathStore:
    """The stored tokens of one path of one layer: packed codes + metadata, or raw values (16-bit)."""

    per_token_codes = True  # every token's codes stand alone: dropping or adding tokens leaves the others' codes

    def __init__(self, fmt: PathFormat, dim: int):
        self.fmt, self.dim = fmt, dim
        self.codes: torch.Tensor | None = None  # [B, T, code_bytes] uint8, or raw [B, T, dim]
        self.meta: torch.Tensor | None = None  # [B, T, G, fields]
        # keep_read_back: the tokens dequantized so far are kept between reads and extended by the new ones (a
        # forward a token then dequantizes one token, at the cost of a dequantized copy of the history)
        self.keep_read_back = False
        self._read_back: torch.Tensor | None = None

    def append(self, x: torch.Tensor) -> None:
        """x: [B, T, dim]."""
        if self.fmt.quantized:
            q = quantize(x, self.fmt)
            codes, meta = q.codes, q.meta
        else:
            codes, meta = x, None
        self.codes = codes if self.codes is None else torch.cat([self.codes, codes], dim=1)
        if meta is not None:
            self.meta = meta if self.meta is None else torch.cat([self.meta, meta], dim=1)

    def read(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.codes is None:
            return None
        if not self.fmt.quantized:
            return self.codes.to(dtype)
        if not self.keep_read_back:
            return dequantize(Quantized(self.codes, self.meta), self.fmt, self.dim, dtype)
        done = self._read_back
        if done is None or done.dtype != dtype or done.shape[1] > self.codes.shape[1]:
            done = self.codes[:, :0].new_empty((self.codes.shape[0], 0, self.dim), dtype=dtype)
        m = done.shape[1]
        if m < self.codes.shape[1]:  # each token's codes stand alone: only the new ones are dequantized
            new = dequantize(Quantized(self.codes[:, m:], self.meta[:, m:]), self.fmt, self.dim, dtype)
            done = torch.cat([done, new], dim=1) if m else new
        self._read_back = done
        return done

    @property
    def length(self) -> int:
        return 0 if self.codes is None else self.codes.shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.meta) if t is not None)

    def index_batch(self, fn) -> None:
        self.codes = None if self.codes is None else fn(self.codes)
        self.meta = None if self.meta is None else fn(self.meta)
        self._read_back = None

    def crop(self, keep: int) -> None:
        if self.codes is not None:
            self.codes = self.codes[:, :keep]
            self.meta = None if self.meta is None else self.meta[:, :keep]
        self._read_back = None


class QuantMLALayer(CacheLayerMixin):
    """One MLA layer's cache: quantized history plus an optional full-precision recent window."""

    is_sliding = False

    @property
    def is_croppable(self) -> bool:
        """Whether crop() puts the layer back exactly as it was: only without a full-precision window, whose tokens a
        rollback cannot bring back from quantized storage once they have left it, and only where each path's store
        can drop tokens alone (not one that quantizes whole blocks of tokens together: ``per_token_codes``)."""
        return self.fp_window == 0 and self.content.per_token_codes and self.rope.per_token_codes

    def keep_read_back(self) -> None:
        """Keep each path's dequantized history between reads (``_PathStore.keep_read_back``): for reads a forward a
        token (``evaluation.decode_reads``), which then dequantize the new token only."""
        for store in (self.content, self.rope):
            if isinstance(store, _PathStore):
                store.keep_read_back = True

    def exact_prefill(self) -> int | None:
        """How many leading tokens one plain forward over a sequence reads as token-by-token decode steps read them
        (None: any number): every token with per-token codes and no window; the window's length with one, since a
        decode query reads its own newest tokens unquantized (``doubled_reads`` reads a window in one forward all the
        same); 1 where a store quantizes blocks of tokens together (a block is quantized over its tokens so far in a
        decode, over all of them in one forward)."""
        if not (self.content.per_token_codes and self.rope.per_token_codes):
            return 1
        return self.fp_window or None

    @property
    def can_read_doubled(self) -> bool:
        """Whether ``doubled_reads`` applies: per-token codes on both paths and a full-precision window."""
        return self.fp_window > 0 and self.content.per_token_codes and self.rope.per_token_codes

    @contextmanager
    def doubled_reads(self) -> Iterator[QuantMLALayer]:
        """Within it, an update of T tokens into the empty layer stores them as ever (the oldest T − W quantized, the
        newest W in the window) but returns every token twice along the token axis: latent [B, 1, 2T, d_c] and RoPE
        key [B, 1, 2T, d_r], token j quantized at j and unquantized at T + j. Each token's codes stand alone, so its
        quantized value is the one every decode step reads once it has left the window. Slots T − W .. T − 1 of the
        quantized half hold the window's tokens unquantized: a decode query i reads token j quantized only where
        j ≤ i − W ≤ T − 1 − W. The forward's attention mask picks each query's reading
        (``evaluation.decode_reads.doubled_mask``). Per-token codes and a window only (``can_read_doubled``); the mode
        ends on exit, on error too."""
        if not self.can_read_doubled:
            raise QuantMLAError(f"cache layer {self.layer_idx}: doubled reads need per-token codes on both paths and a "
                                "full-precision window")
        self._doubled = True
        try:
            yield self
        finally:
            self._doubled = False

    def __init__(self, fmt: CacheFormat, d_c: int, d_r: int, fp_window: int = 0, layer_idx: int | None = None,
                 rope_offset: torch.Tensor | None = None):
        super().__init__()
        # RoPE key offset [d_r] subtracted before storing (QuantCacheConfig.rope_offsets: softmax ignores it)
        self.rope_offset = None if rope_offset is None else torch.as_tensor(rope_offset, dtype=torch.float32)
        self.layout = TokenLayout(d_c, d_r, fmt)  # validates group sizes against the dims
        self.fmt, self.d_c, self.d_r, self.fp_window, self.layer_idx = fmt, d_c, d_r, fp_window, layer_idx
        self.content = _PathStore(fmt.content, d_c)
        self.rope = _PathStore(fmt.rope, d_r)
        self.window: tuple[torch.Tensor, torch.Tensor] | None = None  # raw recent (latent, k_rope) [B, W, ·]
        self.cumulative_length = 0
        self._doubled = False  # doubled_reads

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _check(self, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
        if latent.dim() != 4 or latent.shape[1] != 1 or latent.shape[-1] != self.d_c or k_rope.shape[-1] != self.d_r:
            raise QuantMLAError(
                f"cache layer {self.layer_idx} was set up for latent [B, 1, T, {self.d_c}] and RoPE key "
                f"[B, 1, T, {self.d_r}] but got {tuple(latent.shape)} and {tuple(k_rope.shape)}: the quantization "
                "config does not match this model (build the cache from the model it is used with)"
            )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states = latent [B, 1, T, d_c], value_states = k_rope [B, 1, T, d_r] (MLA's update call) -> the history
        latent [B, 1, T', d_c] and RoPE key [B, 1, T', d_r] (T' tokens so far; 2T within ``doubled_reads``)."""
        latent, k_rope = key_states, value_states
        self._check(latent, k_rope)
        if not self.is_initialized:
            self.lazy_initialization(latent, k_rope)
        check_finite(latent, f"content latents of layer {self.layer_idx}")
        check_finite(k_rope, f"RoPE keys of layer {self.layer_idx}")
        if self._doubled and self.cumulative_length:
            raise QuantMLAError(f"cache layer {self.layer_idx} holds {self.cumulative_length} tokens: doubled reads "
                                "start from an empty layer")
        self.cumulative_length += latent.shape[2]
        new_c, new_r = latent[:, 0], k_rope[:, 0]  # [B, T, ·]
        new_r = centre_rope_keys(new_r, self.rope_offset)
        if self.window is not None:
            new_c = torch.cat([self.window[0], new_c], dim=1)
            new_r = torch.cat([self.window[1], new_r], dim=1)
        n_quant = max(0, new_c.shape[1] - self.fp_window)
        if n_quant:
            self.content.append(new_c[:, :n_quant])
            self.rope.append(new_r[:, :n_quant])
        self.window = (new_c[:, n_quant:], new_r[:, n_quant:]) if self.fp_window else None
        c, r = self._read(latent.dtype)
        if self._doubled:  # [quantized (the window's slots unquantized) ; unquantized]
            c = torch.cat([c, new_c.to(latent.dtype).unsqueeze(1)], dim=2)
            r = torch.cat([r, new_r.to(latent.dtype).unsqueeze(1)], dim=2)
        return c, r

    def _read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The history in `dtype`: latent [B, 1, T, d_c] and RoPE key [B, 1, T, d_r], stored tokens dequantized, then
        the window's."""
        w_c, w_r = (None, None) if self.window is None else (self.window[0].to(dtype), self.window[1].to(dtype))
        parts_c = [p for p in (self.content.read(dtype), w_c) if p is not None]
        parts_r = [p for p in (self.rope.read(dtype), w_r) if p is not None]
        c = torch.cat(parts_c, dim=1) if len(parts_c) > 1 else parts_c[0]
        r = torch.cat(parts_r, dim=1) if len(parts_r) > 1 else parts_r[0]
        return c.unsqueeze(1), r.unsqueeze(1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        w = 0 if self.window is None else sum(t.numel() * t.element_size() for t in self.window)
        return self.content.nbytes() + self.rope.nbytes() + w

    def _apply_batch(self, fn) -> None:
        self.content.index_batch(fn)
        self.rope.index_batch(fn)
        if self.window is not None:
            self.window = (fn(self.window[0]), fn(self.window[1]))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply_batch(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop tokens from the end as transformers' layers do: a negative count removes that many; a positive one is
        transformers' older ``max_length``, the tokens to keep (none dropped where it is the length or more)."""
        n = int(tokens_to_remove)
        if n > 0:
            n = max(0, self.cumulative_length - n)
        n = abs(n)
        if n == 0:
            return
        keep = max(0, self.cumulative_length - n)
        if self.window is not None:
            w = self.window[0].shape[1]
            drop_w = min(n, w)
            self.window = (self.window[0][:, : w - drop_w], self.window[1][:, : w - drop_w])
        self.content.crop(min(self.content.length, keep))
        self.rope.crop(min(self.rope.length, keep))
        self.cumulative_length = keep

    def reset(self) -> None:
        """Drop every stored token; the format and the RoPE key offset stay."""
        self.__init__(self.fmt, self.d_c, self.d_r, self.fp_window, self.layer_idx, rope_offset=self.rope_offset)

    def offload(self):  # packed storage is small; keep it where it is
        pass

    def prefetch(self):
        pass


class QuantMLACache(Cache):
    """A transformers Cache holding MLA's content latent and RoPE key quantized per layer.

    >>> cache = QuantMLACache(model, QuantCacheConfig.of_bits(4, 4))
    >>> model.generate(**inputs, past_key_values=cache)

    `model_or_config`: a model, a config or a checkpoint path (for the spec). `quant`: a
    QuantCacheConfig; by default the model config's ``quantization_config`` if it has one.

    For a model calibrated by ``quantmla calibrate`` (its config carries our quantization_config), a
    quantized `quant` must have the formats it was calibrated for, and the cache always uses the
    checkpoint's RoPE key offsets (CacheConfigMismatchError otherwise); a 16-bit `quant` (a reference
    read) is taken as it is.
    """

    def __init__(self, model_or_config, quant: QuantCacheConfig | None = None):
        spec: MLASpec = load_spec(model_or_config)
        spec.require_latent_cache()
        config = getattr(model_or_config, "config", model_or_config)
        stored = _stored_config(config)
        if quant is None:
            quant = stored
            if quant is None:
                raise QuantMLAError(
                    "no cache quantization given and the model config has no quantization_config of `quantmla "
                    "calibrate`; pass QuantCacheConfig(...) or load a checkpoint written by `quantmla calibrate`"
                )
        elif stored is not None and quant.quantizes:
            quant = reconcile(stored, quant)
        quant.check_model(spec)
        self.spec, self.quant = spec, quant
        layers: list = []
        layer_types, layer_kwargs = ([], {})
        if hasattr(config, "get_text_config"):
            layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        for i in range(spec.num_cache_layers):
            if i in spec.mla_layers:
                layers.append(QuantMLALayer(quant.format_for(i), spec.d_c, spec.d_r, quant.fp_window, layer_idx=i,
                                            rope_offset=quant.rope_offset(i, spec.d_r)))
            else:
                kind = layer_types[i] if i < len(layer_types) else "full_attention"
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**layer_kwargs))
        super().__init__(layers=layers)

    def mla_layers(self) -> list[QuantMLALayer]:
        return [l for l in self.layers if isinstance(l, QuantMLALayer)]

    def nbytes(self) -> int:
        """Bytes the MLA layers actually store (codes, metadata, full-precision window)."""
        return sum(l.nbytes() for l in self.mla_layers())

    def bytes_per_token(self) -> int:
        """Per-token bytes of the stored format summed over MLA layers (the layout's arithmetic)."""
        return sum(l.layout.bytes_per_token for l in self.mla_layers())


def _stored_config(config) -> QuantCacheConfig | None:
    """The calibrated formats a model config (or checkpoint directory) carries, else None."""
    import os

    if isinstance(config, (str, os.PathLike)):
        import json

        with open(os.path.join(os.fspath(config), "config.json")) as f:
            return QuantCacheConfig.from_model_config(json.load(f))
    if isinstance(config, MLASpec):
        return None
    return QuantCacheConfig.from_model_config(config)
