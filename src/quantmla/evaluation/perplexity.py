"""Held-out bits per byte of a causal LM, with every attention read going through a cache.

``bits_per_byte(model, tokenizer, texts_or_token_chunks, seq_len=..., cache_factory=...)``

- ``texts_or_token_chunks``: a list of strings (documents) or of token-id sequences
  (lists / 1-D tensors), or a 2-D ``LongTensor [n_chunks, L]``.
  Strings are tokenized without special tokens and joined with the EOS token between
  documents into one stream, which is cut into consecutive chunks of ``seq_len`` tokens.
  Token sequences are used as given (each one a chunk; longer ones are cut into
  ``seq_len`` pieces).
- Each chunk is one forward of ``[batch, seq_len]`` tokens with
  ``past_key_values=cache_factory(model)`` (a fresh cache per forward; ``None`` lets
  transformers make a plain ``DynamicCache``) and ``use_cache=True``: the prefill's
  attention reads the keys/values *after* they went through ``cache.update``. A cache with a
  full-precision window, or with RoPE keys quantized per channel over blocks of tokens, is read
  as decode steps read it (``evaluation.decode_reads``): in a few forwards over expanded keys, or,
  with an attention that takes no additive mask, a forward a token (then 16 chunks together).
- Token ``t`` of a chunk is predicted from tokens ``< t`` of the same chunk (the first
  token of a chunk is context only). Units: ``bits = -log2 p(token)``; each predicted token
  counts its exact UTF-8 bytes (:func:`quantmla.evaluation.tokens.token_byte_lengths`);
  special tokens (document separators) are neither predicted nor counted.

Returns a dict: ``bits_per_byte``, ``bits_per_token``, ``bytes_per_token``, ``tokens``
(predicted), ``bytes``, ``chunks``, ``seq_len``, ``nll_bits`` (total).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

from quantmla.corpus.chunks import token_chunks
from quantmla.errors import QuantMLAError
from quantmla.evaluation.decode_reads import DECODE_BATCH, decode_logits, reads_by_steps
from quantmla.evaluation.tokens import token_byte_lengths

_BYTE_LENGTHS: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def _byte_lengths(tokenizer) -> torch.Tensor:
    """``int64 [vocab]``: the UTF-8 bytes of each token, kept per live tokenizer. The entry remembers the
    tokenizer itself (a weak reference): a later tokenizer that reuses a collected one's ``id`` gets its
    own lengths, never the stale ones."""
    hit = _BYTE_LENGTHS.get(id(tokenizer))
    if hit is not None and hit[0]() is tokenizer:
        return hit[1]
    lengths = torch.from_numpy(token_byte_lengths(tokenizer))
    try:
        _BYTE_LENGTHS[id(tokenizer)] = (weakref.ref(tokenizer), lengths)
    except TypeError:  # a tokenizer without weak references is not cached
        pass
    return lengths


def _as_chunks(tokenizer, data, seq_len: int, max_chunks: int | None) -> list[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        rows = [data] if data.dim() == 1 else list(data)
    elif len(data) and isinstance(data[0], str):
        rows = list(token_chunks(tokenizer, data, seq_len, max_chunks))
    else:
        rows = [torch.as_tensor(x, dtype=torch.long) for x in data]
    out = []
    for r in rows:
        out += [r[i : i + seq_len] for i in range(0, len(r), seq_len) if len(r[i : i + seq_len]) > 1]
    return out[:max_chunks] if max_chunks is not None else out


@torch.no_grad()
def bits_per_byte(
    model,
    tokenizer,
    texts_or_token_chunks,
    *,
    seq_len: int,
    cache_factory: Callable | None = None,
    device: str | torch.device | None = None,
    batch_size: int = 1,
    max_chunks: int | None = None,
    reads: str = "decode",
) -> dict:
    """Bits per UTF-8 byte of held-out text (see the module docstring for the exact rules). `reads`: "decode", every
    query reads the cache as decode steps would (``evaluation.decode_reads``); "prefill", one forward a chunk
    whatever the cache (what a prefill reads: for caches with a window or per-channel RoPE blocks, not a decode's)."""
    if reads not in ("decode", "prefill"):
        raise QuantMLAError(f"reads {reads!r}: 'decode' or 'prefill'")
    if seq_len < 2:
        raise QuantMLAError(f"seq_len {seq_len}: a chunk predicts its tokens after the first, so it needs at least 2")
    if isinstance(texts_or_token_chunks, str):
        raise QuantMLAError("texts_or_token_chunks is one string: pass a list of documents, e.g. [text]")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    blen = _byte_lengths(tokenizer).to(device)
    specials = torch.zeros_like(blen, dtype=torch.bool)
    for i in getattr(tokenizer, "all_special_ids", []) or []:
        if i < len(specials):
            specials[i] = True
    chunks = _as_chunks(tokenizer, texts_or_token_chunks, seq_len, max_chunks)
    was_training = model.training
    model.eval()
    nll = torch.zeros((), dtype=torch.float64, device=device)
    n_tok = torch.zeros((), dtype=torch.long, device=device)
    n_bytes = torch.zeros((), dtype=torch.long, device=device)
    # group chunks of equal length into batches
    by_len: dict[int, list[torch.Tensor]] = {}
    for c in chunks:
        by_len.setdefault(len(c), []).append(c)
    ready = cache_factory(model) if cache_factory is not None else None  # the first batch's, asked what it reads
    if reads == "decode" and ready is not None and reads_by_steps(ready, model):
        batch_size = max(batch_size, DECODE_BATCH)  # a forward a token: decode steps cost the same for several chunks
    for L, group in sorted(by_len.items()):
        for i in range(0, len(group), batch_size):
            ids = torch.stack(group[i : i + batch_size]).to(device)
            cache = ready if ready is not None else cache_factory(model) if cache_factory is not None else None
            ready = None
            if reads == "decode":
                logits = decode_logits(model, ids, cache)[:, :-1]  # as decode steps read the cache (a window, blocks)
            else:
                with torch.no_grad():
                    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, :-1].float()
            target = ids[:, 1:]
            lp = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
            keep = ~specials[target]
            nll -= (lp.double() * keep).sum()
            n_tok += keep.sum()
            n_bytes += (blen[target] * keep).sum()
            del logits, lp
    if was_training:
        model.train()
    nll_bits = float(nll) / math.log(2)
    tokens, nbytes = int(n_tok), int(n_bytes)
    if tokens == 0 or nbytes == 0:
        raise QuantMLAError(f"no token was predicted ({len(chunks)} chunks of at least 2 tokens): give more held-out "
                            "text, or text that is not all special tokens")
    return {
        "bits_per_byte": nll_bits / max(nbytes, 1),
        "bits_per_token": nll_bits / max(tokens, 1),
        "bytes_per_token": nbytes / max(tokens, 1),
        "tokens": tokens,
        "bytes": nbytes,
        "chunks": len(chunks),
        "seq_len": seq_len,
        "nll_bits": nll_bits,
    }
