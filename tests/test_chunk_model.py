"""The chunk-budget model on the CPU: the scheduler's replay of a job accounts for every prompt and output token and
counts a prompt's chunks' context as the engine reads it back, the prefill profile's steps give the per-token,
per-pair and per-context-token costs that add back to the profile, the model reproduces its source run's prefilling
seconds at that run's chunk budget, and runs it cannot fit are refused."""

import json

import pytest

from quantmla_lab.bench.serving.chunk_model import PROFILE, job_lengths, main, model, prefill_gpu_s, replay, step_costs

SETTINGS = {"seed": 3, "requests": 6, "prompt_min": 300, "prompt_max": 900, "output_min": 20, "output_max": 40,
            "page_size": 16, "max_num_seqs": 256, "max_num_batched_tokens": 512, "watermark": 0.01}
GEOMETRY = {"layers": 27, "heads": 16, "d_c": 512, "d_nope": 128, "d_v": 128}
COSTS = {"token_s": 7e-6, "pair_s": 6e-10, "context_s": 1.4e-7}


def _run(mixed_s=1.2, pages=160):
    steps = [{"prompt_tokens": 512, "decode_rows": r, "launch_ms": 30.0 + 10 * (r > 0), "total_ms": 60.0}
             for r in (0, 1, 2)]
    by_batch = {str(b): {"total_ms_median": 2.0 + 0.1 * b} for b in (1, 2, 3, 4)}
    return {"method": "int4/int4", "pages": pages, "wall_s": 3.0, "mixed_s": mixed_s, "graph_decode_s": 1.8,
            "eager_decode_s": 0.0, "step_log": {"prefill_steps": steps, "decode_by_batch": by_batch}}


@pytest.mark.parametrize("chunk", [64, 512, 4096])
def test_replay_accounts_for_every_token(chunk):
    lengths = job_lengths(SETTINGS)
    steps = replay(lengths, 160, 16, chunk, 256, 0.01)
    assert sum(s["tokens"] for s in steps) == sum(p for p, _ in lengths)  # no preemption at this budget
    assert sum(s["rows"] for s in steps) == sum(o - 1 for _, o in lengths)  # the first token comes from the prompt
    assert max(s["tokens"] for s in steps) <= chunk
    assert sum(s["pairs"] for s in steps) == sum(p * (p + 1) // 2 for p, _ in lengths)


def test_one_prompts_chunks_read_back_their_whole_context():
    """A prompt of 1000 tokens in chunks of 256: 4 chunks, each reading back every token before its end."""
    steps = [s for s in replay([(1000, 1)], 100, 16, 256, 8, 0.0) if s["tokens"]]
    assert [s["tokens"] for s in steps] == [256, 256, 256, 232]
    assert [s["context"] for s in steps] == [256, 512, 768, 1000]
    assert [s["pairs"] for s in steps] == [256 * 257 // 2, 256 * 256 + 256 * 257 // 2, 256 * 512 + 256 * 257 // 2,
                                          232 * 768 + 232 * 233 // 2]


def test_profile_costs_add_back_to_its_steps():
    """The per-token, per-pair and per-context-token costs, over the profile's own replayed steps, give back its
    measured GPU time of the parts they come from (dense, elementwise, append, attention)."""
    with open(PROFILE) as f:
        prof = json.load(f)
    for m in ("bf16", "int4/int4", "fp8"):  # fp8: the profile has none, so BF16's parts
        c = step_costs(prof, m, GEOMETRY)
        parts = (prof["methods"].get(m) or prof["methods"]["bf16"])["parts"]
        timed = ("projections and MLP", "other", "cache append", "attention")
        want = 1e-6 * sum(parts[k]["us_per_step"] for k in timed)
        got = sum(prefill_gpu_s(s, c) for s in c["profile_steps"]) / len(c["profile_steps"])
        assert got == pytest.approx(want, rel=1e-9)
        assert len(c["profile_steps"]) == prof["steps"] and c["context_s"] < c["token_s"]


def test_model_reproduces_its_run_and_refuses_what_it_cannot_fit():
    out = model(_run(), SETTINGS, [128, 512], COSTS)
    own = out["chunks"]["512"]
    assert own["mixed_s"] == pytest.approx(1.2, rel=1e-2) and out["host_floor_ms"] == 40.0
    assert out["chunks"]["128"]["prefilling_steps"] > own["prefilling_steps"]
    assert out["chunks"]["128"]["rows_riding"] > own["rows_riding"]
    for mixed in (0.01, 0.28):  # below, or at, what the host floors alone give (7 steps of 40 ms): k undetermined
        with pytest.raises(ValueError, match="no GPU factor is determined"):
            model(_run(mixed), SETTINGS, [512], COSTS)


def test_a_result_without_step_logs_is_refused(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"settings": SETTINGS, "runs": [{"method": "bf16"}]}))
    with pytest.raises(SystemExit, match="no run with a step log for fp8, int4/int4; it has bf16"):
        main(["--job", str(path)])
