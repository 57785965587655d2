"""Result files: strict JSON, the same document back, lists of scalars on one line."""

import json
import math

import pytest

from quantmla import jsonfile


def test_dumps_gives_the_same_document_back_with_scalar_lists_on_one_line():
    doc = {"rows": [{"per_sample": [True, False, True], "ms": [1.5, 2, None], "name": "é\ud800"}, {}],
           "empty": [], "nested": [[1, 2], [3]], "n": 3, "s": "a\nb"}
    text = jsonfile.dumps(doc)
    assert json.loads(text) == doc
    assert '"per_sample": [true, false, true]' in text and '"ms": [1.5, 2, null]' in text
    small = {"a": [1, "x"], "b": [[1, 2], {"c": []}]}
    assert jsonfile.dumps(small) == '{\n "a": [1, "x"],\n "b": [\n  [1, 2],\n  {\n   "c": []\n  }\n ]\n}'


def test_strict_replaces_non_finite_floats_and_write_refuses_nothing(tmp_path):
    doc = {"a": [1.0, math.nan, math.inf], "b": (-math.inf, 2), "c": {"d": math.nan}}
    path = tmp_path / "r.json"
    jsonfile.write(path, doc)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text and text.endswith("}\n")
    assert json.loads(text) == {"a": [1.0, None, None], "b": [None, 2], "c": {"d": None}}


def test_default_serializes_what_json_cannot_and_unknown_objects_fail_without_it():
    class Thing:
        def __str__(self):
            return "thing"

    assert json.loads(jsonfile.dumps({"x": Thing(), "y": [Thing()]}, default=str)) == {"x": "thing", "y": ["thing"]}
    with pytest.raises(TypeError):
        jsonfile.dumps({"x": Thing()})


def test_keys_are_written_as_json_dumps_writes_them():
    doc = {True: 1, None: 2, 1.5: 3, 7: 4, "é": 5, "nan": {float("nan"): 6}}
    assert json.loads(jsonfile.dumps(doc)) == json.loads(json.dumps(doc))
    assert jsonfile.dumps({"é": 1}).isascii()
    with pytest.raises(TypeError, match="not tuple"):
        jsonfile.dumps({(1, 2): 3})


def test_the_labs_save_writes_numpy_and_torch_scalars_as_numbers_and_refuses_other_objects(tmp_path):
    import numpy as np
    import torch

    from quantmla_lab.bench.common import save

    path = tmp_path / "sub" / "r.json"
    save({"a": np.float32(1.5), "b": torch.tensor(2), "c": [np.int64(3)], "d": np.float32("nan"),
          "e": torch.tensor(float("inf"))}, str(path))
    assert json.loads(path.read_text()) == {"a": 1.5, "b": 2, "c": [3], "d": None, "e": None}
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()
    for bad, name in ((np.zeros(3), "ndarray"), (torch.ones(1, 1), "Tensor"), (np.longdouble(1), "longdouble")):
        with pytest.raises(TypeError, match=f"a {name} is not JSON"):
            save({"x": bad}, str(path))
    save({"x": torch.float16}, str(path), default=str)
    assert json.loads(path.read_text()) == {"x": "torch.float16"}
