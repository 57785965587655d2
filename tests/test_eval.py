"""KIVI-style cache, the accuracy harness, the table writer and `quantmla eval`."""

import json
from pathlib import Path

import pytest
import torch

from quantmla.cache.hf_cache import QuantMLACache
from quantmla.cache.kivi import KIVICache, KIVIFormat, KIVILayout, _ChannelBlockStore
from quantmla.cache.layout import CacheFormat, TokenLayout
from quantmla.errors import QuantMLAError, UnsupportedFormatError
from quantmla.evaluation import table
from quantmla.evaluation.harness import (
    CALIBRATED,
    EvalData,
    RowSpec,
    bf16_cache,
    default_rows,
    evaluate_row,
    named_config,
)
from quantmla.model.tiny import tiny_model
from quantmla.quant.format import PathFormat
from quantmla.quant.groupwise import quantize_dequantize

# -- KIVI ------------------------------------------------------------------------------------------


def test_kivi_store_round_trip_any_chunking():
    torch.manual_seed(0)
    fmt = KIVIFormat(PathFormat(4, 16), rope_bits=4, block=8)
    x = torch.randn(2, 37, 16)
    one = _ChannelBlockStore(fmt, 16)
    one.append(x)
    pieces = _ChannelBlockStore(fmt, 16)
    for a, b in ((0, 5), (5, 6), (6, 19), (19, 37)):  # prefill then mixed chunks, one single token
        pieces.append(x[:, a:b])
    assert one.length == pieces.length == 37 and one.quantized_length == 32
    torch.testing.assert_close(one.read(torch.float32), pieces.read(torch.float32), rtol=0, atol=0)
    y = one.read(torch.float32)
    # by default the unfinished block is quantized per channel over the 5 tokens it holds, like any other method's
    tail = x[:, 32:].transpose(1, 2)  # [B, D, 5]: pad each channel's 5 values to a block with its last value
    ref_tail = quantize_dequantize(torch.cat([tail, tail[..., -1:].expand(-1, -1, 3)], -1), PathFormat(4, 8))[..., :5]
    torch.testing.assert_close(y[:, 32:], ref_tail.transpose(1, 2), rtol=0, atol=0)
    assert not torch.equal(y[:, 32:], x[:, 32:])
    fp = _ChannelBlockStore(KIVIFormat(PathFormat(4, 16), rope_bits=4, block=8, fp_residual=True), 16)
    fp.append(x)
    assert torch.equal(fp.read(torch.float32)[:, 32:], x[:, 32:])  # KIVI's own residual: exact
    # each channel of each block is quantized on its own: reference = per-token quantization of the transpose
    blocks = x[:, :32].reshape(2, 4, 8, 16).transpose(2, 3)
    ref = quantize_dequantize(blocks, PathFormat(4, 8)).transpose(2, 3).reshape(2, 32, 16)
    torch.testing.assert_close(y[:, :32], ref, rtol=0, atol=0)


def test_kivi_isolates_outlier_channels():
    """Per-channel grouping: a large channel does not inflate the error of the others, unlike per-token groups."""
    torch.manual_seed(1)
    x = torch.randn(1, 64, 16)
    x[..., 3] = 40 + 0.5 * torch.randn(64)  # an outlier channel (a slowly rotating RoPE pair looks like this)
    kivi = _ChannelBlockStore(KIVIFormat(PathFormat(4, 16), 4, 16), 16)
    kivi.append(x)
    e_kivi = (kivi.read(torch.float32) - x)[..., [c for c in range(16) if c != 3]].pow(2).mean()
    e_tok = (quantize_dequantize(x, PathFormat(4, 16)) - x)[..., [c for c in range(16) if c != 3]].pow(2).mean()
    assert e_kivi < e_tok / 10


def test_kivi_bytes_per_token():
    d_c, d_r = 32, 16
    fmt = KIVIFormat(PathFormat(4, 16), rope_bits=4, block=8)
    lay = KIVILayout(d_c, d_r, fmt)
    # content 16 codes + 2 groups x (scale, zero) x 2 B; RoPE 8 codes + 16 channels x 2 fields x 2 B / 8 tokens
    assert lay.bytes_per_token == (16 + 8) + (8 + 16 * 4 / 8)
    # with block = the per-token RoPE group size, the metadata costs what per-token groups cost
    same = TokenLayout(d_c, d_r, CacheFormat(PathFormat(4, 16), PathFormat(4, 8))).bytes_per_token
    assert lay.bytes_per_token == same
    # the residual: codes plus one block's metadata, or (KIVI's own residual) BF16
    n = 21
    want = (16 + 8) + (16 * (8 + 8) + 5 * 8 + 16 * 4) / n
    assert abs(lay.bytes_per_token_at(n) - want) < 1e-12
    fp = KIVIFormat(PathFormat(4, 16), rope_bits=4, block=8, fp_residual=True)
    lay_fp = KIVILayout(d_c, d_r, fp)
    assert abs(lay_fp.bytes_per_token_at(n) - ((16 + 8) + (16 * (8 + 8) + 5 * 2 * d_r) / n)) < 1e-12
    assert lay_fp.bytes_per_token_at(1600) < lay_fp.bytes_per_token_at(15)
    # actual stored bytes agree with the layout
    model = tiny_model("deepseek_v3")
    for f, L in ((fmt, lay), (fp, lay_fp)):
        cache = KIVICache(model, f)
        with torch.no_grad():
            model(torch.randint(3, 128, (1, n)), past_key_values=cache, use_cache=True)
        n_layers = len(cache.mla_layers())
        assert cache.nbytes() == pytest.approx(n * L.bytes_per_token_at(n) * n_layers)
        assert cache.bytes_per_token() == L.bytes_per_token * n_layers
    with pytest.raises(UnsupportedFormatError):
        KIVIFormat(PathFormat(4, 16), rope_bits=4, block=12)  # blocks are powers of two
    with pytest.raises(UnsupportedFormatError):
        KIVIFormat(PathFormat(4, 16), rope_bits=8, rope_mode="fp8")


def test_kivi_cache_in_a_model_decode_and_crop():
    torch.manual_seed(2)
    model = tiny_model("minicpm3")
    fmt = KIVIFormat(PathFormat(4, 16), rope_bits=4, block=8)
    ids = torch.randint(3, 128, (2, 19))
    with torch.no_grad():
        cache = KIVICache(model, fmt)
        out = model(ids[:, :16], past_key_values=cache, use_cache=True)
        for t in range(16, 19):  # token-by-token decode
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        # decode logits stay close to an unquantized run
        ref = model(ids).logits[:, -1]
        assert (out.logits[:, -1] - ref).abs().max() < 0.05 * ref.abs().max()
        layer = cache.mla_layers()[0]
        assert cache.get_seq_length() == 19 and layer.rope.quantized_length == 16 and layer.rope.length == 19
        c, r = layer._read(torch.float32)
        assert c.shape[2] == r.shape[2] == 19
        cache.crop(-6)  # into the second quantized block: its kept tokens go back to the residual
        assert cache.get_seq_length() == 13 and layer.rope.quantized_length == 8 and layer.rope.length == 13
        out = model(ids[:, 13:14], past_key_values=cache, use_cache=True)
        assert torch.isfinite(out.logits).all() and cache.get_seq_length() == 14


# -- the harness -----------------------------------------------------------------------------------


def test_named_configs_and_rows():
    c = named_config("INT2/INT4", 16, 8)
    assert (c.content.bits, c.content.group_size, c.rope.bits, c.rope.group_size) == (2, 16, 4, 8)
    assert named_config("fp8").content.mode == "fp8" and not named_config("BF16").quantized
    assert named_config("BF16/INT4").content.bits == 16
    for bad in ("INT5/INT4", "INT4", "foo"):
        with pytest.raises(QuantMLAError):
            named_config(bad)
    with pytest.raises(QuantMLAError, match="unknown method"):
        RowSpec(c, "gptq")
    with pytest.raises(QuantMLAError, match="reference"):
        RowSpec(c, "bf16")
    with pytest.raises(QuantMLAError, match="integer RoPE"):
        RowSpec(named_config("FP8"), "kivi")
    rows = default_rows()
    keys = {r.key for r in rows}
    assert ("BF16", "bf16") in keys and ("FP8", "rtn") in keys
    for cfg in ("INT4/INT4", "INT2/INT4"):
        assert {m for c_, m in keys if c_ == cfg} == {"rtn", "kivi", "hadamard", "quantmla", "quantmla-content", "quantmla-rope",
                                                      "quantmla-rope-channel"}
    assert len(default_rows(quick=True)) < len(rows)


def test_bf16_cache_rounds_to_bf16():
    model = tiny_model("deepseek_v2")
    cache = bf16_cache(model)
    lat, kr = torch.randn(1, 1, 5, 32), torch.randn(1, 1, 5, 16)
    c, r = cache.layers[0].update(lat, kr)
    assert torch.equal(c, lat.bfloat16().float()) and torch.equal(r, kr.bfloat16().float())


def test_evaluate_row_wires_caches_and_calibration():
    """Each method gets its cache and preparation; calibrated methods work on a copy of the model."""
    model = tiny_model("deepseek_v3")
    data = EvalData(ppl=torch.randint(3, 128, (2, 16)), retrieval={1024: [{}], 2048: [{}, {}]},
                    calib_ids=torch.randint(3, 128, (4, 16)), seq_len=16)
    seen = {}

    def ppl_fn(m, tok, chunks, *, seq_len, cache_factory):
        seen["cache"] = cache_factory(m)
        seen["model"] = m
        return {"bits_per_byte": 1.5, "tokens": 30}

    def retr_fn(m, tok, samples, *, cache_factory):
        return {"accuracy": 1.0, "n": len(samples), "correct": len(samples), "per_sample": [True] * len(samples)}

    def calib_fn(m, ids, quant, *, method, paths, seed):
        seen["calib"] = (method, tuple(paths), quant.content.bits, quant.rope.bits)
        m.config.quantization_config = quant.to_dict()
        return {"method": method, "seconds": {"total": 0.1}}

    for method in ("bf16", "rtn", "kivi", "hadamard", "quantmla", "quantmla-content", "quantmla-rope"):
        seen.clear()
        cfg = named_config("BF16" if method == "bf16" else "INT2/INT4", 16, 8)
        row = evaluate_row(model, None, RowSpec(cfg, method, kivi_block=8), data,
                           ppl_fn=ppl_fn, retrieval_fn=retr_fn, calibrate_fn=calib_fn)
        cache = seen["cache"]
        assert isinstance(cache, KIVICache if method == "kivi" else QuantMLACache)
        if method not in ("bf16", "kivi"):
            assert cache.quant.content.bits == 2 and cache.quant.rope.bits == 4
        assert row["retrieval"]["2048"] == {"accuracy": 1.0, "n": 2, "correct": 2, "per_sample": [True, True]}
        assert row["bytes_per_token"] == RowSpec(cfg, method, 8).bytes_per_token(cache.spec) > 0
        if method in CALIBRATED:
            assert seen["calib"] == (*CALIBRATED[method][0:1], CALIBRATED[method][1], 2, 4)
            assert seen["model"] is not model  # the shared model is never modified
            assert row["calibration"]["seconds"] == {"total": 0.1}
        else:
            assert "calib" not in seen and seen["model"] is model
    assert getattr(model.config, "quantization_config", None) is None
    with pytest.raises(QuantMLAError, match="calibration data"):
        evaluate_row(model, None, RowSpec(named_config("INT4/INT4", 16, 8), "quantmla"),
                     EvalData(ppl=data.ppl, seq_len=16), ppl_fn=ppl_fn, retrieval_fn=retr_fn, calibrate_fn=calib_fn)


# -- the table -------------------------------------------------------------------------------------


DATA = {"heldout": "heldout", "kind": "code", "seq_len": 64, "ppl_chunks": 2, "retrieval_n": 10,
        "retrieval_lengths": [1024], "retrieval_formats": ["key"], "seed": 0}


def _row(model, config, method, bpb, acc, nbytes, data=DATA, setup=None):
    return {"model": model, "config": config, "method": method, "format": config, "bits_per_byte": bpb,
            "retrieval": {"1024": {"accuracy": acc, "n": 10}}, "bytes_per_token": nbytes,
            "bf16_bytes_per_token": 96, "eval_mode": "every read quantized incl. prefill", "data": dict(data),
            "setup": {} if method == "bf16" else dict(setup or {"content_group": 16, "rope_group": 8, "fp_window": 0})}


def test_table_writer(tmp_path):
    rows = [_row("m", "INT4/INT4", "rtn", 2.2, 0.5, 40), _row("m", "BF16", "bf16", 2.0, 0.8, 96),
            _row("m", "INT4/INT4", "quantmla", 2.01, 0.8, 40), _row("m", "INT2/INT4", "rtn", 2.5, 0.2, 32),
            _row("m", "INT2/INT4", "quantmla", 2.1, 0.7, 32)]
    from quantmla.evaluation import claims

    jpath, mpath = table.write(rows, str(tmp_path), claim_lines=claims.claim_lines)
    doc = json.loads(Path(jpath).read_text())
    md = Path(mpath).read_text()
    lines = [l for l in md.splitlines() if l.startswith("| ") and not l.startswith("| config")]
    assert lines[0].startswith("| BF16 | — | bf16 | 96 |")  # BF16 first, then by decreasing bytes
    assert [l.split(" | ")[3] for l in lines] == ["96", "40", "40", "32", "32"]
    by = {(r["config"], r["method"]): r for r in doc["rows"]}
    assert by[("INT4/INT4", "rtn")]["bpb_increase_pct"] == pytest.approx(10.0)
    assert by[("INT2/INT4", "quantmla")]["retrieval_delta_points"]["1024"] == pytest.approx(-10.0)
    assert "+10.00%" in md and "80.0 (n=10)" in md and doc["data"] == DATA
    assert "goals" not in doc and "Issue" not in md  # no internal sections
    # the claims name the rows they lack instead of comparing against an incomplete set of baselines
    assert "KIVI-style, Hadamard row missing, no comparison claimed" in md
    # merging replaces rows with the same identity and keeps the others
    table.write([_row("m", "INT4/INT4", "rtn", 2.1, 0.6, 40), _row("n", "BF16", "bf16", 3.0, 0.1, 96)], str(tmp_path),
                base=table.load(str(tmp_path)))
    doc = json.loads(Path(jpath).read_text())
    assert len(doc["rows"]) == 6
    assert {(r["model"], r["config"], r["method"]): r for r in doc["rows"]}[("m", "INT4/INT4", "rtn")]["bits_per_byte"] == 2.1
    # another group setting is another row, side by side
    g2 = _row("m", "INT4/INT4", "rtn", 2.05, 0.6, 52, setup={"content_group": 8, "rope_group": 4, "fp_window": 0})
    table.write([g2], str(tmp_path), base=table.load(str(tmp_path)))
    assert len(table.load(str(tmp_path))) == 7
    bad = _row("m", "INT4/INT4", "rtn", 2.1, 0.6, 40)
    del bad["bytes_per_token"]
    with pytest.raises(QuantMLAError, match="bytes_per_token"):
        table.write([bad], str(tmp_path))


def test_table_stores_per_sample_outcomes_as_a_string_and_loads_them_as_booleans(tmp_path):
    """per_sample lists are a string of 0 and 1 in the file and booleans again after load; the paired interval
    reads them; a file written with lists loads the same; a string of other characters is refused by name."""
    outcomes = {"BF16": [True] * 8 + [False, True], "INT2/INT4": [True, False] * 5}
    rows = []
    for config, method, bpb in (("BF16", "bf16", 2.0), ("INT2/INT4", "rtn", 2.4)):
        r = _row("m", config, method, bpb, sum(outcomes[config]) / 10, 32 if method == "rtn" else 96)
        r["retrieval"]["1024"]["per_sample"] = list(outcomes[config])
        rows.append(r)
    jpath, _ = table.write(rows, str(tmp_path))
    text = Path(jpath).read_text()
    assert '"per_sample":"1010101010"' in text.replace(" ", "") and "true" not in text
    back = {r["config"]: r for r in table.load(str(tmp_path))}
    assert back["INT2/INT4"]["retrieval"]["1024"]["per_sample"] == outcomes["INT2/INT4"]
    assert back["BF16"]["retrieval"]["1024"]["per_sample"] == outcomes["BF16"]
    assert rows[1]["retrieval"]["1024"]["per_sample"] == outcomes["INT2/INT4"]  # the caller's rows stay lists
    assert back["INT2/INT4"]["retrieval_delta_ci"]["1024"][0] < -30 < back["INT2/INT4"]["retrieval_delta_ci"]["1024"][1]

    doc = json.loads(text)  # a file of lists (written before) loads the same
    for r in doc["rows"]:
        r["retrieval"]["1024"]["per_sample"] = outcomes[r["config"]]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "accuracy.json").write_text(json.dumps(doc))
    assert [r["retrieval"]["1024"]["per_sample"] for r in table.load(str(tmp_path / "old"))] == \
        [outcomes[r["config"]] for r in doc["rows"]]
    doc["rows"][0]["retrieval"]["1024"]["per_sample"] = "10x1"
    (tmp_path / "old" / "accuracy.json").write_text(json.dumps(doc))
    with pytest.raises(QuantMLAError, match="not a string of 0 and 1"):
        table.load(str(tmp_path / "old"))


def test_table_refuses_mixed_data_and_silent_replacement(tmp_path):
    """Rows of other data settings never join a file, and never get a Δ from a BF16 row of other data."""
    out = str(tmp_path)
    table.write([_row("m", "BF16", "bf16", 2.0, 0.8, 96), _row("m", "INT4/INT4", "rtn", 2.2, 0.5, 40)], out)
    before = Path(out, "accuracy.json").read_text()
    other = dict(DATA, ppl_chunks=64, retrieval_n=100)
    with pytest.raises(table.ResultMergeError, match=r"ppl_chunks 2 \(the file\) vs 64 \(this run\), retrieval_n 10"):
        table.check_merge(table.load(out), other, replace=False, out_dir=out)
    with pytest.raises(table.ResultMergeError, match="mix data settings"):
        table.write([_row("m", "INT4/INT4", "kivi", 2.1, 0.5, 40, data=other)], out, base=table.load(out))
    assert Path(out, "accuracy.json").read_text() == before
    # an existing row is replaced only when asked
    key = table.row_key(_row("m", "INT4/INT4", "rtn", 0, 0, 40))
    with pytest.raises(table.ResultMergeError, match="--replace-rows"):
        table.check_merge(table.load(out), DATA, replace=False, out_dir=out, new_keys=[key])
    table.check_merge(table.load(out), DATA, replace=True, out_dir=out, new_keys=[key])
    # no Δ against a BF16 row measured on other data
    rows = table.relative([_row("m", "BF16", "bf16", 2.0, 0.8, 96), _row("m", "INT4/INT4", "rtn", 1.9, 0.5, 40, data=other)])
    assert rows[1]["bpb_increase_pct"] is None and "retrieval_delta_points" not in rows[1]


# -- the command -----------------------------------------------------------------------------------


def test_eval_command_end_to_end(checkpoint, tmp_path):
    from quantmla.cli import main

    out = tmp_path / "res"
    rc = main(["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), "--config", "BF16", "INT4/INT4",
               "--method", "bf16", "rtn", "kivi", "--seq-len", "64", "--ppl-chunks", "2", "--retrieval-n", "2",
               "--lengths", "1024", "--content-group", "16", "--rope-group", "8", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "accuracy.json").read_text())
    assert {(r["config"], r["method"]) for r in doc["rows"]} == {("BF16", "bf16"), ("INT4/INT4", "rtn"), ("INT4/INT4", "kivi")}
    for r in doc["rows"]:
        assert r["model"] == "tiny" and r["retrieval"]["1024"]["n"] == 2 and r["bits_per_byte"] > 0
        assert r["eval_mode"].startswith("every read quantized incl. prefill")
    bf16 = next(r for r in doc["rows"] if r["method"] == "bf16")
    assert bf16["bytes_per_token"] == (32 + 16) * 2
    md = (out / "accuracy.md").read_text()
    assert "| INT4/INT4 | g16/g8 | kivi | 40 |" in md and "| BF16 | — | bf16 | 96 |" in md
    # --resume skips rows already there with the same settings
    rc = main(["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), "--config", "BF16",
               "--method", "bf16", "--seq-len", "64", "--ppl-chunks", "2", "--retrieval-n", "2", "--lengths", "1024",
               "--content-group", "16", "--rope-group", "8", "--out", str(out), "--resume"])
    assert rc == 0 and json.loads((out / "accuracy.json").read_text())["rows"] == doc["rows"]
    # a KIVI row at another token block is another row: --resume runs it, beside the one at the RoPE group's 8
    rc = main(["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), "--config", "INT4/INT4",
               "--method", "kivi", "--seq-len", "64", "--ppl-chunks", "2", "--retrieval-n", "2", "--lengths", "1024",
               "--content-group", "16", "--rope-group", "8", "--kivi-block", "16", "--out", str(out), "--resume"])
    kivi = [r for r in json.loads((out / "accuracy.json").read_text())["rows"] if r["method"] == "kivi"]
    assert rc == 0 and sorted(r.get("setup", {}).get("kivi_block", 8) for r in kivi) == [8, 16]


def _eval_args(*argv):
    import argparse

    from quantmla.evaluation.command import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_rows_run_in_the_order_given():
    """--rows CONFIG:METHOD[:C/R]: rows in the order named, each at its own groups or at every --groups setting;
    a pair that cannot run is an error (never skipped), and --rows excludes --config/--method."""
    from quantmla.cli import CLIError
    from quantmla.evaluation.command import rows_for

    rows = rows_for(_eval_args("--groups", "128/32", "64/32", "--rows", "BF16:bf16", "INT4/INT4:quantmla:128/32",
                               "INT4/INT4:rtn", "FP8:rtn", "INT2/INT4:kivi:g64/g32"))  # BF16, FP8: once
    groups = lambda r: (r.config.content.group_size, r.config.rope.group_size)  # noqa: E731
    assert [(r.config.name, r.method) for r in rows] == [
        ("BF16", "bf16"), ("INT4/INT4", "quantmla"), ("INT4/INT4", "rtn"), ("INT4/INT4", "rtn"), ("FP8", "rtn"),
        ("INT2/INT4", "kivi")]
    assert [groups(r) for r in rows[1:4]] + [groups(rows[5])] == [(128, 32), (128, 32), (64, 32), (64, 32)]
    assert rows[5].kivi_block == 32
    windows = rows_for(_eval_args("--fp-window", "0", "16", "--rows", "BF16:bf16", "INT4/INT4:rtn"))
    assert [r.fp_window for r in windows] == [0, 0, 16]
    for argv, msg in ((["--rows", "INT4/INT4"], "give CONFIG:METHOD"), (["--rows", "INT4/INT4:rtn:64"], "CONTENT/ROPE"),
                      (["--rows", "FP8:kivi"], "integer RoPE"), (["--rows", "INT4/INT4:bf16"], "reference"),
                      (["--rows", "INT5/INT4:rtn"], "unsupported bit width 5"),
                      (["--rows", "BF16:bf16", "--method", "rtn"], "leave out --config and --method")):
        with pytest.raises((CLIError, QuantMLAError), match=msg):
            rows_for(_eval_args(*argv))


def test_eval_rows_end_to_end(checkpoint, tmp_path):
    """--rows through the command; --calib-device reaches the calibration and its rows record it; --resume
    skips the rows already there."""
    from quantmla.cli import main

    out = tmp_path / "res"
    base = ["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), "--seq-len", "64",
            "--ppl-chunks", "2", "--retrieval-n", "1", "--lengths", "1024", "--out", str(out)]
    assert main(base + ["--calib-n", "4", "--calib-device", "cpu", "--rows", "INT4/INT4:rtn:16/8", "BF16:bf16",
                        "INT4/INT4:kivi:32/16", "INT4/INT4:hadamard:16/8"]) == 0
    doc = json.loads((out / "accuracy.json").read_text())
    assert {(r["config"], r["method"], r["setup"].get("content_group")) for r in doc["rows"]} == {
        ("INT4/INT4", "rtn", 16), ("BF16", "bf16", None), ("INT4/INT4", "kivi", 32), ("INT4/INT4", "hadamard", 16)}
    assert [r["calibration"]["fit_device"] for r in doc["rows"] if "calibration" in r] == ["cpu"]
    assert main(base + ["--resume", "--rows", "BF16:bf16", "INT4/INT4:rtn:16/8"]) == 0  # nothing new to run
    assert json.loads((out / "accuracy.json").read_text())["rows"] == doc["rows"]


def test_eval_calibration_rows_of_their_own_length(checkpoint, tmp_path, monkeypatch):
    """--calib-len: the calibrated row is fitted on rows of that many tokens (not --seq-len), records it in its
    setup (a row of its own beside the default's) and shows it in the table."""
    import quantmla.evaluation.harness as H
    from quantmla.cli import main

    seen = []
    real = H.load_eval_data
    monkeypatch.setattr(H, "load_eval_data", lambda *a, **k: seen.append(k) or real(*a, **k))
    out = tmp_path / "res"
    base = ["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), "--seq-len", "64",
            "--ppl-chunks", "2", "--retrieval-n", "1", "--lengths", "1024", "--calib-n", "2", "--out", str(out),
            "--rows", "INT4/INT4:hadamard:16/8"]
    assert main(base) == 0 and main(base + ["--calib-len", "128"]) == 0
    assert [k["calib_len"] for k in seen] == [64, 128]
    rows = json.loads((out / "accuracy.json").read_text())["rows"]
    assert sorted(r["setup"].get("calib_len", 0) for r in rows) == [0, 128]
    assert "calib 2 x 128" in (out / "accuracy.md").read_text()


def test_rope_block_rows_and_bytes():
    """--rope-block: the per-channel RoPE methods' scales per block of that many tokens (the KIVI-style baseline's
    bytes at 16 tokens, its block at g32/g16, d_c 128, d_r 32); other methods keep theirs; sizes that do not divide the page
    are refused."""
    from quantmla.cli import CLIError
    from quantmla.evaluation.command import rows_for
    from types import SimpleNamespace

    spec = SimpleNamespace(d_c=128, d_r=32)  # the shipped models' cache geometry
    rows = rows_for(_eval_args("--rope-block", "16", "--rows", "INT4/INT4:quantmla-rope-channel:32/16",
                               "INT4/INT4:kivi:32/16", "INT2/INT4:quantmla-rope-channel:32/16"))
    assert [r.rope_page for r in rows if r.method != "kivi"] == [16, 16]
    assert [r.bytes_per_token(spec) for r in rows] == [104.0, 104.0, 72.0]
    (page,) = rows_for(_eval_args("--rows", "INT4/INT4:quantmla-rope-channel:32/16"))
    assert page.rope_page == 64 and page.bytes_per_token(spec) == 98.0
    for bad in ("48", "128", "0"):
        with pytest.raises(CLIError, match=f"--rope-block {bad}: give a power of two"):
            rows_for(_eval_args("--rope-block", bad, "--rows", "INT4/INT4:quantmla-rope-channel"))
    with pytest.raises(CLIError, match="none of these rows uses one"):  # it would change nothing
        rows_for(_eval_args("--rope-block", "16", "--rows", "INT4/INT4:kivi:32/16"))


def test_kivi_block_needs_a_kivi_row():
    """--kivi-block without a KIVI-style row would change nothing and leave no trace in the results: refused, as
    --rope-block is; with one it sets that row's block."""
    from quantmla.cli import CLIError
    from quantmla.evaluation.command import rows_for

    with pytest.raises(CLIError, match="--kivi-block 16 sets the KIVI-style baseline's token block; none of these"):
        rows_for(_eval_args("--kivi-block", "16", "--config", "INT4/INT4", "--method", "rtn", "quantmla"))
    rows = rows_for(_eval_args("--kivi-block", "16", "--rows", "INT4/INT4:rtn:32/16", "INT4/INT4:kivi:32/16"))
    assert [(r.method, r.kivi_block) for r in rows if r.method == "kivi"] == [("kivi", 16)]


def test_eval_rope_block_recorded(checkpoint, tmp_path):
    """A row with --rope-block is a row of its own (its setup says the block) beside the page-grouped one."""
    from quantmla.cli import main

    out = tmp_path / "res"
    base = ["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), "--seq-len", "64",
            "--ppl-chunks", "2", "--retrieval-n", "1", "--lengths", "1024", "--calib-n", "2", "--calib-steps", "2",
            "--out", str(out), "--rows", "INT4/INT4:quantmla-rope-channel:16/8"]
    assert main(base) == 0 and main(base + ["--rope-block", "16"]) == 0
    rows = json.loads((out / "accuracy.json").read_text())["rows"]
    by_block = {r["setup"].get("rope_block", 0): r["bytes_per_token"] for r in rows}
    assert sorted(by_block) == [0, 16] and by_block[0] < by_block[16]
    assert "RoPE ch/16" in (out / "accuracy.md").read_text()


def test_eval_output_rules(checkpoint, tmp_path, monkeypatch, capsys):
    """The default output is out/eval, outside the tracked tree; a run on other data settings is refused
    before any work, naming the settings; existing rows are replaced only with --replace-rows."""
    from quantmla.cli import main

    monkeypatch.chdir(tmp_path)
    base = ["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), "--config", "BF16", "INT4/INT4",
            "--method", "bf16", "rtn", "--seq-len", "64", "--retrieval-n", "2", "--lengths", "1024",
            "--content-group", "16", "--rope-group", "8"]
    assert main(base + ["--ppl-chunks", "2"]) == 0
    jpath = tmp_path / "out" / "eval" / "accuracy.json"
    first = jpath.read_text()
    assert len(json.loads(first)["rows"]) == 2

    def no_work(*a, **k):
        raise AssertionError("weights were loaded before the output was checked")

    monkeypatch.setattr("quantmla.model.load.load_model", no_work)
    assert main(base + ["--ppl-chunks", "1"]) == 2
    err = capsys.readouterr().err
    assert "ppl_chunks 2 (the file) vs 1 (this run)" in err and "--overwrite" in err
    assert main(base + ["--ppl-chunks", "2"]) == 2  # the same rows again
    assert "already has 2 of these rows" in capsys.readouterr().err and jpath.read_text() == first
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert main(base + ["--ppl-chunks", "2", "--replace-rows", "--method", "rtn"]) == 0
    assert len(json.loads(jpath.read_text())["rows"]) == 2
    assert main(base + ["--ppl-chunks", "1", "--overwrite", "--config", "BF16", "--method", "bf16"]) == 0
    doc = json.loads(jpath.read_text())
    assert [r["method"] for r in doc["rows"]] == ["bf16"] and doc["data"]["ppl_chunks"] == 1


def test_eval_refuses_bad_sizes_up_front(checkpoint, tmp_path, monkeypatch, capsys):
    """Zero chunks, lengths beyond the model's positions or without samples, and an unwritable output are
    refused before the model is loaded (they used to write a 0.0 bits/byte row or an empty retrieval)."""
    from quantmla.cli import main

    def no_work(*a, **k):
        raise AssertionError("weights were loaded before the arguments were checked")

    monkeypatch.setattr("quantmla.model.load.load_model", no_work)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    base = ["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), "--config", "INT4/INT4",
            "--method", "quantmla", "--content-group", "16", "--rope-group", "8", "--seq-len", "64"]
    for extra, msg in ((["--ppl-chunks", "0"], "--ppl-chunks 0: must be at least 1"),
                       (["--retrieval-n", "0"], "--retrieval-n 0: must be at least 1"),
                       (["--lengths", "8192"], "has max_position_embeddings 2048; ask for at most 2048 tokens"),
                       (["--lengths", "512"], "no key-retrieval samples of that length"),
                       (["--lengths", "1024", "--retrieval-n", "3"], "holds 2 key-retrieval samples of 1024 tokens"),
                       (["--fp-window", "-1"], "--fp-window"),
                       (["--calib-len", "1"], "--calib-len 1: must be at least 2"),
                       (["--lengths", "1024", "--calib-len", "4096"], "--calib-len 4096: "),
                       (["--lengths", "1024", "--retrieval-n", "2", "--out", str(blocker / "sub")], "cannot write into")):
        out = [] if "--out" in extra else ["--out", str(tmp_path / "o")]
        assert main(base + out + extra) == 2, extra
        assert msg in capsys.readouterr().err, extra
    assert not (tmp_path / "o" / "accuracy.json").exists()


def test_eval_command_errors(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantmla.cli import main

    assert main(["eval", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "empty"), "--out", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(llama)
    assert main(["eval", str(llama), "--out", str(tmp_path)]) == 2
    assert "not a Multi-Head Latent Attention model" in capsys.readouterr().err
    assert main(["eval", str(llama), "--config", "INT5/INT4", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "accuracy.json").exists()
    capsys.readouterr()
    assert main(["eval", str(llama), "--kivi-block", "0", "--out", str(tmp_path)]) == 2
    assert "--kivi-block 0: give KIVI's token block" in capsys.readouterr().err


def test_from_json_regenerates_and_merges(tmp_path, capsys):
    """`eval --from-json` rewrites the table from the JSON; several files of one data setting merge into --out,
    files of other data or with the same row at other figures are refused."""
    from quantmla.cli import main

    a, b, c = (str(tmp_path / n) for n in "abc")
    table.write([_row("m", "BF16", "bf16", 2.0, 0.8, 96), _row("m", "INT4/INT4", "rtn", 2.2, 0.5, 40)], a)
    table.write([_row("n", "BF16", "bf16", 3.0, 0.8, 96), _row("n", "INT4/INT4", "quantmla", 3.03, 0.5, 40)], b)
    Path(a, "accuracy.md").write_text("stale")
    assert main(["eval", "--from-json", f"{a}/accuracy.json"]) == 0
    assert "| INT4/INT4 | g16/g8 | rtn | 40 | 2.2000 | +10.00% |" in Path(a, "accuracy.md").read_text()
    assert main(["eval", "--from-json", f"{a}/accuracy.json", f"{b}/accuracy.json", "--out", c]) == 0
    assert {r["model"] for r in table.load(c)} == {"m", "n"}
    # rows that read no calibration data and repeat one with the same figures merge into one; other figures refuse
    assert main(["eval", "--from-json", f"{a}/accuracy.json", f"{a}/accuracy.json", "--out", f"{c}2"]) == 0
    assert len(table.load(f"{c}2")) == 2
    table.write([_row("m", "INT4/INT4", "rtn", 2.3, 0.5, 40)], f"{a}3")
    assert main(["eval", "--from-json", f"{a}/accuracy.json", f"{a}3/accuracy.json", "--out", c]) == 2
    assert "already has 1 of these rows" in capsys.readouterr().err
    table.write([_row("n", "BF16", "bf16", 3.0, 0.8, 96, data=dict(DATA, seq_len=128))], b, )
    assert main(["eval", "--from-json", f"{a}/accuracy.json", f"{b}/accuracy.json", "--out", c]) == 2
    assert "seq_len 64" in capsys.readouterr().err
    # a table in --out that is not an input is never replaced unasked
    d = str(tmp_path / "d")
    table.write([_row("k", "BF16", "bf16", 1.0, 0.8, 96)], d)
    assert main(["eval", "--from-json", f"{a}/accuracy.json", "--out", d]) == 2
    assert "holds an accuracy.json that is not among the --from-json files" in capsys.readouterr().err
    assert [r["model"] for r in table.load(d)] == ["k"]
    assert main(["eval", "--from-json", f"{a}/accuracy.json", "--out", d, "--overwrite"]) == 0
    assert {r["model"] for r in table.load(d)} == {"m"}
    # a README without the summary block's markers is refused before the table is written
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    Path(a, "accuracy.md").write_text("before")
    assert main(["eval", "--from-json", f"{a}/accuracy.json", "--readme", str(readme)]) == 2
    assert Path(a, "accuracy.md").read_text() == "before" and readme.read_text() == "# no markers\n"


def test_eval_shows_progress_while_calibrating(checkpoint, tmp_path, capsys):
    """A calibrated row shows a progress bar while it calibrates ."""
    from quantmla.cli import main

    rc = main(["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), "--config", "INT4/INT4",
               "--method", "hadamard", "--seq-len", "64", "--ppl-chunks", "2", "--retrieval-n", "1", "--lengths", "1024",
               "--calib-n", "4", "--content-group", "16", "--rope-group", "8", "--out", str(tmp_path / "res")])
    assert rc == 0
    err = capsys.readouterr().err
    assert "capturing activations" in err
