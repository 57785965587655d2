"""Retrieval intervals: Wilson's score interval and Newcombe's paired difference, and how the table uses them."""

import json
from pathlib import Path

import numpy as np
import pytest

from quantmla.evaluation import table
from quantmla.evaluation.intervals import paired_difference, wilson


def test_wilson_known_values_and_edges():
    # 98 of 100: (0.9300, 0.9945), the textbook Wilson interval
    lo, hi = wilson(98, 100)
    assert lo == pytest.approx(0.929988, abs=1e-6) and hi == pytest.approx(0.994498, abs=1e-6)
    lo, hi = wilson(0, 50)  # keeps a width at 0 successes, never leaves [0, 1]
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(0.071348, abs=1e-6)
    lo, hi = wilson(200, 200)
    assert hi == 1.0 and lo == pytest.approx(0.981155, abs=1e-6)
    with pytest.raises(ValueError, match="successes"):
        wilson(5, 4)


def test_paired_difference_point_and_shape():
    x = [True] * 21 + [False] * 23
    y = [True] * 12 + [False] * 9 + [True] * 2 + [False] * 21
    d, lo, hi = paired_difference(x, y)
    assert d == pytest.approx(7 / 44) and lo < d < hi and -1 <= lo and hi <= 1
    # swapping the methods mirrors the interval
    d2, lo2, hi2 = paired_difference(y, x)
    assert d2 == pytest.approx(-d) and lo2 == pytest.approx(-hi) and hi2 == pytest.approx(-lo)
    # identical outcomes: difference 0, and still an interval of positive width around it
    d, lo, hi = paired_difference([True] * 190 + [False] * 10, [True] * 190 + [False] * 10)
    assert d == 0 and lo < 0 < hi and hi - lo > 0.005
    with pytest.raises(ValueError, match="same samples"):
        paired_difference([True], [True, False])


@pytest.mark.parametrize("p_both, p_x_only, p_y_only", [(0.90, 0.02, 0.04), (0.70, 0.10, 0.05), (0.97, 0.0, 0.02)])
def test_paired_difference_covers_about_95_percent(p_both, p_x_only, p_y_only):
    """Simulated pairs of n = 200: the interval holds the true difference in about 95 % of draws."""
    rng = np.random.default_rng(0)
    n, reps, hits = 200, 1500, 0
    probs = [p_both, p_x_only, p_y_only, 1 - p_both - p_x_only - p_y_only]
    truth = p_x_only - p_y_only
    for _ in range(reps):
        cell = rng.choice(4, size=n, p=probs)
        x = (cell == 0) | (cell == 1)
        y = (cell == 0) | (cell == 2)
        _, lo, hi = paired_difference(x.tolist(), y.tolist())
        hits += lo <= truth <= hi
    assert 0.92 <= hits / reps <= 0.99


def test_table_gives_intervals_where_rows_kept_their_samples(tmp_path):
    data = {"heldout": "heldout", "kind": "code", "seq_len": 64, "ppl_chunks": 2, "retrieval_n": 200,
            "retrieval_lengths": [1024], "retrieval_formats": ["key"], "seed": 0}

    def row(config, method, per_sample):
        k = sum(per_sample)
        return {"model": "m", "config": config, "method": method, "format": config, "bits_per_byte": 2.0,
                "retrieval": {"1024": {"accuracy": k / len(per_sample), "n": len(per_sample), "correct": k,
                                       "per_sample": per_sample}},
                "bytes_per_token": 96 if method == "bf16" else 40, "bf16_bytes_per_token": 96,
                "eval_mode": "every read quantized incl. prefill", "data": dict(data),
                "setup": {} if method == "bf16" else {"content_group": 16, "rope_group": 8, "fp_window": 0}}

    bf = [True] * 190 + [False] * 10
    q = [True] * 180 + [False] * 10 + [False] * 10  # 10 fewer right, all among BF16's right ones
    jpath, mpath = table.write([row("BF16", "bf16", bf), row("INT4/INT4", "quantmla", q)], str(tmp_path))
    doc = json.loads(Path(jpath).read_text())
    by = {r["method"]: r for r in doc["rows"]}
    assert "retrieval_delta_ci" not in by["bf16"]
    lo, hi = by["quantmla"]["retrieval_delta_ci"]["1024"]
    assert by["quantmla"]["retrieval_delta_points"]["1024"] == pytest.approx(-5.0) and lo < -5.0 < hi < 0
    md = Path(mpath).read_text()
    assert "95.0 [91.0, 97.3] (n=200)" in md  # Wilson 190/200
    assert f"INT4/INT4 g16/g8 quantmla: 1K -5.0 [{lo:+.1f}, {hi:+.1f}]" in md
