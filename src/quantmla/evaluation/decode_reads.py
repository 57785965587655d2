"""Logits of a token sequence with every query reading the cache as token-by-token decode steps would.

A quantized cache hands each forward one key history. With per-token codes and no full-precision window that
history is what every query of a prefill would read in a decode, so one forward gives every position's decode
logits. Two caches differ:

- a full-precision window of W tokens: a decode query at position t reads tokens (t − W, t] unquantized and the
  older ones quantized, a history of its own; one forward over T > W tokens keeps only the last W of all T
  unquantized, so its earlier queries would read their own recent tokens quantized;
- RoPE keys quantized per channel over blocks of tokens (KIVI-style, per page): a decode reads a block quantized
  over the tokens it has so far; one forward would read it quantized over all of them, later tokens included.

Each layer says how many leading tokens one forward reads exactly (``QuantMLALayer.exact_prefill``). A sequence is
prefilled that far in one forward and decoded a token a forward after, so the later positions' hidden states, and
with them the keys of the layers above, are the decode's too.
"""

from __future__ import annotations

import torch


def _mla_layers(cache) -> list:
    return cache.mla_layers() if hasattr(cache, "mla_layers") else []


DECODE_BATCH = 16  # sequences decoded together where a cache is read a forward a token (their cost is the steps')


def reads_by_steps(cache) -> bool:
    """Whether one forward over a long sequence would read `cache` otherwise than decode steps (a window, or RoPE
    blocks quantized over several tokens): decode_logits then takes a forward a token."""
    return any(layer.exact_prefill() is not None for layer in _mla_layers(cache))


def exact_prefill(cache, n_tokens: int) -> int:
    """How many of `n_tokens` leading tokens one forward reads through `cache` as decode steps would (all of them for
    no cache, a 16-bit one or per-token codes without a window; at least 1)."""
    limits = [n for n in (layer.exact_prefill() for layer in _mla_layers(cache)) if n is not None]
    return max(1, min([n_tokens, *limits]))


@torch.no_grad()
def decode_logits(model, ids: torch.Tensor, cache=None, first: int = 0) -> torch.Tensor:
    """Logits [B, T − first, V] (float32) of the queries at positions first..T−1 of ids [B, T], each as a decode step
    reading `cache` gives it: one forward over the first ``exact_prefill(cache, T)`` tokens, then one a token.
    Rows of a batch may be right-padded: a padded position is later than every real one, so no real query reads
    it."""
    T = ids.shape[1]
    if not 0 <= first < T:
        raise ValueError(f"first query {first} is outside a sequence of {T} tokens")
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
