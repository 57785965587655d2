"""The decode step grid (``quantmla_lab.bench.serving.step_grid``) on the CPU at toy size: a point's parts
add up to its step time, its bytes and roofline follow from them, and a point too large for the
memory given is skipped with the reason; the table renders from the saved JSON."""

import json
import math

from quantmla_lab.bench.serving import step_grid


def test_step_grid_parts_sum_to_the_step_and_oversized_points_are_skipped(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QUANTMLA_PARTIALS", "fp32")  # recorded in the result's header
    out = tmp_path / "grid.json"
    # context 64 fits in 10 MiB; 2**20 tokens of 2 layers (about 80 MB of int4/int4 records) do not
    step_grid.main(["--preset", "tiny", "--device", "cpu", "--content-group", "32", "--rope-group", "16",
                    "--methods", "int4/int4", "--batches", "2", "--contexts", "64", str(1 << 20), "--warm", "2",
                    "--steps", "2", "--memory-gib", str(10 / 1024), "--headroom-gib", "0", "--out", str(out)])
    res = json.loads(out.read_text())
    assert {"device", "date", "command", "commit"} <= set(res) and res["partials"] == "fp32"
    ok, big = res["points"]
    assert ok["status"] == "ok" and (ok["batch"], ok["context"], ok["method"]) == (2, 64, "int4/int4")
    assert ok["tokens_per_step"] == 2 and ok["mean_context"] == 64 + 2 + 0.5 and ok["step_us_unprofiled"] > 0
    parts = ok["parts"]
    assert list(parts) == list(step_grid.PART_NAMES)
    total = sum(p["us_per_step"] for p in parts.values())
    assert abs(total - ok["step_us"]) <= 0.01 * ok["step_us"] + 1.0
    assert ok["gpu_us"] > 0 and parts["projections and MLP"]["us_per_step"] > 0
    assert ok["bytes"]["weights"] > 0 and ok["bytes"]["cache"] > 0
    floor = ok["roofline"]["floor_us"]
    assert math.isclose(floor, (ok["bytes"]["weights"] + ok["bytes"]["cache"]) / (res["copy_GBps"] * 1e3), rel_tol=1e-3,
                        abs_tol=1e-3)
    assert math.isclose(ok["roofline"]["ratio"], ok["step_us"] / floor, rel_tol=1e-3)
    assert big["status"] == "skipped" and big["context"] == 1 << 20 and big["reason"].startswith("needs ")
    assert "of the device's" in big["reason"] and big["pool_bytes"] > 10 << 20

    capsys.readouterr()
    step_grid.main(["--from-json", str(out)])
    table = capsys.readouterr().out
    assert "| int4/int4 | 2 | 64 |" in table and f"| int4/int4 | 2 | {1 << 20} | skipped: needs" in table


def test_step_grid_cuda_graphs_on_the_cpu_is_skipped_with_the_reason(tmp_path):
    out = tmp_path / "grid.json"
    step_grid.main(["--preset", "tiny", "--device", "cpu", "--content-group", "32", "--rope-group", "16",
                    "--methods", "bf16", "--batches", "1", "--contexts", "64", "--warm", "2", "--steps", "1",
                    "--cuda-graphs", "--out", str(out)])
    res = json.loads(out.read_text())
    (pt,) = res["points"]
    assert res["cuda_graphs"] is True and res["how"].startswith("CUDA-graph replays")
    assert pt["status"] == "skipped" and pt["reason"].startswith("--cuda-graphs: the engine does not replay graphs")


def test_ratio_bounds_model_splits_each_run_exactly():
    """ratio_bounds: at scale 1 the model's wall is each run's measured wall (mixed + decode + the rest), so its
    ratios are the measured ones; a free decode attention leaves mixed steps + decode steps x R; R is the
    grid's line in the batch."""
    from quantmla_lab.bench.serving.ratio_bounds import parts, rest_of_step, wall

    grid = {"points": [{"batch": b, "replay_us": 2000 + 10 * b + 50 * b, "parts": {"attention": {"us_per_step": 50 * b}}}
                       for b in (1, 8, 32)]}
    R = rest_of_step(grid)
    assert abs(R[0] - 2e-3) < 1e-9 and abs(R[1] - 1e-5) < 1e-12
    runs = [{"method": "bf16", "wall_s": 30.0, "mixed_s": 10.0, "graph_decode_s": 19.5, "eager_decode_s": 0.0,
             "decode_steps": 6000, "steps": 6010, "output_tokens": 6010},
            {"method": "int4/int4", "wall_s": 14.0, "mixed_s": 9.0, "graph_decode_s": 4.8, "eager_decode_s": 0.1,
             "decode_steps": 1500, "steps": 1510, "output_tokens": 6010}]
    x = {r["method"]: parts(r, r["output_tokens"], R) for r in runs}
    for r in runs:
        assert abs(wall(x[r["method"]], 1.0, 1.0) - r["wall_s"]) < 1e-9
    v = x["int4/int4"]
    assert abs(v["mean_batch"] - 4.0) < 1e-12  # 6010 tokens, 10 of them sampled by mixed steps, over 1500 steps
    free = wall(v, 1.0, 0.0)
    assert abs(free - (9.0 + 1500 * (R[0] + 4 * R[1]) + v["other_s"])) < 1e-9
    assert wall(v, 0.5, 1.0) < wall(v, 1.0, 1.0) and free < wall(v, 1.0, 0.5) < wall(v, 1.0, 1.0)


def test_prefill_padding_counts_the_engines_buckets():
    """prefill_padding replays a job through the scheduler: a 300-token prompt within the budget is one graph chunk
    padded to the 512-token bucket; with no graph above 256 tokens it is an eager chunk and nothing is padded."""
    from quantmla_lab.bench.serving.prefill_padding import padding
    from quantmla_lab.bench.serving.throughput import BenchSettings, make_job

    s = BenchSettings(requests=1, prompt_min=300, prompt_max=300, output_min=3, output_max=3, page_size=16,
                      max_num_batched_tokens=512)
    job = make_job(s, vocab=100)
    r = padding(job, 64, s, graph_max=4096)
    assert (r["graph_chunks"], r["graph_tokens"], r["padding_tokens"], r["eager_chunk_tokens"]) == (1, 300, 212, 0)
    assert r["steps"] == 3 and r["decode_steps"] == 2
    r = padding(job, 64, s, graph_max=256)
    assert (r["graph_chunks"], r["padding_tokens"], r["eager_chunk_tokens"]) == (0, 0, 300)


def test_ctas_per_sm_reaches_the_engines_decode_tiling(tmp_path, monkeypatch):
    """--ctas-per-sm N gives the engine a decode_config: the API's default tiling with N programs an SM."""
    from quantmla.cache.layout import PageLayout, TokenLayout, preset
    from quantmla.kernels.api import default_config

    seen = []
    real = step_grid.Engine
    monkeypatch.setattr(step_grid, "Engine", lambda model, cfg: seen.append(cfg.decode_config) or real(model, cfg))
    out = tmp_path / "grid.json"
    step_grid.main(["--preset", "tiny", "--device", "cpu", "--content-group", "32", "--rope-group", "16",
                    "--methods", "int4/int4", "--batches", "1", "--contexts", "32", "--warm", "2", "--steps", "1",
                    "--ctas-per-sm", "2", "--out", str(out)])  # the CPU's default tiling has 1
    assert json.loads(out.read_text())["ctas_per_sm"] == 2
    (tiling,) = seen
    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    got, want = tiling(16, lay, "cpu"), default_config(16, lay, "cpu")
    assert want.ctas_per_sm == 1 and got.ctas_per_sm == 2
    assert got.block_n == want.block_n and got.kernel == want.kernel
    assert step_grid.decode_tiling(None) is None
