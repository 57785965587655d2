"""The append tilings bench on the CPU (interpreter): every tiling is checked against the reference writer and the
tiling a row ran is recorded; bad tilings, staged formats and a CPU run without the interpreter are refused first."""

import json
import os

import pytest

from quantmla_lab.bench.kernels import append_tilings

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (CPU)")


def test_rows_record_the_tiling_each_ran(tmp_path):
    out = tmp_path / "a.json"
    append_tilings.main(["--methods", "int4/int4", "fp8", "--tokens", "1", "300", "--tilings", "default", "1:0",
                         "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    got = {(r["method"], r["tokens"], r["tiling"]): (r["block_t"], r["warps"], r["paths_apart"]) for r in rows}
    assert got[("int4/int4", 1, "default")] == (1, 4, True)
    assert got[("int4/int4", 300, "default")] == (4, 1, False)
    assert got[("fp8", 300, "default")] == (4, 2, False)
    assert got[("fp8", 1, "given")] == (1, 1, False)
    assert len(rows) == 8 and all("graph_us" not in r for r in rows)  # the CPU times nothing


@pytest.mark.parametrize("argv,msg", [
    (["--tilings", "3:1"], "WARPS 1, 2, 4 or 8"),
    (["--tilings", "1:2"], "APART 0 or 1"),
    (["--methods", "int4/int4", "int4/int4-page"], "int4/int4-page: a RoPE path grouped per page"),
])
def test_bad_arguments_are_refused_before_any_work(argv, msg, tmp_path):
    with pytest.raises(SystemExit, match=msg):
        append_tilings.main([*argv, "--out", str(tmp_path / "a.json")])
    assert not (tmp_path / "a.json").exists()


def test_a_cpu_run_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit, match="run with TRITON_INTERPRET=1"):
        append_tilings.main(["--tokens", "1"])
