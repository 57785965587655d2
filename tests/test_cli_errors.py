"""The user's path through the `quantmla` command: bad input gives a non-zero exit status and a
short message on stderr that names the problem and the fix, never a Python traceback.

Every test here goes through the real entry point (``quantmla.cli.main``, or the installed
``quantmla`` script in a subprocess) and stays well under 10 s on two CPU cores: the errors are
raised before any weights are read, except for the NaN-weights case, which stops at the first
layer of a tiny model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantmla.cli import SUBCOMMANDS, main
from quantmla.model.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "models" / "qmla-ref-deepseek-v3"
needs_ref = pytest.mark.skipif(not (REF / "config.json").exists(), reason="reference model not shipped here")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_clean_error(rc: int, out: str, err: str, *needles: str, command: str | None = None) -> str:
    """Non-zero status; one to a few lines on stderr, prefixed by the subcommand, matching every
    regex in `needles` (the problem and the fix); no traceback anywhere."""
    assert rc != 0, (out, err)
    assert "Traceback" not in err and "Traceback" not in out, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 4, err
    if command:
        assert lines[-1].startswith(f"quantmla {command}: error: "), err
    for n in needles:
        assert re.search(n, err, re.IGNORECASE | re.DOTALL), f"{n!r} not in: {err}"
    return err


# -- checkpoints --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny MLA checkpoint with a tokenizer (deepseek_v3 family, d_c 32, d_r 16), the same with
    non-finite weights, one that `quantmla calibrate` wrote for INT2/INT4, and two non-MLA models."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from quantmla.cache.config import QuantCacheConfig
    from quantmla_lab.training.tokenizer import save_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("cli_errors")
    text = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))
    (root / "calib.txt").write_text(text)
    tok = train_tokenizer([text], vocab_size=300)

    model = tiny_model("deepseek_v3", vocab_size=300)
    model.save_pretrained(root / "mla")
    save_tokenizer(tok, root / "mla")

    with torch.no_grad():  # a checkpoint whose first attention block has NaN weights
        model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight[3, :5] = float("nan")
    model.save_pretrained(root / "nan")
    save_tokenizer(tok, root / "nan")

    calibrated = tiny_model("deepseek_v3", vocab_size=300)  # what `quantmla calibrate` writes (transforms aside)
    QuantCacheConfig.of_bits(2, 4, 32, 16, method="quantmla").attach(calibrated)
    calibrated.save_pretrained(root / "calibrated")
    save_tokenizer(tok, root / "calibrated")

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(root / "llama")
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(root / "gpt2")
    (root / "empty").mkdir()
    return root


def calib_args(root: Path, out: Path) -> list:
    """A calibration sized to stop fast: 2 rows of 16 tokens, 1 step."""
    return ["--calib", root / "calib.txt", "--calib-seqs", "2", "--seq-len", "16", "--steps", "1", "--out", out,
            "--no-progress"]


# -- --help and --json ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [None, *SUBCOMMANDS])
def test_help_exits_zero(command, capsys):
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: quantmla" + ("" if command is None else f" {command}"))
    if command is None:
        assert all(name in out for name in SUBCOMMANDS)


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage: quantmla" in capsys.readouterr().out


@needs_ref
def test_spec_json_parses(capsys):
    rc, out, _ = run_cli(capsys, "spec", REF, "--json")
    assert rc == 0
    d = json.loads(out)
    assert (d["family"], d["d_c"], d["d_r"]) == ("deepseek_v3", 128, 32)


@needs_ref
def test_bytes_json_parses(capsys):
    rc, out, _ = run_cli(capsys, "bytes", "--json")
    assert rc == 0
    d = json.loads(out)
    assert (d["d_c"], d["d_r"]) == (512, 64) and d["rows"][0]["format"] == "BF16"
    rc, out, _ = run_cli(capsys, "bytes", "--model", REF, "--json")
    assert rc == 0 and (json.loads(out)["d_c"], json.loads(out)["d_r"]) == (128, 32)


def test_calibrate_json_parses(ckpts, tmp_path, capsys):
    rc, out, _ = run_cli(capsys, "calibrate", ckpts / "mla", "--content-bits", "2", "--rope-bits", "4",
                         "--content-group", "32", "--rope-group", "16", *calib_args(ckpts, tmp_path / "o"), "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["method"] == "quantmla" and d["out"] == str(tmp_path / "o") and len(d["layers"]) == 2


def test_calibrate_stores_the_content_clip(ckpts, tmp_path, capsys):
    """--content-clip reaches the checkpoint's cache config (and so every cache and engine that loads it)."""
    from quantmla.cache.config import QuantCacheConfig

    rc, _, _ = run_cli(capsys, "calibrate", ckpts / "mla", "--content-bits", "2", "--content-group", "32",
                       "--rope-group", "16", "--content-clip", "0.875", *calib_args(ckpts, tmp_path / "o"))
    assert rc == 0
    stored = QuantCacheConfig.from_model_config(json.loads((tmp_path / "o" / "config.json").read_text()))
    assert stored.content.clip == 0.875 and stored.rope.clip == 1.0


# -- a) a model path that does not exist --------------------------------------------------------------


def prompts_file(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.txt"
    p.write_text("def f(x):\n    return x\n")
    return p


@pytest.mark.parametrize("command", ["spec", "analyze", "eval", "calibrate", "bytes", "serve-bench", "serve"])
def test_missing_model_path(command, tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    argv = {"calibrate": [missing, "--out", tmp_path / "o"], "eval": [missing, "--out", tmp_path / "res"],
            "bytes": ["--model", missing], "serve-bench": ["--model", missing, "--out", tmp_path / "s.json"],
            "serve": [missing, "--prompts", prompts_file(tmp_path), "--device", "cpu"]}
    rc, out, err = run_cli(capsys, command, *argv.get(command, [missing]))
    assert_clean_error(rc, out, err, "no-such-model", "does not exist", "pass (a|the) checkpoint directory",
                       command=command)
    assert not (tmp_path / "o").exists() and not (tmp_path / "res").exists()


@pytest.mark.parametrize("command", ["spec", "analyze", "eval", "calibrate", "serve"])
def test_directory_without_config(command, ckpts, tmp_path, capsys):
    extra = {"calibrate": ["--out", tmp_path / "o"], "eval": ["--out", tmp_path / "res"],
             "serve": ["--prompts", prompts_file(tmp_path), "--device", "cpu"]}.get(command, [])
    rc, out, err = run_cli(capsys, command, ckpts / "empty", *extra)
    assert_clean_error(rc, out, err, "no config.json", "directory that holds", command=command)


# -- b) a model without Multi-Head Latent Attention --------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("command", ["spec", "analyze", "eval", "calibrate", "serve"])
def test_non_mla_model(command, family, ckpts, tmp_path, capsys):
    extra = {"calibrate": ["--out", tmp_path / "o"], "eval": ["--out", tmp_path / "res"],
             "serve": ["--prompts", prompts_file(tmp_path), "--device", "cpu"]}.get(command, [])
    rc, out, err = run_cli(capsys, command, ckpts / family, *extra)
    assert_clean_error(rc, out, err, f"'{family}' is not a Multi-Head Latent Attention model", "kv_lora_rank",
                       "QuantMLA needs MLA attention", "deepseek_v2/v3", command=command)
    assert not (tmp_path / "o").exists()


# -- c) formats the kernels or the model cannot take ---------------------------------------------------


@pytest.mark.parametrize("methods, needles", [
    ("int3/int4", ["int3/int4", "2/4/8-bit codes or BF16, not 3-bit", "choose from bf16, fp8, int8/int8"]),
    ("int5/int4", ["int5/int4", "not 5-bit", "choose from"]),
    ("int4/int4,fp4", ["unknown method 'fp4'", "choose from"]),
])
def test_bench_kernel_unsupported_bits(methods, needles, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "bench-kernel", "--methods", methods, "--out", tmp_path / "k.json")
    assert_clean_error(rc, out, err, "--methods", *needles, command="bench-kernel")
    assert not (tmp_path / "k.json").exists()


def test_bench_kernel_bad_shape(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "bench-kernel", "--shapes", "32x", "--out", tmp_path / "k.json")
    assert_clean_error(rc, out, err, "--shapes", "'32x' is not BATCHxCONTEXT", "e.g. 32x16384", command="bench-kernel")


@pytest.mark.parametrize("methods, needles", [
    ("int3/int4", ["--methods int3/int4", r"take \(2, 4, 8\)-bit codes or BF16, not 3-bit", "--backend torch"]),
    ("int5/int4", ["--methods int5/int4", "unsupported bit width 5", r"bits in \(2, 3, 4, 8\)"]),
    ("bf16 int4-int4", ["--methods int4-int4", "unknown cache method", "use bf16, fp8 or intC/intR"]),
])
def test_serve_bench_unsupported_bits(methods, needles, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "serve-bench", "--methods", *methods.split(), "--out", tmp_path / "s.json")
    assert_clean_error(rc, out, err, *needles, command="serve-bench")
    assert not (tmp_path / "s.json").exists()


def test_serve_bench_negative_stall_limit(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "serve-bench", "--stall-seconds", "-5", "--out", tmp_path / "s.json")
    assert_clean_error(rc, out, err, "--stall-seconds -5", "or 0 to never end it", command="serve-bench")
    assert not (tmp_path / "s.json").exists()


def test_serve_bench_repeats_below_one(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "serve-bench", "--repeats", "0", "--out", tmp_path / "s.json")
    assert_clean_error(rc, out, err, "--repeats 0", "1 or more", command="serve-bench")
    assert not (tmp_path / "s.json").exists()


def test_serve_bench_group_not_dividing_the_model(ckpts, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "serve-bench", "--model", ckpts / "mla", "--methods", "int4/int4",
                           "--content-group", "64", "--out", tmp_path / "s.json")
    assert_clean_error(rc, out, err, "--methods int4/int4", "group_size 64 does not divide its 32 channels",
                       "pick a group size that divides 32", command="serve-bench")


def test_serve_bench_replot_draws_the_figure(tmp_path, capsys):
    """--replot draws a saved result's figure beside it, on any machine (no GPU needed)."""
    runs = [{"method": m, "budget_gib": b, "tokens_per_s": t, "ratio_to_bf16": t / bf}
            for b, bf in ((0.1, 100.0), (1.0, 900.0)) for m, t in (("bf16", bf), ("int4/int4", 3 * bf))]
    res = {"device": "test", "date": "2026-11-30", "settings": {"requests": 4}, "runs": runs}
    src = tmp_path / "r.json"
    src.write_text(json.dumps(res))
    rc, out, err = run_cli(capsys, "serve-bench", "--replot", src)
    png = tmp_path / "r.png"
    assert rc == 0 and str(png) in out, (out, err)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_serve_bench_replot_bad_files(tmp_path, capsys):
    check = tmp_path / "check.json"
    check.write_text(json.dumps({"correctness": {"ok": True}}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    for path, needle in ((check, "not a serve-bench result with runs"), (broken, "not JSON"),
                         (tmp_path / "none.json", "no such file")):
        rc, out, err = run_cli(capsys, "serve-bench", "--replot", path)
        assert_clean_error(rc, out, err, needle, command="serve-bench")
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("command", ["serve-bench", "bench-kernel"])
def test_gpu_commands_without_a_gpu(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # bench-kernel's CPU dry run needs the interpreter and --smoke
    rc, out, err = run_cli(capsys, command, "--out", tmp_path / "x.json")
    assert_clean_error(rc, out, err, "GPU", "run it on a (GPU|machine)", command=command)


@pytest.mark.parametrize("flags, needles", [
    (["--content-bits", "5"], ["--content-bits 5", "unsupported bit width 5", r"bits in \(2, 3, 4, 8\)"]),
    (["--rope-bits", "5"], ["--rope-bits 5", "unsupported bit width 5", r"bits in \(2, 3, 4, 8\)"]),
    (["--content-group", "64"], ["--content-group 64", r"content path \(kv_lora_rank 32\)",
                                 "group_size 64 does not divide its 32 channels", "pick a group size that divides 32"]),
    (["--rope-group", "32"], ["--rope-group 32", r"RoPE path \(qk_rope_head_dim 16\)", "pick a group size that divides 16"]),
    (["--content-group", "24"], ["--content-group 24", "group_size must be a power of two"]),
    (["--content-clip", "0.85"], ["--content-clip 0.85", r"clip must be one of .*1 - 2\^-k"]),
    (["--content-bits", "16", "--content-clip", "0.875"], ["--content-clip 0.875", "no range to clip"]),
])
def test_calibrate_unsupported_format(flags, needles, ckpts, tmp_path, capsys):
    opts = {"--content-group": "32", "--rope-group": "16"}  # formats that fit d_c 32, d_r 16 ...
    opts.update(zip(flags[::2], flags[1::2]))  # ... but for the one under test
    rc, out, err = run_cli(capsys, "calibrate", ckpts / "mla", *[x for kv in opts.items() for x in kv],
                           *calib_args(ckpts, tmp_path / "o"))
    assert_clean_error(rc, out, err, *needles, command="calibrate")
    assert not (tmp_path / "o").exists()


def test_calibrate_json_error_leaves_stdout_empty(ckpts, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "calibrate", ckpts / "mla", "--content-bits", "5", *calib_args(ckpts, tmp_path / "o"),
                           "--json")
    assert_clean_error(rc, out, err, "unsupported bit width 5", command="calibrate")
    assert out == ""


def test_eval_unsupported_config(ckpts, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "eval", ckpts / "mla", "--config", "INT5/INT4", "--method", "rtn", "--out", tmp_path)
    assert_clean_error(rc, out, err, "--config INT5/INT4", "unsupported bit width 5", r"bits in \(2, 3, 4, 8\)",
                       command="eval")
    rc, out, err = run_cli(capsys, "eval", ckpts / "mla", "--config", "INT4/INT4", "--method", "rtn",
                           "--out", tmp_path)  # default --content-group 64 > d_c 32
    assert_clean_error(rc, out, err, r"INT4/INT4: the content path \(--content-group, kv_lora_rank 32\)",
                       "pick a group size that divides 32", command="eval")
    assert not (tmp_path / "accuracy.json").exists()


def test_analyze_unsupported_bits(ckpts, capsys):
    rc, out, err = run_cli(capsys, "analyze", ckpts / "mla", "--bits", "4", "5", "--content-group", "32", "--rope-group", "16")
    assert_clean_error(rc, out, err, "--bits 5", "unsupported bit width 5", command="analyze")
    rc, out, err = run_cli(capsys, "analyze", ckpts / "mla", "--bits", "4", "--rope-group", "16")
    assert_clean_error(rc, out, err, "--bits 4 --content-group 64", "pick a group size that divides 32", command="analyze")


# -- d) a calibrated checkpoint asked for a cache it was not calibrated for ------------------------


def test_eval_config_mismatch_with_checkpoint(ckpts, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "eval", ckpts / "calibrated", "--config", "INT4/INT4", "--method", "quantmla",
                           "--content-group", "32", "--rope-group", "16", "--out", tmp_path)
    assert_clean_error(
        rc, out, err,
        r"calibrated \(quantmla\) for content INT2/g32 \+ RoPE INT4/g16",  # the checkpoint's config
        r"cache requested is content INT4/g32 \+ RoPE INT4/g16",  # the one asked for
        "--config INT2/INT4 --content-group 32 --rope-group 16",  # the fix
        "calibrate the original checkpoint for INT4/INT4 "
        r"\(quantmla calibrate ORIGINAL --content-bits 4 --rope-bits 4 --content-group 32 --rope-group 16", command="eval")
    # the right formats, but a method that would calibrate the checkpoint a second time
    rc, out, err = run_cli(capsys, "eval", ckpts / "calibrated", "--config", "INT2/INT4", "--method", "quantmla",
                           "--content-group", "32", "--rope-group", "16", "--out", tmp_path)
    assert_clean_error(rc, out, err, "already calibrated", "would calibrate it again", "--method rtn", command="eval")
    assert not (tmp_path / "accuracy.json").exists()


def test_resolve_cache_config_raises_mismatch(ckpts):
    from transformers import AutoConfig

    from quantmla.cache.config import QuantCacheConfig, resolve_cache_config
    from quantmla.errors import CacheConfigMismatchError

    cfg = AutoConfig.from_pretrained(ckpts / "calibrated")
    assert resolve_cache_config(cfg, None).content.bits == 2
    with pytest.raises(CacheConfigMismatchError, match="calibrated .* but the cache requested is .*calibrate"):
        resolve_cache_config(cfg, QuantCacheConfig.of_bits(4, 4, 32, 16))


def test_calibrate_an_already_calibrated_checkpoint(ckpts, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "calibrate", ckpts / "calibrated", "--content-group", "32", "--rope-group", "16",
                           *calib_args(ckpts, tmp_path / "o"))
    assert_clean_error(rc, out, err, "already calibrated", r"quantmla, content INT2/g32", "original", command="calibrate")


# -- e) non-finite activations ------------------------------------------------------------------------


def test_calibrate_nan_weights(ckpts, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "calibrate", ckpts / "nan", "--content-group", "32", "--rope-group", "16",
                           *calib_args(ckpts, tmp_path / "o"))
    assert_clean_error(rc, out, err, "MLA layer 0", r"\d+ NaN and 0 Inf", "latent",
                       r"attention weights are not finite \(kv_a_proj_with_mqa.weight\)",
                       "repair or re-download the checkpoint", command="calibrate")
    assert not (tmp_path / "o").exists()


def test_nan_activations_raise_nonfinite_error():
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.calibration.api import calibrate
    from quantmla.errors import NonFiniteError

    model = tiny_model("deepseek_v3")
    with torch.no_grad():
        model.model.embed_tokens.weight[5] = float("inf")  # token 5's embedding: NaN/Inf from layer 0 on
    ids = torch.randint(6, 128, (2, 16))
    ids[1, 7] = 5
    with pytest.raises(NonFiniteError, match="MLA layer 0.*input hidden states are already non-finite"):
        calibrate(model, ids, QuantCacheConfig.of_bits(4, 4, 32, 16), steps=1, progress=False)


# -- the installed script ------------------------------------------------------------------------------


def test_installed_script_reports_without_traceback(tmp_path):
    script = Path(sys.executable).with_name("quantmla")
    if not script.exists():
        script = shutil.which("quantmla")
        if script is None:
            pytest.skip("the quantmla script is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([str(script), "spec", str(tmp_path / "missing")], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr + p.stdout
    assert p.stderr.startswith("quantmla spec: error: ") and "does not exist" in p.stderr


def test_python_m_cli_reports_a_commands_error_without_traceback(ckpts):
    """`python -m quantmla.cli` runs cli as __main__; an error a command module raises is still the one class main
    catches (it lives in quantmla.errors), so it is a message and exit status 2, not a traceback."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-m", "quantmla.cli", "eval", str(ckpts / "mla"), "--config", "INT4/INT4",
                        "--method", "quantmla", "--content-group", "16", "--rope-group", "8", "--calib-len", "1"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr + p.stdout, p.stderr[-500:]
    assert "--calib-len" in p.stderr


def test_checkpoint_without_weights(ckpts, tmp_path, capsys):
    from quantmla.model.tiny import tiny_config

    d = tmp_path / "noweights"
    tiny_config("deepseek_v3", vocab_size=300).save_pretrained(d)
    for f in (ckpts / "mla").glob("tokenizer*"):
        shutil.copy(f, d)
    rc, out, err = run_cli(capsys, "calibrate", d, "--content-group", "32", "--rope-group", "16",
                           *calib_args(ckpts, tmp_path / "o"))
    assert_clean_error(rc, out, err, "cannot load the weights", "no file named model.safetensors",
                       "must hold them", command="calibrate")


# -- quantmla serve ---------------------------------------------------------------------------------------


def test_serve_counts_the_positions_a_request_feeds():
    """A prompt of P tokens with N new ones feeds P + N - 1 positions (the last new token is never fed back): it
    fits a model of exactly that many, and one more is refused naming both."""
    from quantmla.cli import CLIError
    from quantmla.serving.scheduler import Request, SamplingParams
    from quantmla.serving.serve_command import check_lengths

    req = Request(0, [1] * 10, SamplingParams(max_new_tokens=7))
    assert req.positions == 16
    check_lengths([{"id": 0}], [req], 16)
    with pytest.raises(CLIError, match="needs 16 positions, but the model has max_position_embeddings 15"):
        check_lengths([{"id": 0}], [req], 15)


@pytest.mark.parametrize("content, needles", [
    ("", ["no prompts"]),
    ("not json\n", [r"prompts.jsonl:1: not a JSON object"]),
    ('{"prompt": "a", "prompt_ids": [1]}\n', [r":1: each line needs exactly one of"]),
    ('{"prompt_ids": []}\n', [r"\"prompt_ids\" must be a non-empty list of token ids"]),
    ('{"prompt_ids": [1], "id": 1}\n{"prompt_ids": [2]}\n', [r":2: id 1 is taken"]),
    ('{"prompt": "a", "max_new_tokens": "ten"}\n', [r"\"max_new_tokens\" must be a positive integer, got 'ten'"]),
])
def test_serve_bad_prompts(content, needles, ckpts, tmp_path, capsys):
    f = tmp_path / "prompts.jsonl"
    f.write_text(content)
    rc, out, err = run_cli(capsys, "serve", ckpts / "mla", "--prompts", f, "--device", "cpu")
    assert_clean_error(rc, out, err, *needles, command="serve")


@pytest.mark.parametrize("flags, needles", [
    (["--content-bits", "4"], ["give both --content-bits and --rope-bits"]),
    (["--content-bits", "5", "--rope-bits", "4"], ["bit width 5", r"bits in \(2, 3, 4, 8\)"]),
    (["--content-bits", "4", "--rope-bits", "4", "--content-group", "32", "--rope-group", "16"],
     [r"calibrated \(quantmla\) for content INT2/g32"]),  # the calibrated checkpoint, other formats
    (["--kv-budget-gib", "0"], ["--kv-budget-gib must be positive"]),
])
def test_serve_bad_formats(flags, needles, ckpts, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "serve", ckpts / "calibrated", "--prompts", prompts_file(tmp_path), "--device", "cpu",
                           *flags)
    assert_clean_error(rc, out, err, *needles, command="serve")


def test_serve_generates_what_generate_does(ckpts, tmp_path, capsys):
    """`quantmla serve` end to end on CPU: outputs in prompt order with their ids, BF16 greedy tokens equal
    transformers generate(); the calibrated checkpoint is served in its own formats; a request that can
    never fit the budget fails alone (exit status 1) and the others complete."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "def f1(x):", "id": "a"}\n{"prompt_ids": [5, 6, 7, 8], "max_new_tokens": 3}\n')
    out_path = tmp_path / "out.jsonl"
    rc, out, err = run_cli(capsys, "serve", ckpts / "mla", "--prompts", f, "--device", "cpu", "--dtype", "float32",
                           "--max-new-tokens", "6", "--ignore-eos", "--out", out_path)
    assert rc == 0, err
    rows = [json.loads(x) for x in out_path.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", 1] and [len(r["output_ids"]) for r in rows] == [6, 3]
    assert all(r["finish_reason"] == "length" for r in rows)
    model = AutoModelForCausalLM.from_pretrained(ckpts / "mla", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ckpts / "mla")
    for ids, r in ((tok("def f1(x):")["input_ids"], rows[0]), ([5, 6, 7, 8], rows[1])):
        ref = model.generate(torch.tensor([ids]), max_new_tokens=len(r["output_ids"]), do_sample=False,
                             min_new_tokens=len(r["output_ids"]))[0, len(ids):].tolist()
        assert r["output_ids"] == ref
    assert rows[0]["text"] == tok.decode(rows[0]["output_ids"], skip_special_tokens=True)

    rc, out, err = run_cli(capsys, "serve", ckpts / "calibrated", "--prompts", f, "--device", "cpu", "--max-new-tokens", "2")
    assert rc == 0 and "content INT2/g32 + RoPE INT4/g16" in err

    big = tmp_path / "big.jsonl"
    big.write_text('{"prompt_ids": [5, 6, 7]}\n{"prompt_ids": ' + json.dumps(list(range(3, 203))) + '}\n'
                   '{"prompt_ids": [5, 100000]}\n')
    rc, out, err = run_cli(capsys, "serve", ckpts / "mla", "--prompts", big, "--device", "cpu", "--kv-budget-gib", "0.00002",
                           "--max-new-tokens", "4")
    rows = [json.loads(x) for x in out.splitlines()]
    assert rc == 1 and [r["finish_reason"] for r in rows][1:] == ["error", "error"]
    assert "can never fit" in rows[1]["error"] and "token ids must lie in [0, 300); this prompt has 100000" in rows[2]["error"]
    assert rows[0]["finish_reason"] in ("length", "eos") and "Traceback" not in err


def test_calibrate_device_is_where_the_fits_run(ckpts, tmp_path, capsys, monkeypatch):
    """`--device` moves the model and puts the captured activations and the fits there too (it used to
    move only the model, so the fits ran on the CPU whatever the flag said)."""
    import quantmla.calibration.api as api
    from quantmla.errors import QuantMLAError

    seen = {}

    def spy(model, ids, quant, opts, **kw):
        seen["device"], seen["model"] = opts.device, next(model.parameters()).device.type
        raise QuantMLAError("stopped by the test")

    monkeypatch.setattr(api, "calibrate", spy)
    rc, out, err = run_cli(capsys, "calibrate", ckpts / "mla", "--content-group", "32", "--rope-group", "16",
                           *calib_args(ckpts, tmp_path / "o"), "--device", "meta")
    assert rc != 0 and "stopped by the test" in err and seen == {"device": "meta", "model": "meta"}
    rc, out, err = run_cli(capsys, "calibrate", ckpts / "mla", "--content-group", "32", "--rope-group", "16",
                           *calib_args(ckpts, tmp_path / "o2"))
    assert seen["device"] is None and seen["model"] == "cpu"
