"""Result rows carry fingerprints of their checkpoint and held-out files (``evaluation.provenance``): a table refuses
rows of another checkpoint or held-out set of the same name."""

import json
import shutil

from quantmla.cli import main
from quantmla.evaluation.provenance import data_fingerprint, model_fingerprint

ARGS = ["--config", "BF16", "--method", "bf16", "--seq-len", "64", "--ppl-chunks", "2", "--retrieval-n", "2",
        "--lengths", "1024", "--content-group", "16", "--rope-group", "8"]


def test_rows_of_another_checkpoint_or_held_out_set_are_refused(checkpoint, tmp_path, capsys):
    """A copied checkpoint and held-out set merge; one flipped weight bit, one more held-out document or two models
    of one directory name are refused before any weights are read, the file unchanged, and --resume keeps nothing
    of them."""
    out = tmp_path / "res"
    same = [*ARGS, "--out", str(out), "--resume"]
    assert main(["eval", str(checkpoint / "tiny"), "--heldout", str(checkpoint / "heldout"), *same]) == 0
    rows = json.loads((out / "accuracy.json").read_text())["rows"]
    assert {r["provenance"]["model"] for r in rows} == {model_fingerprint(checkpoint / "tiny")}
    assert {r["provenance"]["heldout"] for r in rows} == {data_fingerprint(checkpoint / "heldout")}
    other = tmp_path / "other"
    shutil.copytree(checkpoint / "tiny", other / "tiny")
    shutil.copytree(checkpoint / "heldout", other / "heldout")
    assert main(["eval", str(other / "tiny"), "--heldout", str(other / "heldout"), *same]) == 0  # copies: the same
    w = other / "tiny" / "model.safetensors"
    b = bytearray(w.read_bytes())
    b[-1] ^= 1  # one bit of the last weight
    w.write_bytes(bytes(b))
    before = (out / "accuracy.json").read_text()
    capsys.readouterr()
    assert main(["eval", str(other / "tiny"), "--heldout", str(checkpoint / "heldout"), *same]) == 2
    assert "rows of a model named 'tiny' whose checkpoint differs" in capsys.readouterr().err
    with open(other / "heldout" / "code.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more held-out document"}) + "\n")
    assert main(["eval", str(checkpoint / "tiny"), "--heldout", str(other / "heldout"), *same]) == 2
    assert "held-out files named 'heldout' whose contents differ" in capsys.readouterr().err
    assert (out / "accuracy.json").read_text() == before
    assert main(["eval", str(checkpoint / "tiny"), str(other / "tiny"), "--heldout", str(checkpoint / "heldout"),
                 *same]) == 2
    assert "share the directory name 'tiny'" in capsys.readouterr().err


def test_fingerprints_read_large_shards_in_pieces(tmp_path, monkeypatch):
    """A checkpoint's fingerprint covers its config, tokenizer and weights, not its other files, wherever it lies; a
    shard past WHOLE_FILE_BYTES is read as its safetensors header and sampled pieces, which a change inside a piece
    or the header moves."""
    from quantmla.evaluation import provenance

    monkeypatch.setattr(provenance, "WHOLE_FILE_BYTES", 1 << 16)
    monkeypatch.setattr(provenance, "SAMPLE_BYTES", 1 << 10)
    d = tmp_path / "a"
    d.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [65536], "data_offsets": [0, 262144]}}).encode()
    data = bytearray(8 + len(header) + 262144)
    data[:8] = len(header).to_bytes(8, "little")
    data[8:8 + len(header)] = header
    (d / "model.safetensors").write_bytes(bytes(data))
    (d / "config.json").write_text("{}")
    fp = provenance.model_fingerprint(d)
    (d / "README.md").write_text("notes")
    shutil.copytree(d, tmp_path / "b")
    assert provenance.model_fingerprint(d) == provenance.model_fingerprint(tmp_path / "b") == fp
    last = len(data) - 1  # inside the last sampled piece
    for where in (last, 8 + header.index(b"65536")):
        changed = bytearray(data)
        changed[where] ^= 1
        (d / "model.safetensors").write_bytes(bytes(changed))
        assert provenance.model_fingerprint(d) != fp, where
