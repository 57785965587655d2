"""Documents -> token chunks: what perplexity, the error analysis and calibration feed the model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quantmla.errors import QuantMLAError


def token_chunks(tokenizer, texts: Sequence[str], seq_len: int, max_chunks: int | None = None) -> torch.Tensor:
    """``LongTensor [n, seq_len]``: the documents' token stream (no special tokens, EOS between documents) cut
    into consecutive chunks; a last partial chunk is dropped unless it is the only one (then ``[1, tokens]``).
    Tokenizing stops once ``max_chunks`` chunks are full (0: none, ``[0, seq_len]``). One string is refused: it would
    be a document a character."""
    if isinstance(texts, str):
        raise QuantMLAError("texts is one string: pass a list of documents, e.g. [text]")
    if seq_len < 1 or (max_chunks is not None and max_chunks < 0):
        raise QuantMLAError(f"seq_len {seq_len} and max_chunks {max_chunks}: a chunk holds at least 1 token, and "
                            "max_chunks counts chunks (0: none, None: all)")
    if max_chunks == 0:
        return torch.zeros((0, seq_len), dtype=torch.long)
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for i, t in enumerate(texts):
        if i and eos is not None:
            stream.append(eos)
        stream.extend(tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"])
        if max_chunks is not None and len(stream) >= max_chunks * seq_len:
            break
    n = len(stream) // seq_len
    if n == 0:
        return torch.tensor([stream], dtype=torch.long)
    if max_chunks is not None:
        n = min(n, max_chunks)
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)
