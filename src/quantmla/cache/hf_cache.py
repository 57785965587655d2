"""``QuantMLACache``: a transformers ``Cache`` that stores MLA's two paths quantized.

Every latent-caching MLA family calls ``past_key_values.update(latent, k_rope, layer_idx)`` with
latent [B, 1, T, d_c] and k_rope [B, 1, T, d_r]. Each MLA layer here quantizes the new tokens
(per its ``CacheFormat``), stores packed codes and group metadata, and returns the *dequantized*
history including the new tokens — so every attention read, prefill included, sees the quantized
cache. With per-token codes and no full-precision window a prefill reads it as token-by-token decode steps
would. Two caches give a decode query a history of its own: a window of W tokens (query t reads tokens (t − W, t]
unquantized, the older ones quantized) and RoPE keys quantized per channel over blocks of tokens (kivi,
rope_channel: a block not yet complete is read quantized over the tokens it holds so far). Within
``QuantMLALayer.expanded_reads()`` (a context manager) an update returns every version of a token some new query
reads — the history after the update, the unquantized tokens, each incomplete block's prefixes — laid out by
``expanded_keys``, for a forward whose attention mask picks each query's own reading (``evaluation.decode_reads``).
Non-MLA layers (e.g. kimi_linear's linear attention) get transformers' own layer classes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ExpandedKeys:
    """The keys an update of tokens start .. end − 1 returns within ``QuantMLALayer.expanded_reads()`` and the queries
    that read each. A decode query i (s = i − W its newest stored token, W the window) reads token j unquantized where
    i − W < j ≤ i; an older token's RoPE key quantized over its whole block of `block` tokens where the block is
    complete by s, else over the block's tokens up to s (or unquantized: KIVI's fp_residual), its content latent
    quantized per token. The keys come in three runs:

    - the history after the update (`end` keys, token j at j): what decode query end − 1 reads;
    - `n_raw` unquantized tokens end − n_raw .. end − 1: the window before the update and the new tokens (none
      without a window);
    - for each query i in start .. end − 2 whose block k = s // block is incomplete (p = s − k·block + 1 < block
      tokens stored), the block's first p tokens read as query i reads them (prefix keys, read by query i alone).

    tokens, lo, hi: [K] int64, each key's token and the first and last query reading it (lo > hi: none);
    prefix_first, prefix_len: [n] int64, each prefix's first token and length, in key order."""

    start: int
    end: int
    n_raw: int
    tokens: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    prefix_first: torch.Tensor
    prefix_len: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.numel()


def _prefix_total(n_queries: int, block: int) -> int:
    """Σ over s = 0 .. n_queries − 1 of (s + 1) mod block: the prefix keys of queries whose newest stored tokens are
    0 .. n_queries − 1."""
    full, rest = divmod(max(n_queries, 0), block)
    return full * block * (block - 1) // 2 + rest * (rest + 1) // 2


def expanded_key_count(start: int, end: int, window: int, block: int) -> int:
    """len(expanded_keys(start, end, window, block)), in closed form."""
    n_raw = end - max(0, start - window) if window else 0
    return end + n_raw + _prefix_total(end - 1 - window, block) - _prefix_total(start - window, block)


def expanded_keys(start: int, end: int, window: int, block: int) -> ExpandedKeys:
    """The key layout of an update of tokens start .. end − 1 into a layer holding `start` tokens as decode steps
    leave them (`window`: full-precision window; `block`: tokens quantized together, 1 for per-token codes)."""
    j = torch.arange(end)
    newest = end - 1 - window  # the newest stored token after the update (< 0: none)
    done = (j // block + 1) * block  # the tokens stored once j's block is complete
    lo = torch.where(done <= newest + 1, done - 1 + window, torch.where(j <= newest, end - 1, end))
    hi = torch.full_like(j, end - 1)
    n_raw = end - max(0, start - window) if window else 0
    raw = torch.arange(end - n_raw, end)
    queries = torch.arange(start, end - 1)
    stored = queries - window
    p = (stored + 1) % block
    queries, stored, p = (t[(stored >= 0) & (p > 0)] for t in (queries, stored, p))
    first = stored - p + 1
    offset = torch.arange(int(p.sum())) - torch.repeat_interleave(torch.cumsum(p, 0) - p, p)
    reader = torch.repeat_interleave(queries, p)
    return ExpandedKeys(start, end, n_raw, torch.cat([j, raw, torch.repeat_interleave(first, p) + offset]),
                        torch.cat([lo, raw, reader]), torch.cat([hi, (raw + window - 1).clamp(max=end - 1), reader]),
                        first, p)


class _PathStore:
    """The stored tokens of one path of one layer: packed codes + metadata, or raw values (16-bit)."""

    per_token_codes = True  # every token's codes stand alone: dropping or adding tokens leaves the others' codes
    block = 1  # tokens quantized together

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
        decode query reads its own newest tokens unquantized; 1 where a store quantizes blocks of tokens together (a
        block is quantized over its tokens so far in a decode, over all of them in one forward). Within
        ``expanded_reads`` a forward reads every token as decode steps do all the same."""
        if not (self.content.per_token_codes and self.rope.per_token_codes):
            return 1
        return self.fp_window or None

    @property
    def can_read_expanded(self) -> bool:
        """Whether ``expanded_reads`` applies: per-token content codes, and a full-precision window or RoPE keys
        quantized over blocks of tokens (without either a plain forward reads as decode steps do)."""
        return self.content.block == 1 and (self.fp_window > 0 or self.rope.block > 1)

    def expanded_keys(self, n_new: int) -> ExpandedKeys:
        """The keys an update of `n_new` tokens returns within ``expanded_reads`` (``expanded_keys`` from the tokens
        held now)."""
        n = self.cumulative_length
        return expanded_keys(n, n + n_new, self.fp_window, self.rope.block)

    @contextmanager
    def expanded_reads(self) -> Iterator[QuantMLALayer]:
        """Within it, an update of T tokens stores them as ever (the layer ends as decode steps leave it) but returns
        along the token axis every version of a token that one of the T new queries reads, laid out by
        ``expanded_keys``: the history after the update, the window and the new tokens unquantized, and the prefixes
        of blocks read before they are complete; latent [B, 1, K, d_c] and RoPE key [B, 1, K, d_r]. A key's content
        latent is its token's as the decode reads it (quantized once the token is stored, whatever the RoPE version)
        and its RoPE key is the stored one, rotated at its token's own position. The forward's attention mask picks
        each query's reading (``evaluation.decode_reads.expanded_mask``). Per-token content codes, and a window or
        RoPE blocks (``can_read_expanded``); the mode ends on exit, on error too."""
        if not self.can_read_expanded:
            raise QuantMLAError(f"cache layer {self.layer_idx}: expanded reads need per-token content codes and a "
                                "full-precision window or RoPE keys quantized over blocks of tokens")
        self._expanded = True
        try:
            yield self
        finally:
            self._expanded = False

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
        self._expanded = False  # expanded_reads

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
        latent [B, 1, T', d_c] and RoPE key [B, 1, T', d_r] (T' tokens so far; within ``expanded_reads`` the K keys of
        ``expanded_keys``)."""
        latent, k_rope = key_states, value_states
        self._check(latent, k_rope)
        if not self.is_initialized:
            self.lazy_initialization(latent, k_rope)
        check_finite(latent, f"content latents of layer {self.layer_idx}")
        check_finite(k_rope, f"RoPE keys of layer {self.layer_idx}")
        keys = self._expansion(latent.shape[2]) if self._expanded else None
        self.cumulative_length += latent.shape[2]
        new_c, new_r = latent[:, 0], k_rope[:, 0]  # [B, T, ·]
        new_r = centre_rope_keys(new_r, self.rope_offset)
        if self.window is not None:
            new_c = torch.cat([self.window[0], new_c], dim=1)
            new_r = torch.cat([self.window[1], new_r], dim=1)
        n_quant = max(0, new_c.shape[1] - self.fp_window)
        prefixes = None
        if keys is not None and len(keys.prefix_len):  # read before the blocks they begin are completed
            prefixes = self.rope.prefix_reads(new_r[:, :n_quant], keys.prefix_first, keys.prefix_len, latent.dtype)
        if n_quant:
            self.content.append(new_c[:, :n_quant])
            self.rope.append(new_r[:, :n_quant])
        self.window = (new_c[:, n_quant:], new_r[:, n_quant:]) if self.fp_window else None
        c, r = self._read(latent.dtype)
        if keys is None:
            return c, r
        parts_c, parts_r = [c], [r]
        if keys.n_raw:  # the window before the update and the new tokens, unquantized
            parts_c.append(new_c.to(c.dtype).unsqueeze(1))
            parts_r.append(new_r.to(r.dtype).unsqueeze(1))
        if prefixes is not None:  # each prefix key with its stored token's content
            parts_c.append(c[:, :, keys.tokens[c.shape[2] + keys.n_raw :].to(c.device)])
            parts_r.append(prefixes.unsqueeze(1))
        return torch.cat(parts_c, dim=2), torch.cat(parts_r, dim=2)

    def _expansion(self, n_new: int) -> ExpandedKeys:
        """The key layout of an update of `n_new` tokens within ``expanded_reads``, for a layer as decode steps leave
        it (its window holding its newest tokens up to the window's length)."""
        held = 0 if self.window is None else self.window[0].shape[1]
        if held != min(self.cumulative_length, self.fp_window):
            raise QuantMLAError(f"cache layer {self.layer_idx}: expanded reads need the newest "
                                f"{min(self.cumulative_length, self.fp_window)} tokens in the window, it holds {held}")
        return self.expanded_keys(n_new)

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
