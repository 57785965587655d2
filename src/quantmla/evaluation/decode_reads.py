"""Logits of a token sequence with every query reading the cache as token-by-token decode steps would.

A quantized cache hands each forward one key history. With per-token codes and no full-precision window that
history is what every query of a prefill would read in a decode, so one forward gives every position's decode
logits. Two caches differ:

- a full-precision window of W tokens: a decode query at position t reads tokens (t − W, t] unquantized and the
  older ones quantized, a history of its own; one plain forward over T > W tokens keeps only the last W of all T
  unquantized, so its earlier queries would read their own recent tokens quantized;
- RoPE keys quantized per channel over blocks of B tokens (KIVI-style, per page): a decode reads a block quantized
  over the tokens it has so far; one forward would read it quantized over all of them, later tokens included.

Both are read in forwards over expanded keys: within ``QuantMLALayer.expanded_reads()`` an update returns every
version of a token that one of its queries reads (``cache.hf_cache.expanded_keys``): the history after the update
(completed blocks quantized over the block, the last one as the last query reads it, the window unquantized), the
window and the new tokens unquantized, and for each query whose newest stored token s sits in an incomplete block the
block's first p = s mod B + 1 tokens quantized over those p (prefix keys, each read by that query alone). The
forward's 4D additive attention mask (``expanded_mask``, [batch, 1, T, K]) lets each query read exactly its decode
step's keys, with RoPE positions as usual: the cache stores RoPE keys rotated, so every version of a token carries its
own position's rotation. K is T, plus T with a window (a window over per-token codes doubles the keys), plus about
T·(B − 1)/2 prefix keys with blocks. The layers store the tokens as ever, so the cache ends as decode steps leave it.
transformers hands a 4D mask to the attention as it is; eager and sdpa attention add it to the scores (deepseek_v2,
deepseek_v3, minicpm3, glm4_moe_lite, longcat_flash, youtu alike).

A forward's attention scores grow as queries × keys, and most of them are masked: over all T queries at once the
prefix keys alone number about T·(B − 1)/2. So the queries are read in consecutive spans of at most ``MAX_SCORES``
scores (per sequence and head; ``expanded_spans``), each one forward whose update starts from the cache as the
previous span left it (decode steps' state), so a span scores only its own prefix keys besides the history. Where
the budget leaves one query a forward (a decode step) the rest is decoded a token a forward.

Other caches (a non-MLA layer, a cache already holding tokens, an attention that takes no additive mask, or
``expanded=False``) say how many leading tokens one forward reads exactly (``QuantMLALayer.exact_prefill``): a
sequence is prefilled that far in one forward and decoded a token a forward after, so the later positions' hidden
states, and with them the keys of the layers above, are the decode's too.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from quantmla.cache.hf_cache import ExpandedKeys, expanded_key_count


def _mla_layers(cache) -> list:
    return cache.mla_layers() if hasattr(cache, "mla_layers") else []


DECODE_BATCH = 16  # sequences decoded together where a cache is read a forward a token (their cost is the steps')

MASKED_ATTENTION = ("eager", "sdpa")  # attention implementations that add a 4D float mask to the scores

# attention scores (queries × keys) of one expanded forward, per sequence and head. Smaller spans re-read the history
# more often, larger ones score more keys their queries do not read; the first cost grows with the sequence. On 2 CPU
# threads (qmla-ref-deepseek-v3, KIVI-style and per-channel RoPE blocks of 32, windows 0 and 64; budgets 2^15, 2^17,
# 2^19; lab/results/eval/decode_reads_speed_budgets_cpu.json) 2^17 is the fastest at 512 tokens and 2^19 at 4096 in
# three of four caches (2^17 up to 2x slower there): so the budget is 2^7 scores a token, at least 2^17.
MAX_SCORES = 1 << 17
SCORES_PER_TOKEN = 1 << 7
# on a GPU a forward costs more in launches than in scores: at 4096 tokens (a window over per-token codes, and
# KIVI-style blocks of 16 with the window; an H100, lab/results/eval/decode_reads_speed_h100.json) 2^25 is the fastest
# of 2^21 to 2^27 (2^23: 1.1 to 1.4x its time; 2^27 level, or 1.5x with blocks)
MAX_SCORES_CUDA = 1 << 25


def score_budget(n_tokens: int, cuda: bool) -> int:
    """The scores (queries × keys, per sequence and head) one expanded forward may take when reading a sequence of
    `n_tokens`: ``MAX_SCORES_CUDA`` on a GPU, else ``SCORES_PER_TOKEN`` a token and at least ``MAX_SCORES``."""
    return MAX_SCORES_CUDA if cuda else max(MAX_SCORES, SCORES_PER_TOKEN * n_tokens)


def reads_expanded(cache, model=None) -> bool:
    """Whether decode_logits reads `cache` over expanded keys: every layer an empty QuantMLALayer with per-token
    content codes and a full-precision window or blocked RoPE keys (``QuantMLALayer.can_read_expanded``), all with
    one window and one block, and, given `model`, an attention implementation that adds a 4D mask to the scores
    (``MASKED_ATTENTION``)."""
    layers = _mla_layers(cache)
    if not layers or len(layers) != len(getattr(cache, "layers", ())):
        return False
    if model is not None and getattr(model.config, "_attn_implementation", None) not in MASKED_ATTENTION:
        return False
    return (all(getattr(layer, "can_read_expanded", False) and layer.get_seq_length() == 0 for layer in layers)
            and len({(layer.fp_window, layer.rope.block) for layer in layers}) == 1)


def reads_by_steps(cache, model=None) -> bool:
    """Whether decode_logits reads `cache` a forward a token (a window or RoPE blocks that cannot be read over
    expanded keys, `model`'s attention given): callers then decode several sequences together (DECODE_BATCH)."""
    return not reads_expanded(cache, model) and any(layer.exact_prefill() is not None for layer in _mla_layers(cache))


def exact_prefill(cache, n_tokens: int) -> int:
    """How many of `n_tokens` leading tokens one plain forward reads through `cache` as decode steps would (all of
    them for no cache, a 16-bit one or per-token codes without a window; at least 1)."""
    limits = [n for n in (layer.exact_prefill() for layer in _mla_layers(cache)) if n is not None]
    return max(1, min([n_tokens, *limits]))


def expanded_mask(keys: ExpandedKeys, batch: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The additive attention mask [batch, 1, T, K] of a forward over expanded keys (T = keys.end − keys.start
    queries, K = len(keys)): 0 where query i reads key k (keys.lo[k] ≤ i ≤ keys.hi[k]), the dtype's lowest value
    elsewhere."""
    queries = torch.arange(keys.start, keys.end)[:, None]
    allowed = (queries >= keys.lo[None]) & (queries <= keys.hi[None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed.to(device),
                                                                             torch.finfo(dtype).min)
    return mask[None, None].expand(batch, 1, *allowed.shape)


def expanded_spans(n_tokens: int, window: int, block: int, max_scores: int = MAX_SCORES) -> list[tuple[int, int]]:
    """Consecutive spans [a, b) of query positions from 0, each read in one forward over expanded keys with at most
    `max_scores` scores (b − a queries × ``expanded_key_count(a, b, window, block)`` keys), each as long as that
    allows; they end where the budget leaves a single query (the rest is decoded a token a forward) or at
    `n_tokens`."""
    spans: list[tuple[int, int]] = []
    a = 0
    while a < n_tokens:
        lo, hi = a + 1, n_tokens  # the longest span from a within the budget: b in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (mid - a) * expanded_key_count(a, mid, window, block) <= max_scores:
                lo = mid
            else:
                hi = mid - 1
        if lo - a < 2 and lo < n_tokens:
            break
        spans.append((a, lo))
        a = lo
    return spans


@torch.no_grad()
def decode_logits(model, ids: torch.Tensor, cache=None, first: int = 0, *, expanded: bool = True,
                  max_scores: int | None = None) -> torch.Tensor:
    """Logits [B, T − first, V] (float32) of the queries at positions first..T−1 of ids [B, T], each as a decode step
    reading `cache` gives it: forwards over expanded keys where the cache reads so (``reads_expanded``) and `expanded`
    allows it, in spans of at most `max_scores` scores per sequence and head (``expanded_spans``; None:
    ``score_budget(T, ids on a GPU)``), else one forward
    over the first ``exact_prefill(cache, T)`` tokens; then one a token for the rest (``expanded=False``: that way
    for every cache, to compare). Rows of a batch may be right-padded: a padded position is later than every real
    one, so no real query reads it."""
    B, T = ids.shape
    if not 0 <= first < T:
        raise ValueError(f"first query {first} is outside a sequence of {T} tokens")
    layers = _mla_layers(cache)
    if max_scores is None:
        max_scores = score_budget(T, ids.is_cuda)
    out, done = [], 0
    if expanded and reads_expanded(cache, model):
        for a, b in expanded_spans(T, layers[0].fp_window, layers[0].rope.block, max_scores):
            mask = expanded_mask(layers[0].expanded_keys(b - a), B, model.dtype, ids.device)
            keep = b - max(a, first)
            with ExitStack() as stack:
                for layer in layers:
                    stack.enter_context(layer.expanded_reads())
                logits = model(input_ids=ids[:, a:b], attention_mask=mask, past_key_values=cache, use_cache=True,
                               logits_to_keep=max(keep, 1)).logits
            if keep > 0:
                out.append(logits.float())
            done = b
    if not done:
        done = exact_prefill(cache, T)
        out.append(model(input_ids=ids[:, :done], past_key_values=cache, use_cache=True).logits[:, first:].float())
    if done < T:
        for layer in layers:
            layer.keep_read_back()  # T - done more reads: each dequantizes its new token only
    for t in range(done, T):
        step = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits.float()
        if t >= first:
            out.append(step)
    return torch.cat(out, dim=1)
