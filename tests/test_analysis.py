"""The dual-path error model: exact split, first-order limit, pair energies, the analyze command."""

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from quantmla.analysis.error_model import (
    LayerTensors,
    _to_out,
    measure,
    pair_energies,
    pair_logit_error,
    path_formats,
    quantize_paths,
    split_terms,
)
from quantmla.analysis.run import analyze_model, collect_layer_tensors
from quantmla.model.capture import capture_attention_inputs
from quantmla.model.spec import load_spec
from quantmla.model.tiny import tiny_model
from quantmla.quant.format import PathFormat
from quantmla.quant.groupwise import quantize_dequantize


@pytest.fixture(scope="module")
def v3_layers():
    torch.manual_seed(0)
    model = tiny_model("deepseek_v3")
    ids = torch.randint(3, 128, (2, 24))
    return model, ids, collect_layer_tensors(model, ids, batch_size=2)


def test_split_sums_to_exact_error(v3_layers):
    _, _, layers = v3_layers
    t = layers[0][0]
    c_hat = quantize_dequantize(t.latent, PathFormat(2, 16))
    kr_hat = quantize_dequantize(t.k_rope, PathFormat(2, 8))
    T = split_terms(t, c_hat, kr_hat)
    delta = T["delta"]
    assert delta.abs().max() > 1e-3  # a real, non-trivial error at 2 bits
    torch.testing.assert_close(T["matching"] + T["aggregation"], delta, rtol=0, atol=1e-12 * float(T["o"].abs().max()))
    # the cross term is second order but not zero, and is what first order leaves out of the aggregation
    assert T["cross"].abs().max() > 0
    torch.testing.assert_close(T["aggregation"], T["aggregation_first_order"] + 0.5 * T["cross"], rtol=0, atol=1e-12)
    # the accumulated statistics agree with the vectors (after o_proj)
    st = measure(t, c_hat, kr_hat).metrics()
    want = float(_to_out(t, delta).norm() / _to_out(t, T["o"]).norm())
    assert math.isclose(st["distortion"], want, rel_tol=1e-9)
    assert st["split_residual"] < 1e-10


def test_rope_only_error_is_pure_matching(v3_layers):
    _, _, layers = v3_layers
    t = layers[1][0]
    kr_hat = quantize_dequantize(t.k_rope, PathFormat(3, 8))
    T = split_terms(t, t.latent, kr_hat)
    assert float(T["aggregation"].abs().max()) == 0.0 and float(T["cross"].abs().max()) == 0.0
    torch.testing.assert_close(T["matching"], T["delta"], rtol=0, atol=1e-14)
    m = measure(t, t.latent, kr_hat).metrics()
    assert m["matching_share"] == 1.0 and m["content_rel_err"] == 0.0 and m["rope_rel_err"] > 0


def test_error_model_uses_the_real_attention_output(v3_layers):
    """o of the error model (through o_proj, plus its bias if any) is the HF attention module's output."""
    model, ids, layers = v3_layers
    with torch.no_grad(), capture_attention_inputs(model, outputs=True) as rec:
        model(ids, use_cache=False)
    from quantmla.model.spec import mla_modules

    for slot, m in mla_modules(model).items():
        t = layers[slot][0]
        o = _to_out(t, split_terms(t, t.latent, t.k_rope)["o"])
        if m.o_proj.bias is not None:
            o = o + m.o_proj.bias.double()
        torch.testing.assert_close(o.float(), rec[slot][0]["output"], rtol=1e-4, atol=1e-5)


def test_first_order_model_converges_at_high_bits(v3_layers):
    _, _, layers = v3_layers
    t = layers[0][0]
    errs = {}
    for bits in (2, 4, 8):
        for path in ("content", "rope", "both"):
            cf, rf = path_formats(path, bits, 16, 8)
            c_hat, kr_hat = quantize_paths(t, cf, rf)
            errs[(path, bits)] = measure(t, c_hat, kr_hat).metrics()["first_order_rel_err"]
    for path in ("content", "rope", "both"):
        # the first-order model's relative error shrinks with the quantization error ...
        assert errs[(path, 8)] < errs[(path, 4)] < errs[(path, 2)]
        # ... and is small at INT8 (its residual is second order in a ~0.4% cache error)
        assert errs[(path, 8)] < 0.01


def _synthetic(scale_q_rope: float, seed: int = 0) -> LayerTensors:
    """A layer whose RoPE key has one dominant, slowly rotating frequency pair where q^R is large too."""
    g = torch.Generator().manual_seed(seed)
    B, H, S, d_c, d_r, d_v = 1, 4, 48, 32, 16, 8
    pos = torch.arange(S, dtype=torch.float64)
    theta = 10000.0 ** (-torch.arange(d_r // 2, dtype=torch.float64) * 2 / d_r)
    amp = torch.ones(d_r // 2, dtype=torch.float64)
    amp[-1] = 6.0  # the lowest-frequency pair (rotate-half pair d_r/2 - 1) carries the energy
    ph = torch.rand(d_r // 2, generator=g, dtype=torch.float64) * 6.28
    ang = pos[:, None] * theta + ph
    kr = torch.cat([amp * torch.cos(ang), amp * torch.sin(ang)], -1)[None] + 0.1 * torch.randn(B, S, d_r, generator=g, dtype=torch.float64)
    qr = torch.randn(B, H, S, d_r, generator=g, dtype=torch.float64)
    qr[..., [d_r // 2 - 1, d_r - 1]] *= 4.0
    return LayerTensors(
        q_lat=torch.randn(B, H, S, d_c, generator=g, dtype=torch.float64) * 0.3,
        q_rope=qr * scale_q_rope,
        latent=torch.randn(B, S, d_c, generator=g, dtype=torch.float64),
        k_rope=kr,
        w_uv=torch.randn(H, d_v, d_c, generator=g, dtype=torch.float64) / d_c**0.5,
        scale=(16 + d_r) ** -0.5,
        w_o=torch.randn(24, H * d_v, generator=g, dtype=torch.float64),
    )


def _dist(t: LayerTensors, path: str, bits: int = 4) -> float:
    cf, rf = path_formats(path, bits, 16, 8)
    return measure(t, *quantize_paths(t, cf, rf)).metrics()["distortion"]


def test_rope_vs_content_ordering_follows_query_energy():
    """The RoPE path's share of the distortion is a computed property: it grows with the RoPE
    query's energy while the content-only distortion does not move."""
    ratios, content = [], []
    for s in (0.25, 1.0, 4.0):
        t = _synthetic(s)
        content.append(_dist(t, "content"))
        ratios.append(_dist(t, "rope") / content[-1])
    assert ratios[0] < ratios[1] < ratios[2]
    # the RoPE-only distortion overtakes the content-only one somewhere on this sweep
    assert ratios[0] < 1 < ratios[2]
    # (content-only distortion changes only through the softmax weights, which q^R also sets)
    assert max(content) / min(content) < ratios[2] / ratios[0]


def test_pair_energies_find_the_dominant_pair():
    t = _synthetic(1.0)
    spec_pairs = (torch.arange(8), torch.arange(8) + 8)  # rotate-half pairs of d_r = 16
    e = pair_energies(t, spec_pairs)
    k = torch.tensor(e["k_rope_rms"])
    assert int(k.argmax()) == 7
    # per-channel RMS of a pair of amplitude 6 is 6/√2 (the noise adds a little)
    assert abs(float(k[7]) - 6 / math.sqrt(2)) < 0.1
    assert int(torch.tensor(e["q_rope_rms"]).argmax()) == 7
    # the interleaved pairing of the same channels splits that energy over the pairs holding
    # channels 7 and 15 — (6, 7) and (14, 15) — each below the true pair's
    inter = torch.tensor(pair_energies(t, (2 * torch.arange(8), 2 * torch.arange(8) + 1))["k_rope_rms"])
    assert set(inter.topk(2).indices.tolist()) == {3, 7} and float(inter.max()) < float(k[7])
    # the per-pair logit error equals its brute-force definition
    kr_hat = quantize_dequantize(t.k_rope, PathFormat(4, 8))
    ple = pair_logit_error(t, kr_hat, spec_pairs)
    e = kr_hat - t.k_rope
    for j in (0, 7):
        ch = [j, j + 8]
        direct = (t.scale * torch.einsum("bhsx,btx->bhst", t.q_rope[..., ch], e[..., ch])).pow(2).mean()
        assert math.isclose(ple[j], float(direct), rel_tol=1e-9)


def test_analyze_model_summary_is_consistent(v3_layers):
    model, ids, _ = v3_layers
    r = analyze_model(model, ids, bits=(2, 8), content_group=16, rope_group=8)
    spec = load_spec(model)
    assert [L["layer"] for L in r["layers"]] == list(spec.mla_layers)
    for b in ("2", "8"):
        worse = sum(L["runs"]["rope"][b]["distortion"] > L["runs"]["content"][b]["distortion"] for L in r["layers"])
        assert r["summary"]["by_bits"][b]["layers_rope_worse"] == worse
        for L in r["layers"]:
            c, ro = L["runs"]["content"][b], L["runs"]["rope"][b]
            amp = (ro["distortion"] / ro["rope_rel_err"]) / (c["distortion"] / c["content_rel_err"])
            assert math.isclose(L["rope_amplification"][b], amp, rel_tol=1e-9)
            assert len(L["pairs"]["k_rope_rms"]) == spec.d_r // 2
    assert r["summary"]["first_order_check"]["max_rel_err"] < 0.01


def test_analyze_rejects_bad_groups_and_layers(v3_layers):
    from quantmla.errors import QuantMLAError

    model, ids, _ = v3_layers
    with pytest.raises(QuantMLAError, match="group size 12"):
        analyze_model(model, ids, content_group=16, rope_group=12)
    with pytest.raises(QuantMLAError, match="not MLA layers"):
        analyze_model(model, ids, content_group=16, rope_group=8, layers=[7])


# -- the command ------------------------------------------------------------------------------------


def _checkpoint(root: Path) -> tuple[Path, Path]:
    from quantmla.corpus.datasets import write_jsonl
    from quantmla_lab.training.tokenizer import train_tokenizer, wrap

    std = Path(sysconfig.get_paths()["stdlib"])
    docs = [(std / n).read_text() for n in ("textwrap.py", "shlex.py", "fnmatch.py")]
    tok = wrap(train_tokenizer(docs, 300))
    model = tiny_model("minicpm3", vocab_size=300)
    model.save_pretrained(root / "m")
    tok.save_pretrained(root / "m")
    write_jsonl(root / "heldout" / "code.jsonl", [{"text": d} for d in docs[1:]])
    return root / "m", root / "heldout"


def test_analyze_command_writes_json_and_plots(tmp_path):
    from quantmla.cli import main

    model_dir, heldout = _checkpoint(tmp_path)
    out = tmp_path / "out"
    rc = main(["analyze", str(model_dir), "--heldout", str(heldout), "--seq-len", "32", "--num-seqs", "2",
               "--bits", "3", "8", "--content-group", "16", "--rope-group", "8", "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "analysis.json").read_text())
    assert r["settings"]["bits"] == [3, 8] and len(r["layers"]) == 2
    assert "RoPE amplification" in (out / "summary.md").read_text()
    for png in ("distortion", "split", "pairs", "first_order"):
        p = out / f"{png}.png"
        assert p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size < 200_000
    from quantmla.analysis.overview import write_overview

    path, why = write_overview(str(tmp_path))
    md = Path(path).read_text()
    assert why is None and md.count("| [m](out/summary.md) |") == 2  # one line per bit width
    assert "per-token groups: content 16, RoPE 8 channels" in md  # the run's groups, not the defaults
    # a README.md that is not an overview, or the current directory, is never written over
    (tmp_path / "README.md").write_text("# my project\n")
    assert write_overview(str(tmp_path))[0] is None and (tmp_path / "README.md").read_text() == "# my project\n"
    assert write_overview("")[0] is None


def test_analyze_command_errors(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantmla.cli import main

    assert main(["analyze", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(llama)
    assert main(["analyze", str(llama)]) == 2
    assert "not a Multi-Head Latent Attention model" in capsys.readouterr().err
    for flags in (["--num-seqs", "0"], ["--seq-len", "1"]):  # refused before the model is read
        assert main(["analyze", str(llama), *flags]) == 2
        assert "give at least 1 sequence of at least 2 tokens" in capsys.readouterr().err


def test_analyze_default_output_and_unwritable_output(tmp_path, monkeypatch, capsys):
    """The default output is out/analysis/<model>, outside the tracked results/; an unwritable --out is
    reported before the model is loaded."""
    from quantmla.cli import main

    model_dir, heldout = _checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    args = ["analyze", str(model_dir), "--heldout", str(heldout), "--seq-len", "32", "--num-seqs", "1", "--bits", "4",
            "--content-group", "16", "--rope-group", "8", "--no-plots"]
    assert main(args) == 0
    assert (tmp_path / "out" / "analysis" / "m" / "analysis.json").exists() and not (tmp_path / "results").exists()

    def no_work(*a, **k):
        raise AssertionError("weights were loaded before the output was checked")

    monkeypatch.setattr("quantmla.model.load.load_model", no_work)
    (tmp_path / "a-file").write_text("")
    assert main(args + ["--out", str(tmp_path / "a-file" / "sub")]) == 2
    assert "cannot write into" in capsys.readouterr().err


def test_analyze_refuses_16_bits_and_contexts_past_the_model(tmp_path, monkeypatch, capsys):
    """16 bits quantize nothing (every error ratio would be 0/0 and the overview would fail half written), and a
    --seq-len past max_position_embeddings measures positions the model is not built for: both are refused before
    any weights are read; analyze_model refuses 16 bits too."""
    import json as _json

    from quantmla.cli import main
    from quantmla.errors import QuantMLAError

    model_dir, heldout = _checkpoint(tmp_path)
    max_pos = _json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]

    def no_work(*a, **k):
        raise AssertionError("weights were loaded before the arguments were checked")

    monkeypatch.setattr("quantmla.model.load.load_model", no_work)
    base = ["analyze", str(model_dir), "--heldout", str(heldout), "--num-seqs", "1", "--content-group", "16",
            "--rope-group", "8", "--out", str(tmp_path / "o")]
    assert main(base + ["--seq-len", "32", "--bits", "4", "16"]) == 2
    assert "--bits 16" in capsys.readouterr().err
    assert main(base + ["--seq-len", str(max_pos + 1), "--bits", "4"]) == 2
    assert f"max_position_embeddings {max_pos}" in capsys.readouterr().err
    model = tiny_model("deepseek_v3")
    with pytest.raises(QuantMLAError, match="integer codes"):
        analyze_model(model, torch.zeros(1, 8, dtype=torch.long), bits=(4, 16), content_group=16, rope_group=8)


def test_overview_failure_leaves_the_old_overview(tmp_path, monkeypatch):
    """The overview is made whole before README.md is opened: a failure while making it leaves the file as it was."""
    from quantmla.analysis import overview

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "analysis.json").write_text("{}")
    old = overview.TITLE + "\n\nthe previous overview\n"
    (tmp_path / "README.md").write_text(old)
    monkeypatch.setattr(overview, "_load", lambda root: [{"model": "m"}])

    def broken(results):
        raise TypeError("a figure that cannot be formatted")

    monkeypatch.setattr(overview, "overview_markdown", broken)
    with pytest.raises(TypeError):
        overview.write_overview(str(tmp_path))
    assert (tmp_path / "README.md").read_text() == old
