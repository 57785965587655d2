"""The exact bytes each token id stands for, which bits per byte counts
(:mod:`quantmla.evaluation.perplexity`)."""

from __future__ import annotations

import numpy as np


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes->unicode map (each byte is one printable character)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer) -> list[bytes]:
    """The exact bytes of every token id (``b""`` for special tokens).

    Exact for byte-level BPE vocabularies (every character of a token stands for one byte);
    for other tokenizers falls back to decoding each id on its own."""
    vocab = tokenizer.get_vocab()
    n = max(vocab.values()) + 1
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    dec = _byte_decoder()
    out = [b""] * n
    byte_level = all(all(ch in dec for ch in t) for t, i in vocab.items() if i not in specials)
    for t, i in vocab.items():
        if i in specials:
            continue
        if byte_level:
            out[i] = bytes(dec[ch] for ch in t)
        else:
            out[i] = tokenizer.decode([i]).encode("utf-8")
    return out


def token_byte_lengths(tokenizer) -> np.ndarray:
    """``int64[vocab]``: UTF-8 bytes each token stands for (0 for special tokens)."""
    return np.array([len(b) for b in token_bytes(tokenizer)], dtype=np.int64)
