"""What `quantmla eval` builds and merges for its rows: fingerprints across --from-json files, the calibration
settings each row runs with, MIX rows' bytes as allocated, and setup cells that tell rows apart."""

from __future__ import annotations

import json

import pytest

from quantmla.evaluation import table

DATA = {"heldout": "heldout", "kind": "code", "seq_len": 64, "ppl_chunks": 2, "retrieval_n": 10,
        "retrieval_lengths": [1024], "retrieval_formats": ["key"], "seed": 0}


def _row(method, config, bpb, fp, setup=None):
    return {"model": "m", "config": config, "method": method, "format": config, "bits_per_byte": bpb,
            "retrieval": {"1024": {"accuracy": 0.5, "n": 10, "correct": 5}}, "bytes_per_token": 40,
            "bf16_bytes_per_token": 96, "eval_mode": "every read quantized incl. prefill", "reads": "decode",
            "data": dict(DATA), "provenance": {"model": fp, "heldout": "H"},
            "setup": {} if method == "bf16" else (setup or {"content_group": 16, "rope_group": 8, "fp_window": 0})}


def test_from_json_refuses_rows_of_another_checkpoint_of_the_same_name(tmp_path, capsys):
    """Two runs' files of checkpoints that share a directory name (other fingerprints) do not merge: the quantized
    row's Δ would be taken against the other checkpoint's BF16 row. Files of one checkpoint merge."""
    from quantmla.cli import main

    table.write([_row("bf16", "BF16", 2.0, "A")], str(tmp_path / "a"))
    table.write([_row("rtn", "INT4/INT4", 2.2, "B")], str(tmp_path / "b"))
    table.write([_row("rtn", "INT4/INT4", 2.2, "A")], str(tmp_path / "c"))
    args = ["eval", "--from-json", str(tmp_path / "a" / "accuracy.json")]
    assert main(args + [str(tmp_path / "b" / "accuracy.json"), "--out", str(tmp_path / "ab")]) == 2
    assert "fingerprint" in capsys.readouterr().err and not (tmp_path / "ab" / "accuracy.json").exists()
    assert main(args + [str(tmp_path / "c" / "accuracy.json"), "--out", str(tmp_path / "ac")]) == 0


def test_setup_cells_tell_kivi_blocks_apart():
    s = table.setup_of(_row("kivi", "INT4/INT4", 2.1, "A", {"content_group": 16, "rope_group": 8, "fp_window": 0,
                                                              "kivi_block": 16}))
    assert "KIVI block 16" in table._setup_name(s)
    assert "KIVI block" not in table._setup_name(table.setup_of(_row("kivi", "INT4/INT4", 2.1, "A")))


def test_rows_that_read_no_calibration_data_carry_no_calibration_settings():
    """An rtn row is the same row whatever --calib-n the run had: its identity does not name calibration settings."""
    a = _row("rtn", "INT4/INT4", 2.2, "A", {"content_group": 16, "rope_group": 8, "fp_window": 0, "calib_rows": 2,
                                            "calib_steps": "default"})
    b = _row("rtn", "INT4/INT4", 2.2, "A", {"content_group": 16, "rope_group": 8, "fp_window": 0, "calib_rows": 3,
                                            "calib_steps": "default"})
    assert table.setup_of(a) == table.setup_of(b) and "calib_rows" not in table.setup_of(a)
    q = dict(a, method="quantmla")
    assert table.setup_of(q)["calib_rows"] == 2


@pytest.mark.parametrize("extra,steps", [(["--calib-steps", "500"], 500), (["--quick", "--calib-steps", "500"], 500),
                                         (["--quick", "--calib-steps", "500", "--calib-device", "cpu"], 500),
                                         (["--quick"], 20), (["--quick", "--calib-device", "cpu"], 20)])
def test_calibration_steps_asked_for_are_the_steps_run(checkpoint, tmp_path, monkeypatch, extra, steps):
    """--calib-steps wins over --quick's 20, and --calib-device does not switch --quick's steps off."""
    import quantmla.evaluation.harness as H
    from quantmla.cli import main

    seen = []

    class Stop(Exception):
        pass

    def fake_evaluate_row(model, tok, r, ev, **kw):
        seen.append(dict(kw["calib_kwargs"]))
        raise Stop

    monkeypatch.setattr(H, "evaluate_row", fake_evaluate_row)
    argv = ["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), "--seq-len", "64",
            "--ppl-chunks", "2", "--retrieval-n", "1", "--lengths", "1024", "--calib-n", "2", "--out",
            str(tmp_path / "o"), "--rows", "INT4/INT4:quantmla:16/8", *extra]
    with pytest.raises(Stop):
        main(argv)
    assert seen[-1].get("steps") == steps


def test_calibration_options_without_a_calibrated_row_are_refused(checkpoint, tmp_path, capsys):
    """--calib-n, --calib-len, --calib-steps and --calib-device would change nothing where no row reads calibration
    data: refused before any weights are read (and nothing written); a MIX row reads them."""
    from quantmla.cli import main

    argv = ["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), "--seq-len", "64",
            "--ppl-chunks", "1", "--retrieval-n", "1", "--lengths", "1024", "--out", str(tmp_path / "o")]
    assert main(argv + ["--rows", "INT4/INT4:rtn:16/8", "BF16:bf16", "--calib-n", "4", "--calib-steps", "3"]) == 2
    assert "--calib-n, --calib-steps set the calibration of rows that read" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main(argv + ["--rows", "INT4/INT4:kivi:16/8", "--calib-device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--calib-device set" in err and "leave it out" in err
    assert main(argv + ["--rows", "MIX3/INT4:rtn:16/8", "--calib-n", "2"]) == 0


@pytest.mark.parametrize("config", ["MIX3/INT4", "MIX2.5/INT4"])
def test_a_mix_row_without_calibration_method_runs_and_counts_the_bytes_it_stores(checkpoint, tmp_path, config):
    """MIX3/INT4 under rtn loads calibration rows for its per-layer bits (it failed after loading the model), and its
    bytes a token are the mean of the layers' own layouts as allocated to whole layers (the tiny model's 2 layers give
    MIX2.5 no INT4 layer: 32 B, not the nominal 34)."""
    from quantmla.cache.layout import CacheFormat, TokenLayout
    from quantmla.cli import main
    from quantmla.model.load import check_model_dir

    out = tmp_path / "o"
    assert main(["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), "--seq-len", "64",
                 "--ppl-chunks", "2", "--retrieval-n", "1", "--lengths", "1024", "--calib-n", "2", "--out", str(out),
                 "--rows", f"{config}:rtn:16/8"]) == 0
    r = next(r for r in json.loads((out / "accuracy.json").read_text())["rows"] if r["config"].startswith("MIX"))
    spec = check_model_dir(str(checkpoint / "tiny"))
    from quantmla.quant.format import PathFormat

    per_layer = [TokenLayout(spec.d_c, spec.d_r, CacheFormat(PathFormat(b, 16), PathFormat(4, 8))).bytes_per_token
                 for b in r["content_bits_by_slot"].values()]
    assert r["bytes_per_token"] == pytest.approx(sum(per_layer) / len(per_layer))


def test_content_clip_reaches_a_mix_rows_int4_layers():
    import argparse

    from quantmla.evaluation.command import add_arguments, rows_for

    p = argparse.ArgumentParser()
    add_arguments(p)
    (row,) = rows_for(p.parse_args(["m", "--content-clip", "0.875", "--rows", "MIX3/INT4:rtn:16/8"]))
    assert row.config.content.clip == 0.875 and row.config.mix_high.clip == 0.875


def test_from_json_merges_runs_that_differ_only_in_calibration_settings(tmp_path):
    """Two runs with other --calib-n both hold the same rtn row: the merge keeps one of it and both quantmla rows."""
    from quantmla.cli import main

    for name, n, bpb in (("a", 16, 2.05), ("b", 32, 2.04)):
        calib = {"content_group": 16, "rope_group": 8, "fp_window": 0, "calib_rows": n, "calib_steps": "default"}
        table.write([_row("bf16", "BF16", 2.0, "A"), _row("rtn", "INT4/INT4", 2.2, "A", calib),
                     _row("quantmla", "INT4/INT4", bpb, "A", calib)], str(tmp_path / name))
    assert main(["eval", "--from-json", str(tmp_path / "a" / "accuracy.json"), str(tmp_path / "b" / "accuracy.json"),
                 "--out", str(tmp_path / "ab")]) == 0
    rows = json.loads((tmp_path / "ab" / "accuracy.json").read_text())["rows"]
    assert sorted(r["method"] for r in rows) == ["bf16", "quantmla", "quantmla", "rtn"]


def test_bf16_bf16_is_the_bf16_reference():
    """BF16/BF16 quantizes nothing: it is the BF16 reference under its one name, so it runs once beside BF16 and the
    claims find it (they look the reference up by name)."""
    from quantmla.evaluation.claims import compare
    from quantmla.evaluation.command import rows_for
    from quantmla.evaluation.configs import named_config

    assert named_config("BF16/BF16") == named_config("BF16") and named_config("bf16/bf16").name == "BF16"
    import argparse

    from quantmla.evaluation.command import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    rows = rows_for(p.parse_args(["m", "--rows", "BF16:bf16", "BF16/BF16:bf16", "INT4/INT4:rtn:16/8"]))
    assert [(r.config.name, r.method) for r in rows] == [("BF16", "bf16"), ("INT4/INT4", "rtn")]
    assert named_config("BF16/INT4").name == "BF16/INT4"  # a quantized path keeps its own name
    setup = {"content_group": 16, "rope_group": 8, "fp_window": 0}
    ref = _row("bf16", named_config("BF16/BF16").name, 2.0, "A")
    got = [_row(m, "INT4/INT4", 2.0 * (1 + p / 100), "A", setup) for m, p in
           (("rtn", 5.0), ("kivi", 4.0), ("hadamard", 6.0), ("quantmla", 1.0))]
    for r in got:
        r["bpb_increase_pct"] = (r["bits_per_byte"] / 2.0 - 1) * 100
    c = compare([ref, *got], json.dumps(setup, sort_keys=True), "m", "INT4/INT4")
    assert c["missing"] == [] and c["ratio"] == pytest.approx(0.25)
