"""Documents -> calibration rows: one token stream with EOS between documents, cut into full rows, and a clear error
where the text or the row count cannot give two rows."""

import pytest
import torch

from quantmla.calibration.data import token_rows
from quantmla.corpus.chunks import token_chunks
from quantmla.errors import QuantMLAError


class CharTokenizer:
    """One token a character (its code point), EOS 0."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False, verbose=True):
        return {"input_ids": [ord(c) for c in text]}


def test_rows_are_the_stream_cut_with_eos_between_documents():
    rows = token_rows(CharTokenizer(), ["abcde", "fgh"], seq_len=3)
    assert rows.tolist() == [[97, 98, 99], [100, 101, 0], [102, 103, 104]]
    assert token_rows(CharTokenizer(), ["abcdefghij"], seq_len=2, max_rows=3).shape == (3, 2)


def test_one_string_is_not_a_list_of_documents():
    """One string would be tokenized a character a document, EOS between: refused by the chunker and perplexity."""
    from quantmla.evaluation.perplexity import bits_per_byte

    with pytest.raises(QuantMLAError, match=r"texts is one string: pass a list of documents, e.g. \[text\]"):
        token_chunks(CharTokenizer(), "abcdefgh", 4)
    with pytest.raises(QuantMLAError, match="texts_or_token_chunks is one string"):
        bits_per_byte(None, CharTokenizer(), "abcdefgh", seq_len=4)
    assert token_chunks(CharTokenizer(), ["abcdefgh"], 4).shape == (2, 4)
    for seq_len, most in ((0, None), (4, -1)):
        with pytest.raises(QuantMLAError, match="a chunk holds at least 1 token, and max_chunks counts chunks"):
            token_chunks(CharTokenizer(), ["abcdefgh"], seq_len, most)
    assert token_chunks(CharTokenizer(), ["ab"], 4, 0).shape == (0, 4)  # none asked for: none, even from a short text


def test_calibration_text_needs_the_held_out_set_it_is_given(tmp_path):
    """A held-out directory without its code set is refused (nothing could be left out); the shipped one leaves its
    packages and documents out."""
    import json

    from quantmla.corpus import datasets as DS
    from quantmla.corpus.calibration_text import calibration_texts

    with pytest.raises(QuantMLAError, match="no code.jsonl under the held-out set"):
        calibration_texts(max_bytes=1000, heldout_root=str(tmp_path))
    root = DS.heldout_root()
    held = json.loads((root / "manifest.json").read_text())["heldout_packages"]
    assert held and calibration_texts(max_bytes=20_000, heldout_root=str(root))


def test_a_stream_shorter_than_a_chunk_is_one_partial_chunk_for_evaluation():
    assert torch.equal(token_chunks(CharTokenizer(), ["ab"], 8), torch.tensor([[97, 98]]))


@pytest.mark.parametrize("docs, seq_len, rows, why", [
    (["abc"], 4, None, "gives 0 full row"),
    (["abcdefg"], 4, None, "gives 1 full row"),
    (["abcdefghijkl"], 4, 1, "at least 2 rows of tokens, 1 asked for"),
    (["abcdefghijkl"], 1, None, "sequence length must be >= 2"),
])
def test_too_little_text_or_too_few_rows_is_refused(docs, seq_len, rows, why):
    with pytest.raises(QuantMLAError, match=why):
        token_rows(CharTokenizer(), docs, seq_len, rows)
