"""The README states what the code does: its accuracy block is the one the results generate, and its
Python snippets run as written (on CPU, with fewer new tokens)."""

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_accuracy_block_is_generated_from_the_results():
    """Every sentence and figure of the README's accuracy summary comes from results/accuracy.json."""
    from quantmla.evaluation import claims, table

    text = README.read_text()
    i, j = text.find(claims.BEGIN), text.find(claims.END)
    assert 0 <= i < j, "the README lost its generated accuracy block"
    want = claims.readme_block(table.load(str(ROOT / "results")))
    assert text[i : j + len(claims.END)] == want, (
        "README.md's accuracy block differs from results/accuracy.json: run "
        "`quantmla eval --from-json results/accuracy.json --readme README.md`")


def test_claims_mark_missing_rows_and_never_compare_incomplete_sets():
    """A model without a Hadamard row gets no ratio to 'the best baseline', and the sentence says why."""
    from quantmla.evaluation import claims, table

    rows = table.relative(table.load(str(ROOT / "results")))
    for m in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == m]
        has_h = any(r["method"] == "hadamard" and r["config"] == "INT2/INT4" for r in mine)
        line = next(l for l in claims.claim_lines(mine) if l.startswith("- INT2/INT4"))
        assert ("Hadamard row missing, no comparison claimed" in line) == (not has_h), m
        assert ("best baseline's increase" in line) == has_h, m
        c = claims.compare(mine, claims._setups(mine)[0], m, "INT2/INT4")
        assert (c["ratio"] is None) == (not has_h)


def test_rope_channel_claims_compare_at_the_baselines_bytes_only():
    """QuantMLA with RoPE keys per channel joins the claims (and the README's table) at the groups of the
    baselines it is compared with and only where it stores the KIVI-style row's bytes per token."""
    import copy

    from quantmla.evaluation import claims, harness, table

    assert claims.RC_METHOD in harness.ROPE_CHANNEL  # one method name, the harness's
    rows = table.relative(table.load(str(ROOT / "results")))
    setup = claims._setups(rows)[0]
    m = sorted({r["model"] for r in rows})[0]
    c = claims.compare(rows, setup, m, "INT4/INT4", claims.RC_METHOD)
    assert not c["missing"] and c["ratio"] is not None and c["quantmla"] < c["baselines"]["kivi"]
    assert any(", QuantMLA, RoPE per channel at the baselines' bytes:" in line for line in claims.claim_lines(rows))
    other = copy.deepcopy(rows)
    for r in other:
        if r["method"] == claims.RC_METHOD:
            r["bytes_per_token"] += 6  # e.g. a finer RoPE block than the baselines' bytes allow
    assert claims.compare(other, setup, m, "INT4/INT4", claims.RC_METHOD)["missing"] == [claims.RC_METHOD]
    assert not any("RoPE per channel" in line for line in claims.claim_lines(other))
    assert "RoPE per channel" not in claims.summary_table(other, setup)[0]


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_snippets_run_on_cpu(tmp_path, monkeypatch, capsys):
    """Each ```python block of the README, run in order in a fresh namespace from a directory that has the
    repository's models/, as a user pasting it would (max_new_tokens lowered to 4 for time)."""
    blocks = _snippets()
    assert len(blocks) >= 3
    (tmp_path / "models").symlink_to(ROOT / "models")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for i, code in enumerate(blocks):
        code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=4", code)
        exec(compile(code, f"README.md python block {i + 1}", "exec"), {"__name__": f"readme_{i}"})
        out = capsys.readouterr().out
        assert out.strip(), f"block {i + 1} printed nothing"
    saved = tmp_path / "out" / "v3-int4"
    assert (saved / "calibration_report.json").exists()
    import json

    assert json.loads((saved / "config.json").read_text())["dtype"] == "bfloat16"
