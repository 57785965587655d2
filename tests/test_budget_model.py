"""The KV-budget model on the CPU: each format's page count follows its layout, the replay at a measured run's own
budget gives that run's step counts, preemptions and recomputed tokens exactly, a tighter budget preempts more, and
budgets or results it cannot model are refused with the reason."""

import json

import pytest

from quantmla_lab.bench.serving.budget_model import GIB, at_budget, main, page_bytes
from quantmla_lab.bench.serving.chunk_model import PROFILE, Prices, step_costs

RUN = "lab/results/serving/long_1.26gib_warmup_h200.json"


@pytest.fixture(scope="module")
def measured():
    with open(RUN) as f, open(PROFILE) as g:
        return json.load(f), json.load(g)


def test_page_bytes_give_the_runs_pages_and_a_rope_stage_is_refused(measured):
    res, _ = measured
    want = {"bf16": 1152, "fp8": 656, "int4/int4": 308, "int2/int4": 180}  # bytes a token and layer, d_c 512, d_r 64
    for run in res["runs"]:
        pb = page_bytes(res, run["method"])
        assert pb == want[run["method"]] * 64 * 27
        assert int(res["settings"]["budgets_gib"][0] * GIB) // pb == run["pages"]
    staged = json.loads(json.dumps(res))
    staged["runs"][2]["pages"] -= 3  # as where a RoPE stage took part of the budget
    with pytest.raises(SystemExit, match="its budget held more than pages"):
        page_bytes(staged, "int4/int4")
    with pytest.raises(SystemExit, match="int4/int4-page16: its budget also held a RoPE stage"):
        page_bytes(res, "int4/int4-page16")


@pytest.mark.parametrize("method", ["bf16", "int4/int4"])
def test_the_runs_own_budget_gives_its_steps_and_preemptions(measured, method):
    res, prof = measured
    run = next(r for r in res["runs"] if r["method"] == method)
    pr = Prices(run, res["settings"], step_costs(prof, method, res["model"]))
    got = at_budget(pr, res["settings"], res["settings"]["budgets_gib"][0], page_bytes(res, method))
    assert got["decode_steps"] == run["decode_steps"] and got["prefilling_steps"] == run["steps"] - run["decode_steps"]
    assert (got["preemptions"], got["recomputed_tokens"], got["peak_running"]) == (
        run["preemptions"], run["recomputed_tokens"], run["peak_running"])
    assert got["extrapolated_steps"] == 0
    assert got["wall_s"] == pytest.approx(run["wall_s"], rel=0.01)  # k fits the prefilling seconds; decode at medians
    if method == "bf16":
        assert run["preemptions"] > 0  # the check covers recompute


def test_a_tighter_budget_holds_fewer_and_recomputes_more(measured):
    res, prof = measured
    run = next(r for r in res["runs"] if r["method"] == "bf16")
    pr = Prices(run, res["settings"], step_costs(prof, "bf16", res["model"]))
    pb = page_bytes(res, "bf16")
    tight, loose = (at_budget(pr, res["settings"], b, pb) for b in (0.8, 2.0))
    assert tight["peak_running"] < loose["peak_running"] and tight["decode_steps"] > loose["decode_steps"]
    assert tight["wall_s"] > loose["wall_s"]
    assert tight["extrapolated_steps"] == 0 < loose["extrapolated_steps"]  # batch 3: beyond the run's 1 and 2


def test_a_budget_below_the_longest_request_is_refused(measured):
    res, prof = measured
    run = next(r for r in res["runs"] if r["method"] == "bf16")
    pr = Prices(run, res["settings"], step_costs(prof, "bf16", res["model"]))
    with pytest.raises(SystemExit, match=r"--budgets-gib 0.5 \(bf16\): .*can never fit 269 pages.*raise the KV budget"):
        at_budget(pr, res["settings"], 0.5, page_bytes(res, "bf16"), "bf16")


def test_results_it_cannot_model_are_refused(tmp_path, measured):
    res, _ = measured
    two = dict(res, settings=dict(res["settings"], budgets_gib=[1.26, 5.04]))
    path = tmp_path / "two.json"
    path.write_text(json.dumps(two))
    with pytest.raises(SystemExit, match=r"ran budgets \[1.26, 5.04\]; give a result of one budget"):
        main(["--job", str(path), "--budgets-gib", "1.0"])
    with pytest.raises(SystemExit, match="no run with a step log for int8"):
        main(["--job", RUN, "--budgets-gib", "1.0", "--methods", "int8"])


def test_compare_puts_measured_runs_beside_the_model_and_refuses_another_job(tmp_path):
    """The run at 5.04 GiB (another budget, another process) has the model's decode steps, preemptions and peak
    sequences exactly; a result of another job is refused."""
    out = tmp_path / "m.json"
    other = "lab/results/serving/long_5.04gib_warps_apart_h200.json"
    assert main(["--job", RUN, "--budgets-gib", "5.04", "--methods", "bf16", "int4/int4", "--compare", other,
                 "--out", str(out)]) == 0
    row = json.loads(out.read_text())["budgets"]["5.04"]
    for m in ("bf16", "int4/int4"):
        (meas,) = row[m]["measured"]
        assert meas["source"] == other and meas["decode_steps"] == row[m]["decode_steps"]
        assert (meas["preemptions"], meas["peak_running"]) == (row[m]["preemptions"], row[m]["peak_running"])
    assert row["x_bf16"]["int4/int4"] == pytest.approx(row["bf16"]["wall_s"] / row["int4/int4"]["wall_s"], abs=1e-4)
    with pytest.raises(SystemExit, match="ran another job than the model's source"):
        main(["--job", RUN, "--budgets-gib", "14.95", "--compare",
              "lab/results/serving/longest_14.95gib_overlap_h200.json"])
    with pytest.raises(SystemExit, match="ran 5.04 GiB, which is not among the modelled budgets"):
        main(["--job", RUN, "--budgets-gib", "1.0", "--compare", other])
    with open(other) as f:
        doc = json.load(f)
    for change, why in (({"settings": dict(doc["settings"], content_group=64)}, r"\(content_group differ\)"),
                        ({"model": dict(doc["model"], layers=61)}, r"\(model differ\)"),
                        ({"runs": [dict(doc["runs"][0], pages=1359)]}, "bf16 at 5.04 GiB had 1359 pages, the model")):
        path = tmp_path / "changed.json"
        path.write_text(json.dumps(dict(doc, **change)))
        with pytest.raises(SystemExit, match=why):
            main(["--job", RUN, "--budgets-gib", "5.04", "--compare", str(path)])
    whole = tmp_path / "whole.json"  # a budget written as an integer matches the float given on the command line
    runs = [dict(r, budget_gib=5, pages=5 * GIB // doc["methods"][r["method"]]["page_bytes_all_layers"])
            for r in doc["runs"]]
    whole.write_text(json.dumps(dict(doc, runs=runs)))
    assert main(["--job", RUN, "--budgets-gib", "5", "--methods", "int4/int4", "--compare", str(whole),
                 "--out", str(tmp_path / "w.json")]) == 0


def test_prefill_scale_shortens_the_prefilling_steps_only(tmp_path):
    runs = {}
    for scale in ("1.0", "0.5"):
        out = tmp_path / f"s{scale}.json"
        assert main(["--job", RUN, "--budgets-gib", "1.26", "--methods", "int4/int4", "--prefill-scale", scale,
                     "--out", str(out)]) == 0
        runs[scale] = json.loads(out.read_text())
    full, half = (runs[s]["budgets"]["1.26"]["int4/int4"] for s in ("1.0", "0.5"))
    assert half["decode_s"] == full["decode_s"] and half["decode_steps"] == full["decode_steps"]
    floor = runs["0.5"]["methods"]["int4/int4"]["host_floor_ms"] * 1e-3 * half["prefilling_steps"]
    assert max(floor, 0.5 * full["mixed_s"]) <= half["mixed_s"] < 0.6 * full["mixed_s"]  # a few steps sit on the floor
    assert runs["0.5"]["prefill_scale"] == 0.5


def test_the_summary_counts_the_band_and_sets_measured_ratios_beside_the_model(tmp_path):
    out = tmp_path / "s.json"
    other = "lab/results/serving/long_1.26gib_h200.json"  # the same job at the model's own budget, another process
    assert main(["--job", RUN, "--budgets-gib", "0.98", "1.14", "1.26", "5.04", "--band", "0.9", "1.3",
                 "--goal", "int4/int4:fp8=1.8", "--compare", other, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["band_gib"] == [0.98, 1.26]
    v = s["ratios"]["int4/int4 over fp8"]
    xs = [doc["budgets"][b]["x_fp8"]["int4/int4"] for b in ("0.98", "1.14", "1.26")]
    assert v["budgets"] == 3 and v["median"] == sorted(xs)[1] and (v["min"], v["max"]) == (min(xs), max(xs))
    assert v["at_goal"] == sum(x >= 1.8 for x in xs) and 0 < v["at_goal"] < 3  # 2.00x at 0.98, 1.72x at 1.14
    with open(other) as f:
        walls = {r["method"]: r["wall_s"] for r in json.load(f)["runs"]}
    assert v["measured"] == {"1.26": round(walls["fp8"] / walls["int4/int4"], 4)}
    assert "goal" not in s["ratios"]["int2/int4 over bf16"]
    with pytest.raises(SystemExit, match="write METHOD:BASE=X"):
        main(["--job", RUN, "--budgets-gib", "1.26", "--goal", "int4/int4>1.8"])


def test_measured_ratios_of_two_runs_at_a_budget_are_the_lower_one(tmp_path):
    """Two runs at one budget: the summary's measured ratio is the lower of the two (one run's, as serve-bench's
    medians of an even count), not their mean."""
    runs = ("lab/results/serving/long_1.26gib_h200.json", "lab/results/serving/long_1.26gib_beside_budgets_h200.json")
    out = tmp_path / "two.json"
    assert main(["--job", RUN, "--budgets-gib", "1.26", "--methods", "fp8", "int4/int4", "--compare", *runs,
                 "--out", str(out)]) == 0
    ratios = []
    for path in runs:
        with open(path) as f:
            walls = {r["method"]: r["wall_s"] for r in json.load(f)["runs"]}
        ratios.append(round(walls["fp8"] / walls["int4/int4"], 4))
    assert ratios[0] != ratios[1]
    assert json.loads(out.read_text())["summary"]["ratios"]["int4/int4 over fp8"]["measured"] == {"1.26": min(ratios)}


def test_decode_scale_shortens_one_formats_decode_steps_only(tmp_path):
    """``--decode-scale int4/int4=0.8``: INT4/INT4's decode seconds are 0.8 times as long, its steps, prefilling
    seconds and the other formats unchanged; a bad factor or a method the job does not model is refused."""
    runs = {}
    for name, extra in (("base", []), ("scaled", ["--decode-scale", "int4/int4=0.8"])):
        out = tmp_path / f"{name}.json"
        assert main(["--job", RUN, "--budgets-gib", "0.98", "1.26", "--methods", "fp8", "int4/int4", *extra,
                     "--out", str(out)]) == 0
        runs[name] = json.loads(out.read_text())
    assert runs["scaled"]["decode_scale"] == {"int4/int4": 0.8}
    for b in ("0.98", "1.26"):
        base, scaled = runs["base"]["budgets"][b], runs["scaled"]["budgets"][b]
        assert scaled["fp8"] == base["fp8"]
        i4, j4 = base["int4/int4"], scaled["int4/int4"]
        assert j4["decode_steps"] == i4["decode_steps"] and j4["mixed_s"] == i4["mixed_s"]
        assert j4["decode_s"] == pytest.approx(0.8 * i4["decode_s"], rel=1e-3)
        assert scaled["x_fp8"]["int4/int4"] > base["x_fp8"]["int4/int4"]
    for bad, why in (("int4/int4=0", "S > 0"), ("int4/int4=fast", "S > 0"), ("=0.9", "S > 0"),
                     ("int2/int4=0.9", "int2/int4 is not among the modelled methods")):
        with pytest.raises(SystemExit, match=why):
            main(["--job", RUN, "--budgets-gib", "1.26", "--methods", "fp8", "int4/int4", "--decode-scale", bad])
