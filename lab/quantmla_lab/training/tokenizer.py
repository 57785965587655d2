"""Byte-level BPE tokenizer of the reference models (trained with ``tokenizers``).

GPT-2-style byte-level BPE: every byte is in the base alphabet (no unknown tokens),
the GPT-2 pre-tokenizer regex, one special token ``<|endoftext|>`` (id 0) that separates
documents and also serves as BOS/EOS/PAD. It never adds special tokens on its own.
Saved as ``tokenizer.json`` + ``tokenizer_config.json``: loadable with
``PreTrainedTokenizerFast.from_pretrained(dir)`` or ``AutoTokenizer.from_pretrained(dir)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from quantmla.evaluation.tokens import token_byte_lengths, token_bytes  # noqa: F401 (the byte counts bits/byte uses)

SPECIAL = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int, length: int | None = None):
    """Train a byte-level BPE on ``texts``; returns a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def wrap(tok, model_max_length: int = 4096):
    """A ``PreTrainedTokenizerFast`` around a ``tokenizers.Tokenizer``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL,
        eos_token=SPECIAL,
        pad_token=SPECIAL,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tok, out_dir: str | Path, model_max_length: int = 4096) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wrap(tok, model_max_length).save_pretrained(str(out_dir))


def load_tokenizer(path: str | Path):
    """``PreTrainedTokenizerFast`` from a directory (or a ``tokenizer.json`` file)."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if path.is_file():
        from tokenizers import Tokenizer

        return wrap(Tokenizer.from_file(str(path)))
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def line_start_tokens(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """``(ends_line, starts_blank)``, two ``bool[vocab]`` masks.

    ``ends_line``: whitespace-only tokens that end with a newline; ``starts_blank``: tokens
    whose first byte is whitespace. Where a token of the first kind is followed by one that
    is not of the second, a line starting in column 0 begins there, and the GPT-2
    pre-tokenizer splits the text at exactly that point: a line spliced in at the token level
    tokenizes exactly as the same text would (see :class:`quantmla_lab.training.tasks.RowMaker`)."""
    tb = token_bytes(tokenizer)
    ends = np.array([len(b) > 0 and b.endswith(b"\n") and not b.strip() for b in tb], dtype=bool)
    blank = np.array([len(b) > 0 and b[:1].isspace() for b in tb], dtype=bool)
    return ends, blank
