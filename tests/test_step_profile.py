"""The prefill FLOP count of ``quantmla_lab.bench.serving.step_profile`` against torch's own count of a
forward pass of the serve-bench model (tiny preset, CPU): the dense part is every matmul of the model,
and the attention part is the causal half of what eager attention multiplies."""

import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from quantmla_lab.bench.serving.step_profile import prefill_flops
from quantmla_lab.bench.serving.throughput import build_bench_model


def test_prefill_flops_agree_with_torch_flop_counter():
    model = build_bench_model("tiny", "cpu", torch.float32, 0)
    c = model.config
    n = 24
    ids = torch.randint(3, c.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as fc:
        model(ids, logits_to_keep=1)  # one sampled row: the LM head over one token
    counts = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    f = prefill_flops(model, [(0, n, True)])
    assert f["dense"] == counts["aten.mm"]  # the linear maps (kv_b_proj over the n tokens) and the LM head
    # eager attention multiplies all n x n pairs (the mask comes after); the count is the causal n (n + 1) / 2,
    # and the rotary table's product (inv_freq x positions) is the only other batched matmul
    d_qk, d_v, H, L = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, c.num_attention_heads, c.num_hidden_layers
    full = 2 * (d_qk + d_v) * H * n * n * L
    assert counts["aten.bmm"] == full + 2 * (c.qk_rope_head_dim // 2) * n
    assert f["attention"] == full * (n + 1) / (2 * n)
    # a chunk of n tokens after 100 cached ones: kv_b_proj reads 100 + n tokens back, query p meets p + 1 keys
    g = prefill_flops(model, [(100, n, False)])
    kvb = sum(layer.self_attn.kv_b_proj.weight.numel() for layer in model.model.layers)
    head = model.get_output_embeddings().weight.numel()
    assert g["dense"] == f["dense"] - 2 * head + 2 * kvb * 100
    assert g["attention"] == 2 * (d_qk + d_v) * H * L * (n * 100 + n * (n + 1) / 2)


def test_projection_gemms_times_each_form_of_the_same_product(tmp_path):
    """The projection-GEMM bench on the CPU: every form computes the same product, and the JSON has a row each."""
    import json

    from quantmla_lab.bench.serving.projection_gemms import main, shapes

    assert shapes()["q_proj"] == (16 * 192, 2048) and shapes()["down_proj"] == (2048, 10944)
    out = tmp_path / "pg.json"
    assert main(["--device", "cpu", "--rows", "1", "3", "--reps", "2", "--only", "kv_a_proj_with_mqa",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["form"]) for r in rows] == [(1, "linear"), (1, "transposed"), (3, "linear"), (3, "transposed")]
    assert all(r["rel_diff_vs_linear"] < 1e-5 and r["us"] > 0 for r in rows)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_skinny_gemm_candidate_computes_the_product(tmp_path):
    """The lab's candidate kernel for decode's small products equals F.linear at every tiling the bench sweeps
    (rows 1 to 64, N not a multiple of the block, K not a multiple of the key block), refuses more than 64 rows,
    and the bench times it as one form a tiling."""
    import json

    from quantmla_lab.bench.serving.projection_gemms import main
    from quantmla_lab.bench.serving.skinny_gemm import TILINGS, skinny_linear

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 600, generator=g).to(dev)
    for m in (1, 5, 64):
        x = torch.randn(m, 600, generator=g).to(dev)
        for t in TILINGS:
            torch.testing.assert_close(skinny_linear(x, w, t), torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="64 rows"):
        skinny_linear(torch.randn(65, 600, device=dev), w)
    out = tmp_path / "pg.json"
    assert main(["--device", "cpu", "--rows", "2", "--reps", "1", "--only", "kv_a_proj_with_mqa", "--triton",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 + len(TILINGS) and all(r["rel_diff_vs_linear"] < 1e-4 for r in rows)
