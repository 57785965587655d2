"""`quantmla demo`'s output directory: its own earlier output is replaced, anyone else's results are not."""

import pytest

from quantmla.demo import MARK, claim_out
from quantmla.errors import QuantMLAError


def test_demo_claims_only_its_own_or_an_empty_directory(tmp_path):
    fresh = tmp_path / "fresh"
    claim_out(str(fresh))  # made and marked
    assert (fresh / MARK).exists()
    (fresh / "accuracy.json").write_text("{}")
    claim_out(str(fresh))  # an earlier demo's table: the demo may replace it
    theirs = tmp_path / "results"
    theirs.mkdir()
    (theirs / "accuracy.json").write_text('{"rows": ["kept"]}')
    with pytest.raises(QuantMLAError, match="holds accuracy.json that quantmla demo did not write"):
        claim_out(str(theirs))
    assert (theirs / "accuracy.json").read_text() == '{"rows": ["kept"]}' and not (theirs / MARK).exists()
    old = tmp_path / "old"  # a demo's output from before the mark: its report says so
    old.mkdir()
    (old / "accuracy.json").write_text("{}")
    (old / "report.md").write_text("# QuantMLA report: qmla-ref-deepseek-v3\n")
    claim_out(str(old))
    assert (old / MARK).exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    claim_out(str(other))  # nothing the demo would replace
