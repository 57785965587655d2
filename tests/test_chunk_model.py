"""The chunk-budget model on the CPU: the scheduler's replay of a job accounts for every prompt and output token,
the model reproduces its source run's prefilling seconds at that run's chunk budget, and a result without step logs
is refused naming what it has."""

import json

import pytest

from quantmla_lab.bench.serving.chunk_model import job_lengths, main, model, replay

SETTINGS = {"seed": 3, "requests": 6, "prompt_min": 300, "prompt_max": 900, "output_min": 20, "output_max": 40,
            "page_size": 16, "max_num_seqs": 256, "max_num_batched_tokens": 512, "watermark": 0.01}


def _run(pages=160):
    steps = [{"prompt_tokens": 512, "decode_rows": r, "launch_ms": 30.0 + 10 * (r > 0), "total_ms": 60.0}
             for r in (0, 1, 2)]
    by_batch = {str(b): {"total_ms_median": 2.0 + 0.1 * b} for b in (1, 2, 3, 4)}
    return {"method": "int4/int4", "pages": pages, "wall_s": 3.0, "mixed_s": 1.2, "graph_decode_s": 1.8,
            "eager_decode_s": 0.0, "step_log": {"prefill_steps": steps, "decode_by_batch": by_batch}}


@pytest.mark.parametrize("chunk", [64, 512, 4096])
def test_replay_accounts_for_every_token(chunk):
    lengths = job_lengths(SETTINGS)
    steps = replay(lengths, 160, 16, chunk, 256, 0.01)
    rows = sum(s["rows"] for s in steps)
    assert sum(s["tokens"] for s in steps) == sum(p for p, _ in lengths)  # no preemption at this budget
    assert rows == sum(o - 1 for _, o in lengths)  # each output token but the one sampled from the prompt's last
    assert max(s["tokens"] for s in steps) <= chunk
    assert sum(s["pairs"] for s in steps) == sum(p * (p + 1) // 2 for p, _ in lengths)


def test_model_reproduces_its_run_and_moves_with_the_chunks():
    out = model(_run(), SETTINGS, [128, 512])
    own = out["chunks"]["512"]
    assert own["mixed_s"] == pytest.approx(1.2, rel=1e-2) and out["k"] > 1
    assert out["chunks"]["128"]["prefilling_steps"] > own["prefilling_steps"]
    assert out["chunks"]["128"]["rows_riding"] > own["rows_riding"]
    run = _run()
    run["mixed_s"] = 0.01  # below its host floors: no factor gives it
    with pytest.raises(ValueError, match="no GPU factor reproduces"):
        model(run, SETTINGS, [512])


def test_a_result_without_step_logs_is_refused(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"settings": SETTINGS, "runs": [{"method": "bf16"}]}))
    with pytest.raises(SystemExit, match="no run with a step log for fp8, int4/int4; it has bf16"):
        main(["--job", str(path)])
