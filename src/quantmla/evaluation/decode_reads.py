"""Logits of a token sequence with every query reading the cache as token-by-token decode steps would.

A quantized cache hands each forward one key history. With per-token codes and no full-precision window that
history is what every query of a prefill would read in a decode, so one forward gives every position's decode
logits. Two caches differ:

- a full-precision window of W tokens: a decode query at position t reads tokens (t − W, t] unquantized and the
  older ones quantized, a history of its own; one plain forward over T > W tokens keeps only the last W of all T
  unquantized, so its earlier queries would read their own recent tokens quantized;
- RoPE keys quantized per channel over blocks of tokens (KIVI-style, per page): a decode reads a block quantized
  over the tokens it has so far; one forward would read it quantized over all of them, later tokens included.

A window over per-token codes is read in one forward over doubled keys: within ``QuantMLALayer.doubled_reads()``
each layer of an empty cache returns every token twice, quantized then unquantized ([B, 1, 2T, ·]; the newest W,
which no query reads quantized, stand unquantized in both halves), and the forward's 4D additive attention mask
(``doubled_mask``, [B, 1, T, 2T]) lets query i read token j quantized where j ≤ i − W and unquantized where
i − W < j ≤ i: each query's decode reading, with RoPE positions 0..T − 1 as usual. The layers store the tokens as
ever, so the cache ends as decode steps leave it. transformers hands a 4D mask to the attention
as it is; eager and sdpa attention add it to the scores (deepseek_v2, deepseek_v3, minicpm3, glm4_moe_lite,
longcat_flash, youtu alike).

Other caches (blocked RoPE keys, a non-MLA layer, a cache already holding tokens, an attention that takes no
additive mask) say how many leading tokens one forward reads exactly (``QuantMLALayer.exact_prefill``): a sequence
is prefilled that far in one forward and decoded a token a forward after, so the later positions' hidden states, and
with them the keys of the layers above, are the decode's too.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch


def _mla_layers(cache) -> list:
    return cache.mla_layers() if hasattr(cache, "mla_layers") else []


DECODE_BATCH = 16  # sequences decoded together where a cache is read a forward a token (their cost is the steps')

MASKED_ATTENTION = ("eager", "sdpa")  # attention implementations that add a 4D float mask to the scores


def reads_doubled(cache, model=None) -> bool:
    """Whether decode_logits reads `cache` in one forward over doubled keys: every layer an empty QuantMLALayer with
    per-token codes and one full-precision window (``QuantMLALayer.can_read_doubled``), and, given `model`, an
    attention implementation that adds a 4D mask to the scores (``MASKED_ATTENTION``)."""
    layers = _mla_layers(cache)
    if not layers or len(layers) != len(getattr(cache, "layers", ())):
        return False
    if model is not None and getattr(model.config, "_attn_implementation", None) not in MASKED_ATTENTION:
        return False
    return (all(getattr(layer, "can_read_doubled", False) and layer.get_seq_length() == 0 for layer in layers)
            and len({layer.fp_window for layer in layers}) == 1)


def reads_by_steps(cache, model=None) -> bool:
    """Whether decode_logits reads `cache` a forward a token (RoPE blocks quantized over several tokens, or a window
    that cannot be read over doubled keys, `model`'s attention given): callers then decode several sequences
    together (DECODE_BATCH)."""
    return not reads_doubled(cache, model) and any(layer.exact_prefill() is not None for layer in _mla_layers(cache))


def exact_prefill(cache, n_tokens: int) -> int:
    """How many of `n_tokens` leading tokens one plain forward reads through `cache` as decode steps would (all of
    them for no cache, a 16-bit one or per-token codes without a window; at least 1)."""
    limits = [n for n in (layer.exact_prefill() for layer in _mla_layers(cache)) if n is not None]
    return max(1, min([n_tokens, *limits]))


def doubled_mask(batch: int, n_tokens: int, window: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The additive attention mask [batch, 1, T, 2T] of a forward over doubled keys (T = n_tokens): 0 where query i
    may read key k, the dtype's lowest value elsewhere. Keys 0..T − 1 are the tokens quantized, T..2T − 1 the same
    tokens unquantized: query i reads token j quantized where j ≤ i − window, unquantized where i − window < j ≤ i."""
    pos = torch.arange(n_tokens, device=device)
    back = pos[:, None] - pos[None, :]  # i − j [T, T]
    allowed = torch.cat([back >= window, (back >= 0) & (back < window)], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].expand(batch, 1, n_tokens, 2 * n_tokens)


@torch.no_grad()
def decode_logits(model, ids: torch.Tensor, cache=None, first: int = 0, *, doubled: bool = True) -> torch.Tensor:
    """Logits [B, T − first, V] (float32) of the queries at positions first..T−1 of ids [B, T], each as a decode step
    reading `cache` gives it: one forward over doubled keys where the cache reads so (``reads_doubled``) and
    `doubled` allows it, else one forward over the first ``exact_prefill(cache, T)`` tokens and then one a token
    (``doubled=False``: that way for a window too, to compare). Rows of a batch may be right-padded: a padded position
    is later than every real one, so no real query reads it."""
    B, T = ids.shape
    if not 0 <= first < T:
        raise ValueError(f"first query {first} is outside a sequence of {T} tokens")
    if doubled and reads_doubled(cache, model):
        layers = _mla_layers(cache)
        mask = doubled_mask(B, T, layers[0].fp_window, model.dtype, ids.device)
        with ExitStack() as stack:
            for layer in layers:
                stack.enter_context(layer.doubled_reads())
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                        logits_to_keep=T - first)
        return out.logits.float()
    n = exact_prefill(cache, T)
    if n < T:
        for layer in _mla_layers(cache):
            layer.keep_read_back()  # T - n more reads: each dequantizes its new token only
    out = [model(input_ids=ids[:, :n], past_key_values=cache, use_cache=True).logits[:, first:].float()]
    for t in range(n, T):
        step = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits.float()
        if t >= first:
            out.append(step)
    return torch.cat(out, dim=1)
