"""The demo's report.md nests the documents it embeds, and its figures are written."""

import re

from quantmla.evaluation import report, table


def _rows():
    data = {"heldout": "h", "kind": "code", "seq_len": 64, "ppl_chunks": 2, "retrieval_n": 4,
            "retrieval_lengths": [1024, 2048], "retrieval_formats": ["key"], "seed": 0}
    out = []
    for cfg, meth, bpb, nbytes in (("BF16", "bf16", 1.0, 320), ("INT4/INT4", "rtn", 1.05, 92), ("INT4/INT4", "kivi", 1.01, 92),
                                   ("INT4/INT4", "quantmla", 1.012, 92), ("INT2/INT4", "rtn", 1.3, 60),
                                   ("INT2/INT4", "quantmla", 1.05, 60)):
        out.append({"model": "m", "config": cfg, "method": meth, "format": cfg, "bits_per_byte": bpb, "bytes_per_token": nbytes,
                    "bf16_bytes_per_token": 320, "eval_mode": "every read quantized incl. prefill", "data": data,
                    "retrieval": {"1024": {"accuracy": 0.5, "n": 4}, "2048": {"accuracy": 0.75, "n": 4}},
                    "setup": {} if meth == "bf16" else {"content_group": 64, "rope_group": 32, "fp_window": 0}})
    return out


def test_report_nests_headings_and_shows_no_internal_sections(tmp_path):
    rows = _rows()
    from quantmla.evaluation import claims

    table_md = table.markdown(rows, claims.claim_lines)
    analysis_md = "# Dual-path error analysis: m\n\nsome text\n\n| a |\n|---|\n| 1 |\n"
    plots = [report.accuracy_plot(rows, str(tmp_path)), report.compression_plot(128, 32, str(tmp_path))]
    md = report.report_markdown("m", "Model: m.", table_md, analysis_md, plots, str(tmp_path), 12.0)
    heads = re.findall(r"^(#+) (.*)$", md, flags=re.M)
    assert [h for h in heads if h[0] == "#"] == [("#", "QuantMLA report: m")]  # one title
    assert ("##", "Accuracy") in heads and ("###", "m") in heads and ("###", "What the table shows") in heads
    assert not re.search(r"^#+:", md, flags=re.M) and "Issue" not in md and "goals" not in md
    # the retrieval columns are the lengths measured: no empty 4K column
    assert "key 2K" in md and "key 4K" not in md
    for p in plots:
        assert open(p, "rb").read(4) == b"\x89PNG"
    assert "![accuracy_vs_bytes.png](accuracy_vs_bytes.png)" in md


def test_nest():
    assert report.nest("# T\n\n## a\ntext\n### b") == "### a\ntext\n#### b"
    assert report.nest("no heading\n## a", level=3) == "no heading\n#### a"
