"""Calibration text -> token rows [N, L].

Sources: a text file (one document), a ``.jsonl`` file (one document per line: a JSON string or
an object with a ``"text"`` field), or ``"default"``: Python standard-library sources that the
reference models were trained on and that never come from the held-out evaluation packages.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quantmla.corpus.chunks import token_chunks
from quantmla.errors import QuantMLAError


def read_documents(source: str | Path) -> list[str]:
    p = Path(source)
    if not p.exists():
        raise FileNotFoundError(f"calibration file {p} does not exist (give a text or .jsonl file, or 'default')")
    if p.is_dir():
        raise QuantMLAError(f"calibration source {p} is a directory; give a text or .jsonl file")
    text = p.read_text(encoding="utf-8", errors="replace")
    if p.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise QuantMLAError(f"{p}:{i}: not valid JSON ({e.msg}); each line must be a JSON string or {{\"text\": ...}}") from None
            if isinstance(obj, dict) and isinstance(obj.get("text"), str):
                docs.append(obj["text"])
            elif isinstance(obj, str):
                docs.append(obj)
            else:
                raise QuantMLAError(f"{p}:{i}: expected a JSON string or an object with a \"text\" string field")
        return docs
    return [text]


def default_documents(max_bytes: int = 400_000) -> list[str]:
    from quantmla.corpus.calibration_text import calibration_texts

    return calibration_texts(max_bytes=max_bytes)


def token_rows(tokenizer, docs: list[str], seq_len: int, max_rows: int | None = None) -> torch.Tensor:
    """``LongTensor [n, seq_len]``, 2 <= n <= max_rows: the documents joined with EOS into one token stream and cut
    into rows (:func:`quantmla.corpus.chunks.token_chunks`), or a clear error where the text is too short."""
    if seq_len < 2:
        raise QuantMLAError(f"calibration sequence length must be >= 2, got {seq_len}")
    if max_rows is not None and max_rows < 2:
        raise QuantMLAError(f"calibration needs at least 2 rows of tokens, {max_rows} asked for")
    rows = token_chunks(tokenizer, docs, seq_len, max_rows)
    if rows.shape[1] != seq_len or rows.shape[0] < 2:
        full = rows.shape[0] if rows.shape[1] == seq_len else 0
        raise QuantMLAError(f"calibration text gives {full} full row(s) of {seq_len} tokens, fewer than 2: "
                            "give more text or a shorter --seq-len")
    return rows


def load_calibration_ids(tokenizer, source: str, seq_len: int, rows: int) -> torch.Tensor:
    docs = default_documents() if source == "default" else read_documents(source)
    return token_rows(tokenizer, docs, seq_len, rows)
