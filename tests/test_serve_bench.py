"""serve-bench: the job shapes and presets, --check, the command at toy size, ratios and medians over repeats, and
the slow-step tool over its step logs."""

import json

import pytest


def test_serve_bench_jobs_and_fp8_method():
    from quantmla_lab.bench.serving.throughput import JOBS, job_budgets_gib, method_config

    assert method_config("fp8").describe() == "content FP8/g128 + RoPE BF16"
    assert JOBS["long"] == dict(requests=32, prompt=(16384, 24576), output=(1024, 1536), batched_tokens=16384)
    b2, b8, b32 = job_budgets_gib("long")
    assert abs(b8 / b2 - 4) < 1e-3 and abs(b32 / b2 - 16) < 1e-3
    # BF16 at d_c 512, d_r 64: 1152 B/token/layer, 27 layers; the mean request (21760 tokens) in 64-token pages
    assert abs(b2 - 2 * 340 * 64 * 1152 * 27 / (1 << 30)) < 1e-3
    assert len(job_budgets_gib("longest")) == 2  # 32 requests exceed the job's 16


def test_serve_bench_v3_slice_preset():
    """The `v3-slice` geometry: DeepSeek-V3's attention (128 heads, q_lora 1536, d_c 512, d_r 64) in 8 layers with dense
    MLPs, built without memory (meta device); its job budgets count 8 layers of 1152-byte BF16 records."""
    from quantmla_lab.bench.serving.throughput import build_bench_model, job_budgets_gib

    m = build_bench_model("v3-slice", device="meta")
    c = m.config
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim, c.num_hidden_layers) == \
        (128, 1536, 512, 64, 8)
    attn = m.model.layers[0].self_attn
    assert attn.q_b_proj.weight.shape == (128 * 192, 1536) and attn.o_proj.weight.shape == (7168, 128 * 128)
    assert not hasattr(m.model.layers[-1].mlp, "experts")  # every MLP dense
    b2 = job_budgets_gib("long", "v3-slice")[0]
    assert abs(b2 - 2 * 340 * 64 * 1152 * 8 / (1 << 30)) < 1e-3


def test_serve_bench_job_sets_its_chunk_budget_unless_given():
    """`--job long` batches 16384 tokens a step as its published runs do; an explicit --max-batched-tokens wins,
    and without --job the settings' default holds."""
    import argparse

    from quantmla_lab.bench.serving.command import add_arguments, apply_job
    from quantmla_lab.bench.serving.throughput import BenchSettings

    p = argparse.ArgumentParser()
    add_arguments(p)
    for argv, want in ((["--job", "long"], 16384), (["--job", "longest"], 16384), (["--job", "short"], 8192),
                       (["--job", "longest", "--max-batched-tokens", "4096"], 4096),
                       ([], BenchSettings.max_num_batched_tokens), (["--max-batched-tokens", "2048"], 2048)):
        args = p.parse_args(argv)
        apply_job(args)
        assert args.max_batched_tokens == want, argv
    # budgets given win over the job's, however the option is spelt (argparse takes a prefix and `=`)
    for argv in (["--job", "long", "--budgets-gib", "3"], ["--job", "long", "--budgets-gib=3"],
                 ["--job", "long", "--budgets", "3"]):
        args = p.parse_args(argv)
        apply_job(args)
        assert args.budgets_gib == [3.0] and args.requests == 32, argv
    args = p.parse_args([])
    apply_job(args)
    assert args.budgets_gib == list(BenchSettings.budgets_gib)


def test_check_compares_the_engine_logic_apart_from_the_kernels():
    """serve-bench --check: for low bits it also runs the same engine on fp32 torch attention, so that a
    divergence of the kernels (bf16 operands) can be told from one of the scheduler, pages or quantizer."""
    from quantmla_lab.bench.serving.command import run_check

    lines = []
    res = run_check("cpu", 2e-2, lines.append, families=("deepseek_v2",), refs=[], methods=("int2/int4",))
    (low,) = res["rows"]
    logic = low["engine_logic"]
    assert logic["backend"] == "torch" and logic["requests"] == 5
    assert logic["exact"] == 5 and logic["ok"]  # the engine's own logic is the fake-quant path, token for token
    assert low["kernel_rounding_only"] == (not low["ok"])
    assert res["ok_up_to_kernel_rounding"] and "engine logic (torch backend, fp32): exact 5/5" in lines[0]


def test_check_only_result_carries_device_date_and_command(tmp_path):
    """`serve-bench --check-only` writes a result that says where, when and how it was made."""
    import json

    from quantmla.cli import main

    out = tmp_path / "check.json"
    rc = main(["serve-bench", "--check-only", "--device", "cpu", "--check-families", "deepseek_v2", "--check-refs",
               "--check-methods", "bf16", "--out", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["correctness"]["ok"] and len(res["correctness"]["rows"]) == 1
    assert res["device"].startswith("CPU") and res["date"].startswith("20") and "--check-only" in res["command"]


def test_serve_bench_command_at_toy_size(tmp_path, monkeypatch):
    from quantmla.cli import main

    monkeypatch.setenv("QUANTMLA_PARTIALS", "fp32")  # recorded in the header

    out = tmp_path / "serving.json"
    rc = main(["serve-bench", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "5",
               "--prompt-len", "20", "50", "--output-len", "4", "8", "--budgets-gib", "0.00002", "0.0001",
               "--page-size", "16", "--content-group", "32", "--rope-group", "16", "--backend", "torch", "--out", str(out),
               "--methods", "bf16", "int4/int4", "int2/int4", "--repeats", "2"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert {"device", "date", "command", "settings", "runs", "summary"} <= set(res)
    assert res["partials"] == "fp32"  # the split partials' setting (QUANTMLA_PARTIALS), recorded beside the commit
    assert len(res["runs"]) == 12
    assert res["summary"]["runs_per_method"] == {m: {"2e-05": 2, "0.0001": 2} for m in ("bf16", "int4/int4", "int2/int4")}
    assert [(r["budget_gib"], r["repeat"], r["method"]) for r in res["runs"][:4]] == [
        (0.00002, 0, "bf16"), (0.00002, 0, "int4/int4"), (0.00002, 0, "int2/int4"), (0.00002, 1, "bf16")]
    runs = {(r["budget_gib"], r["repeat"], r["method"]): r for r in res["runs"]}
    for (b, k, m), r in runs.items():  # a repeat schedules the same job again, and pairs with its own BF16 run
        first = runs[(b, 0, m)]
        assert [r[x] for x in ("pages", "steps", "decode_steps", "preemptions")] == [
            first[x] for x in ("pages", "steps", "decode_steps", "preemptions")]
        assert r["ratio_to_bf16"] == round(r["tokens_per_s"] / runs[(b, k, "bf16")]["tokens_per_s"], 3)
    for r in res["runs"]:
        assert r["all_complete_and_unique"] and r["completed"] == 5
        for k in ("requests", "output_tokens", "wall_s", "tokens_per_s", "peak_batch", "preemptions", "ratio_to_bf16"):
            assert k in r
    bf16 = [r for r in res["runs"] if r["method"] == "bf16"]
    assert all(r["ratio_to_bf16"] == 1.0 for r in bf16)
    assert bf16[0]["preemptions"] > 0  # the smaller budget is pressured
    prompt_tokens = res["job"]["prompt_tokens"]
    for r in res["runs"]:  # the step log accounts for every step, prompt token and decode row of the run
        log = r["step_log"]
        pre, dec = log["prefill_steps"], log["decode_by_batch"]
        assert len(pre) == r["steps"] - r["decode_steps"] and sum(d["steps"] for d in dec.values()) == r["decode_steps"]
        decode_rows = sum(p["decode_rows"] for p in pre) + sum(int(b) * d["steps"] for b, d in dec.items())
        assert sum(p["prompt_tokens"] for p in pre) + decode_rows == r["computed_tokens"]
        assert r["preemptions"] or sum(p["prompt_tokens"] for p in pre) == prompt_tokens
        sampled = sum(p["sampled"] for p in pre) + sum(int(b) * d["steps"] for b, d in dec.items())
        assert sampled == r["output_tokens"]
        assert all(0 <= p["launch_ms"] <= p["total_ms"] for p in pre)
        assert abs(log["prefill_total_s"] - r["mixed_s"]) <= 0.05 * r["mixed_s"] + 0.01, (log["prefill_total_s"], r["mixed_s"])
        compiled = sum(p["compiles"] for p in pre) + sum(d["compiles"] for d in dec.values())
        assert compiled == log["compiles"]["count"] == 0  # the torch backend compiles nothing (per-step
        # attribution: tests/test_compile_watch.py)


def test_serve_bench_never_replaces_a_result_unasked(tmp_path, capsys, monkeypatch):
    """An --out (or its figure) that exists is refused before any work unless --overwrite is given, which removes the
    old figure first; --check-only writes agreement.json by default, apart from the benchmark's serving.json; a
    partial result (a run cut short) is not drawn; a job whose every run failed exits non-zero."""
    import argparse

    from quantmla.cli import main
    from quantmla.errors import QuantMLAError
    from quantmla_lab.bench.serving.command import add_arguments, claim_output
    from quantmla_lab.bench.serving.throughput_report import load_result

    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "serving.json"
    out.with_suffix(".png").write_text("old figure")
    args = p.parse_args(["--out", str(out)])
    with pytest.raises(QuantMLAError, match="exist; pass --overwrite"):
        claim_output(args)
    claim_output(p.parse_args(["--out", str(out), "--overwrite"]))
    assert not out.with_suffix(".png").exists()
    args = p.parse_args(["--check-only"])
    monkeypatch.chdir(tmp_path)
    claim_output(args)
    assert args.out == "out/serve-bench/agreement.json"
    out.write_text(json.dumps({"runs": [{"method": "bf16"}], "partial": True}))
    with pytest.raises(QuantMLAError, match="did not finish"):
        load_result(str(out))
    rc = main(["serve-bench", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "2",
               "--prompt-len", "20", "30", "--output-len", "2", "3", "--budgets-gib", "0.0000001", "--page-size", "16",
               "--content-group", "32", "--rope-group", "16", "--backend", "torch", "--methods", "bf16",
               "--out", str(tmp_path / "none.json")])
    assert rc == 1 and "1 errors, 0 runs" in capsys.readouterr().out


def test_serve_bench_ratios_and_medians_over_repeats():
    """Each run's ratios pair it with the baseline's run of the same budget and repeat; the summary's ratios are
    the medians of those (the lower middle one of an even count: one repeat's figure, never an average), and the
    tools that model one run per method read one whole repeat per budget."""
    from quantmla_lab.bench.serving.throughput_report import add_ratios, format_table, representative_runs, summarize

    def job(tps):
        return [{"budget_gib": 1.0, "method": m, "repeat": k, "tokens_per_s": t, "wall_s": 1e3 / t, "peak_batch": 1,
                 "preemptions": 0, "output_tokens": 1} for (m, k), t in tps.items()]

    runs = job({("bf16", 0): 100.0, ("fp8", 0): 150.0, ("int4/int4", 0): 300.0,
                ("bf16", 1): 110.0, ("fp8", 1): 200.0, ("int4/int4", 1): 320.0,
                ("bf16", 2): 90.0, ("fp8", 2): 175.0, ("int4/int4", 2): 310.0})
    add_ratios(runs)
    by = {(r["method"], r["repeat"]): r for r in runs}
    assert by[("int4/int4", 1)]["ratio_to_bf16"] == round(320 / 110, 3)  # paired within a repeat
    assert by[("int4/int4", 0)]["ratio_to_fp8"] == round(300 / 150, 3)
    sm = summarize({"runs": runs})
    assert sm["runs_per_method"]["int4/int4"] == {1.0: 3} and sm["median_tokens_per_s"]["int4/int4"] == {1.0: 310.0}
    assert sm["ratio_by_budget"]["int4/int4"][1.0] == round(300 / 100, 3)  # of 3.0, 2.909, 3.444
    # of 2.0, 1.6, 1.771: the paired median 1.771, not the ratio of the medians (310 / 175 = 1.771 too, so:)
    assert sm["ratio_to_fp8_by_budget"]["int4/int4"][1.0] == round(310 / 175, 3)
    assert sm["ratio_to_fp8_by_budget"]["int4/int4"][1.0] != round(310 / 200, 3)
    rep = representative_runs(runs)  # summed wall times: repeat 0 10+6.67+3.33, 1 9.09+5+3.13, 2 11.1+5.71+3.23
    assert [(r["method"], r["repeat"]) for r in rep] == [("bf16", 0), ("fp8", 0), ("int4/int4", 0)]
    assert len(format_table({"runs": runs}).splitlines()) == 10
    one = [r for r in runs if r["repeat"] == 0]
    assert representative_runs(one) == one

    # an even count takes the lower middle repeat's figure; a repeat without its baseline has no ratio
    even = job({("bf16", 0): 100.0, ("int4/int4", 0): 300.0, ("bf16", 1): 100.0, ("int4/int4", 1): 340.0,
                ("int4/int4", 2): 500.0})
    add_ratios(even)
    assert [r["ratio_to_bf16"] for r in even if r["method"] == "int4/int4"] == [3.0, 3.4, None]
    sm = summarize({"runs": even})
    assert sm["ratio_by_budget"]["int4/int4"][1.0] == 3.0 and sm["median_tokens_per_s"]["int4/int4"][1.0] == 340.0
    assert sm["runs_per_method"] == {"bf16": {1.0: 2}, "int4/int4": {1.0: 3}}
    # whole repeats only (repeat 2 lacks BF16); of two, the lower middle by summed wall time: repeat 1's 12.9 s
    assert {r["repeat"] for r in representative_runs(even)} == {1}

    # a run that failed its completion check (a request lost or short) gives no ratio, serves as no baseline and
    # counts in no median: it is named instead
    bad = job({("bf16", 0): 100.0, ("int4/int4", 0): 300.0, ("bf16", 1): 50.0, ("int4/int4", 1): 900.0})
    bad[3]["all_complete_and_unique"] = False  # int4/int4, repeat 1
    bad[2]["all_complete_and_unique"] = False  # bf16, repeat 1
    add_ratios(bad)
    assert [r["ratio_to_bf16"] for r in bad if r["method"] == "int4/int4"] == [3.0, None]
    sm = summarize({"runs": bad})
    assert sm["ratio_by_budget"]["int4/int4"][1.0] == 3.0 and sm["median_tokens_per_s"]["int4/int4"][1.0] == 300.0
    assert sm["failed_runs"] == [{"method": "bf16", "budget_gib": 1.0, "repeat": 1},
                                 {"method": "int4/int4", "budget_gib": 1.0, "repeat": 1}]


def test_slow_steps_against_a_reference_run():
    """Steps over both the ratio and the floor count, their excess comes out of the wall time, and runs of different
    jobs are refused."""
    from quantmla_lab.bench.serving.slow_steps import slow_steps

    def run(ms, tokens=(100, 200, 300)):
        steps = [{"prompt_tokens": t, "chunks": 1, "decode_rows": 0, "total_ms": x, "launch_ms": x / 2}
                 for t, x in zip(tokens, ms)]
        return {"method": "int4/int4", "budget_gib": 1.0, "wall_s": 10.0, "tokens_per_s": 100.0, "output_tokens": 1000,
                "step_log": {"prefill_steps": steps}}

    out = slow_steps(run([1000.0, 250.0, 400.0]), run([200.0, 100.0, 300.0]), ratio=1.5, min_ms=300.0)
    assert [s["step"] for s in out["slow_steps"]] == [0]  # 250 ms: 2.5x but under the floor; 400: under 1.5x
    assert out["excess_s"] == 0.8 and out["tokens_per_s_without_excess"] == round(1000 / 9.2, 1)
    with pytest.raises(ValueError, match="same job"):
        slow_steps(run([1.0, 1.0, 1.0]), run([1.0, 1.0, 1.0], tokens=(100, 200, 301)))


def test_host_profile_profiles_only_the_prefilling_steps(tmp_path):
    """host_profile's timed and profiled runs see the same prefilling steps (decode steps left out), and the profile
    is per prefilling step: the engine's step function is called once a step."""
    from quantmla_lab.bench.serving.host_profile import main

    out = tmp_path / "host.json"
    assert main(["--preset", "tiny", "--device", "cpu", "--prompt", "60", "--batched-tokens", "32", "--new", "4",
                 "--requests", "3", "--kv-budget-gib", "0.001", "--methods", "int4/int4", "--content-group", "32",
                 "--rope-group", "16", "--top", "60", "--backend", "torch", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["methods"]["int4/int4"]
    steps = r["steps"]
    assert [(s["prompt_tokens"], s["decode_rows"]) for s in steps] == \
        [(s["prompt_tokens"], s["decode_rows"]) for s in r["profiled_steps"]]
    assert sum(s["prompt_tokens"] for s in steps) == sum(60 + 97 * i for i in range(3))  # no preemption here
    assert all(0 < s["launch_ms"] <= s["total_ms"] for s in steps)
    eager = [f for f in r["by_cumulative_time"] if f["function"].endswith("(_eager)")]
    assert eager and eager[0]["calls_per_step"] == 1.0


def test_host_profile_counts_only_sync_warnings_inside_prefilling_steps():
    """PrefillSteps counts the warnings torch's sync debug mode raises inside a prefilling step, by Python site, and
    neither other warnings nor those of decode steps; a one-token chunk of a prompt is a prompt token, not a row."""
    import types
    import warnings

    from quantmla_lab.bench.serving.host_profile import SYNC_WARNING, PrefillSteps

    def warn(msg, line):
        return warnings.WarningMessage(msg, UserWarning, "/x/src/quantmla/serving/engine.py", line)

    def item(n, start, prompt_len):
        return types.SimpleNamespace(n=n, start=start, seq=types.SimpleNamespace(prompt_len=prompt_len))

    syncs: list = []
    obs = PrefillSteps(syncs=syncs)
    mixed = types.SimpleNamespace(is_decode=False, items=[item(1, 40, 30), item(5, 0, 9), item(1, 9, 10)])
    decode = types.SimpleNamespace(is_decode=True, items=[item(1, 41, 30)])
    obs.step_begin(decode)
    syncs.append(warn(f"called a {SYNC_WARNING}", 7))
    obs.step_end(types.SimpleNamespace(plan=decode, kind="graph_decode", launch_s=0.001, total_s=0.002))
    obs.step_begin(mixed)
    syncs += [warn(f"called a {SYNC_WARNING}", 291), warn(f"called a {SYNC_WARNING}", 291),
              warn(f"called a {SYNC_WARNING}", 327), warn("some deprecation", 12)]
    obs.step_end(types.SimpleNamespace(plan=mixed, kind="eager", launch_s=0.010, total_s=0.020))
    (step,) = obs.steps
    assert step["syncs"] == 3 and step["sync_sites"] == {"quantmla/serving/engine.py:291": 2,
                                                          "quantmla/serving/engine.py:327": 1}
    assert (step["prompt_tokens"], step["decode_rows"]) == (6, 1)
