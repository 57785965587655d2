"""Nothing silently wrong: a calibrated checkpoint's RoPE offsets reach every cache built for it,
a malformed quantization_config is refused by every loader, and bad command-line input (truncated
weights, a missing GPU, NaN budgets, unwritable outputs, prompts past the model's positions) stops
with one clear message before the work starts.

The checkpoints are tiny (deepseek_v3 family at toy size: d_c 32, d_r 16, 2 MLA slots, 512
positions); nothing here computes more than a few forward passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.hf_cache import QuantMLACache
from quantmla.cli import build_parser, main
from quantmla.errors import CacheConfigMismatchError, QuantMLAError
from quantmla.model.spec import load_spec
from quantmla.model.tiny import tiny_model

INT4 = QuantCacheConfig.of_bits(4, 4, 32, 16)  # formats that fit d_c 32, d_r 16


def offsets(spec, scale: float = 3.0, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {s: tuple((scale * torch.randn(spec.d_r, generator=g)).tolist()) for s in spec.mla_layers}


def calibrated(model, base: QuantCacheConfig = INT4):
    """`model` with a calibrated quantization_config (offsets on every slot) attached; returns that config."""
    q = dataclasses.replace(base, method="quantmla", rope_offsets=offsets(load_spec(model)))
    q.attach(model)
    return q


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_clean_error(rc: int, err: str, command: str, *needles: str) -> None:
    """Non-zero status, a short message prefixed by the subcommand, every regex of `needles`, no traceback."""
    assert rc != 0, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 4 and lines[-1].startswith(f"quantmla {command}: error: "), err
    for n in needles:
        assert re.search(n, err, re.IGNORECASE | re.DOTALL), f"{n!r} not in: {err}"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny checkpoints with a tokenizer: "mla" (plain, 512 positions), "cal" (calibrated for INT4/INT4,
    offsets on every slot)."""
    from quantmla_lab.training.tokenizer import save_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("safety")
    text = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))
    (root / "calib.txt").write_text(text)
    tok = train_tokenizer([text], vocab_size=300)
    for name in ("mla", "cal"):  # "cal" is built for 4096 positions (eval's retrieval lengths)
        model = tiny_model("deepseek_v3", vocab_size=300, **({"max_position_embeddings": 4096} if name == "cal" else {}))
        if name == "cal":
            calibrated(model)
        model.save_pretrained(root / name)
        save_tokenizer(tok, root / name)
    return root


def copy_ckpt(src: Path, dst: Path, edit_qc=None, weights: bytes | None = None) -> Path:
    """A copy of checkpoint `src` at `dst`; `edit_qc(dict)` edits its quantization_config in place;
    `weights` replaces model.safetensors' bytes."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if edit_qc is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit_qc(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        (dst / "model.safetensors").write_bytes(weights)
    return dst


# -- #19 item 0: a cache built for a calibrated model carries its offsets -------------------------------


def test_cache_for_a_calibrated_model_takes_its_offsets_or_refuses():
    model = tiny_model("deepseek_v3")
    stored = calibrated(model)
    cache = QuantMLACache(model, INT4)  # the formats asked for explicitly, as `eval --method rtn` does
    for lay in cache.mla_layers():
        torch.testing.assert_close(lay.rope_offset, torch.tensor(stored.rope_offsets[lay.layer_idx]))
    assert cache.quant.rope_offsets == stored.rope_offsets
    with pytest.raises(CacheConfigMismatchError, match="calibrated"):  # other formats: the transforms do not fit
        QuantMLACache(model, QuantCacheConfig.of_bits(2, 4, 32, 16))
    foreign = dataclasses.replace(INT4, rope_offsets=offsets(load_spec(model), seed=5))
    with pytest.raises(CacheConfigMismatchError, match="RoPE offsets other than"):
        QuantMLACache(model, foreign)
    ref = QuantMLACache(model, QuantCacheConfig.of_bits(16, 16))  # a 16-bit reference read needs no offsets
    assert all(lay.rope_offset is None for lay in ref.mla_layers())


def test_engine_for_a_calibrated_model_takes_its_offsets():
    from quantmla.serving.engine import Engine, EngineConfig

    model = tiny_model("deepseek_v3")
    stored = calibrated(model)
    eng = Engine(model, EngineConfig(quant=INT4, num_pages=8, page_size=16, backend="torch", cuda_graphs=False))
    try:
        assert set(eng.rope_offsets) == set(stored.rope_offsets)
        for s, c in eng.rope_offsets.items():
            torch.testing.assert_close(c.cpu(), torch.tensor(stored.rope_offsets[s]))
    finally:
        eng.close()


def test_eval_rtn_on_a_calibrated_checkpoint_reads_through_its_offsets(ckpts, tmp_path, capsys, monkeypatch):
    """`quantmla eval CKPT --config INT4/INT4 --method rtn` on a calibrated checkpoint: every cache the
    perplexity and retrieval code builds carries the checkpoint's offsets."""
    from quantmla.evaluation import harness

    seen = []

    def ppl(model, tok, chunks, seq_len, cache_factory):
        seen.append(cache_factory(model))
        return {"bits_per_byte": 1.0, "tokens": 1}

    def retrieval(model, tok, samples, cache_factory):
        seen.append(cache_factory(model))
        return {"accuracy": 1.0, "n": len(samples), "correct": len(samples)}

    monkeypatch.setattr(harness, "_ppl_fn", lambda: ppl)
    monkeypatch.setattr(harness, "_retrieval_fn", lambda: retrieval)
    rc, out, err = run_cli(capsys, "eval", ckpts / "cal", "--config", "INT4/INT4", "--method", "rtn", "--content-group",
                           "32", "--rope-group", "16", "--seq-len", "16", "--ppl-chunks", "1", "--retrieval-n", "1",
                           "--lengths", "1024", "--out", tmp_path / "res")
    assert rc == 0, err
    stored = QuantCacheConfig.from_dict(json.loads((ckpts / "cal" / "config.json").read_text())["quantization_config"])
    assert len(seen) == 2
    for cache in seen:
        assert {lay.layer_idx for lay in cache.mla_layers() if lay.rope_offset is not None} == set(stored.rope_offsets)
        for lay in cache.mla_layers():
            torch.testing.assert_close(lay.rope_offset, torch.tensor(stored.rope_offsets[lay.layer_idx]))


def test_eval_refuses_kivi_on_a_calibrated_checkpoint(ckpts, tmp_path, capsys, monkeypatch):
    """KIVI stores RoPE keys its own way: on a calibrated checkpoint it would drop the offsets, so eval refuses
    before reading the weights."""

    monkeypatch.setattr("quantmla.model.load.load_model", lambda *a, **k: pytest.fail("eval read the weights first"))
    rc, out, err = run_cli(capsys, "eval", ckpts / "cal", "--config", "INT4/INT4", "--method", "kivi", "--content-group",
                           "32", "--rope-group", "16", "--out", tmp_path / "res")
    assert_clean_error(rc, err, "eval", "KIVI baseline", "without the checkpoint's RoPE offsets", "original checkpoint")


# -- #18: reset keeps the offsets ---------------------------------------------------------------------


def test_reset_keeps_the_rope_offsets():
    model = tiny_model("deepseek_v3")
    q = dataclasses.replace(INT4, rope_offsets=offsets(load_spec(model)))
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = QuantMLACache(model, q)
    with torch.no_grad():
        model(ids[:, :5], past_key_values=cache, use_cache=True)
        cache.reset()
        assert all(lay.rope_offset is not None for lay in cache.mla_layers())
        assert cache.get_seq_length() == 0
        after_reset = model(ids, past_key_values=cache, use_cache=True).logits
        fresh = model(ids, past_key_values=QuantMLACache(model, q), use_cache=True).logits
    torch.testing.assert_close(after_reset, fresh, rtol=0, atol=0)


# -- #19 item 4: a malformed quantization_config is refused by every loader -------------------------------


def _drop(key):
    return lambda qc: qc.pop(key)


def _set(key, value):
    return lambda qc: qc.__setitem__(key, value)


BROKEN = {
    "no rope_offsets": (_drop("rope_offsets"), r"no rope_offsets.*rope_centring\": false"),
    "a slot's offsets missing": (lambda qc: qc["rope_offsets"].pop("1"), r"no entry for cache slots \[1\]"),
    "offsets of a slot that does not exist": (lambda qc: qc["rope_offsets"].__setitem__("7", [0.0] * 16),
                                              r"cache slots \[7\].*MLA slots are \[0, 1\]"),
    "NaN offsets": (lambda qc: qc["rope_offsets"]["0"].__setitem__(3, math.nan), r"slot 0 hold NaN"),
    "no content format": (_drop("content"), r"no 'content' format.*calibrate the original checkpoint again"),
    "bits as a string": (lambda qc: qc["rope"].__setitem__("bits", "4"),
                         r"rope: bits must be an integer, got '4'.*without quotes"),
    "centring marker contradicts offsets": (_set("rope_centring", False), r"contradicts itself"),
}


def _load_quantized(path, capsys, tmp_path):
    from quantmla.calibration.checkpoint import load_quantized

    load_quantized(path)


def _engine(path, capsys, tmp_path):
    from quantmla.serving.engine import Engine

    Engine.from_pretrained(str(path), dtype=torch.float32, device="cpu")


def _cache(path, capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    import quantmla.hf_integration  # noqa: F401  (quant_method "quantmla" known to transformers)

    QuantMLACache(AutoModelForCausalLM.from_pretrained(path))


def _cli(command):
    def load(path, capsys, tmp_path):
        (tmp_path / "p.txt").write_text("def f(x):\n")
        extra = {"serve": ["--prompts", tmp_path / "p.txt", "--device", "cpu", "--out", tmp_path / "o.jsonl"],
                 "eval": ["--method", "rtn", "--config", "INT4/INT4", "--content-group", "32", "--rope-group", "16",
                          "--out", tmp_path / "res"]}[command]
        rc, out, err = run_cli(capsys, command, path, *extra)
        assert_clean_error(rc, err, command)
        raise QuantMLAError(err)  # the message, for the caller's match
    return load


LOADERS = {"load_quantized": _load_quantized, "Engine.from_pretrained": _engine, "QuantMLACache": _cache,
           "serve": _cli("serve"), "eval": _cli("eval")}


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", BROKEN)
def test_every_loader_refuses_a_broken_quantization_config(case, loader, ckpts, tmp_path, capsys, monkeypatch):

    edit, needle = BROKEN[case]
    path = copy_ckpt(ckpts / "cal", tmp_path / "ckpt", edit_qc=edit)
    monkeypatch.setattr("quantmla.model.load.load_model", lambda *a, **k: pytest.fail("the CLI read the weights first"))
    with pytest.raises(QuantMLAError, match=needle):
        LOADERS[loader](path, capsys, tmp_path)


def test_explicit_marker_without_offsets_loads(ckpts, tmp_path):
    """`"rope_centring": false` says the offsets are absent on purpose (calibration without centring)."""
    from quantmla.calibration.checkpoint import load_quantized

    def no_centring(qc):
        qc.pop("rope_offsets")
        qc["rope_centring"] = False

    path = copy_ckpt(ckpts / "cal", tmp_path / "ckpt", edit_qc=no_centring)
    model, _, q = load_quantized(path)
    assert q.rope_offsets == {} and all(lay.rope_offset is None for lay in QuantMLACache(model).mla_layers())
    assert QuantCacheConfig.of_bits(4, 4).to_dict()["rope_centring"] is False  # what writers record without centring


def test_calibrate_writes_every_slot_or_the_marker():
    """What calibrate writes loads again: offsets (null for an uncentred slot), or the no-centring marker."""
    from quantmla.calibration.api import calibrate

    ids = torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(0))
    model = tiny_model("deepseek_v3")
    spec = load_spec(model)
    calibrate(model, ids, INT4, steps=3, progress=False, verbose=False)
    d = model.config.quantization_config
    assert "rope_offsets" in d and set(d["rope_offsets"]) == {str(s) for s in spec.mla_layers}
    QuantCacheConfig.from_dict(d).check_model(spec)
    model = tiny_model("deepseek_v3")
    calibrate(model, ids, INT4, steps=2, rope_center=False, progress=False, verbose=False)
    d = model.config.quantization_config
    assert d["rope_centring"] is False and "rope_offsets" not in d
    QuantCacheConfig.from_dict(d).check_model(spec)


# -- #19 item 5 and 6: spec without kv_lora_rank, serve past the model's positions ---------------------------


def test_spec_of_an_mla_config_without_kv_lora_rank(ckpts, tmp_path, capsys):
    path = copy_ckpt(ckpts / "mla", tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["kv_lora_rank"]
    (path / "config.json").write_text(json.dumps(cfg))
    for command in ("spec", "calibrate"):
        extra = ["--out", tmp_path / "o"] if command == "calibrate" else []
        rc, out, err = run_cli(capsys, command, path, *extra)
        assert_clean_error(rc, err, command, "has no kv_lora_rank", "not a Multi-Head Latent Attention config")


def test_serve_refuses_a_prompt_past_the_models_positions(ckpts, tmp_path, capsys, monkeypatch):

    monkeypatch.setattr("quantmla.model.load.load_model", lambda *a, **k: pytest.fail("serve loaded the weights first"))
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_ids": [5, 6]}\n{"id": "long", "prompt_ids": ' + json.dumps([5] * 510) + "}\n")
    rc, out, err = run_cli(capsys, "serve", ckpts / "mla", "--prompts", f, "--device", "cpu", "--max-new-tokens", "4")
    assert_clean_error(rc, err, "serve", "prompt 'long' has 510 tokens", "needs 513 positions",
                       "max_position_embeddings 512", "shorten the prompt or lower --max-new-tokens")


# -- tracebacks and late errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["spec", "serve", "eval", "calibrate", "calibrate --stream"])
def test_truncated_weights(command, ckpts, tmp_path, capsys):
    good = (ckpts / "mla" / "model.safetensors").read_bytes()
    path = copy_ckpt(ckpts / "mla", tmp_path / "ckpt", weights=good[: len(good) // 2])
    (tmp_path / "p.txt").write_text("def f(x):\n")
    extra = {"serve": ["--prompts", tmp_path / "p.txt", "--device", "cpu"],
             "eval": ["--config", "INT4/INT4", "--method", "rtn", "--content-group", "32", "--rope-group", "16",
                      "--out", tmp_path / "res"],
             "calibrate": ["--content-group", "32", "--rope-group", "16", "--out", tmp_path / "o"],
             "calibrate --stream": ["--stream", "--content-group", "32", "--rope-group", "16", "--out", tmp_path / "o"]}
    name = command.split()[0]
    rc, out, err = run_cli(capsys, name, path, *extra.get(command, []))
    assert_clean_error(rc, err, name, r"model\.safetensors is truncated", "download the checkpoint again")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("command", ["eval", "calibrate", "analyze", "serve"])
def test_device_cuda_without_a_gpu(command, ckpts, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("def f(x):\n")
    extra = {"serve": ["--prompts", tmp_path / "p.txt"], "calibrate": ["--out", tmp_path / "o"],
             "eval": ["--out", tmp_path / "res"], "analyze": ["--out", tmp_path / "a"]}[command]
    rc, out, err = run_cli(capsys, command, ckpts / "mla", *extra, "--device", "cuda")
    assert_clean_error(rc, err, command, "--device cuda: no CUDA device", "use --device cpu")


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_serve_kv_budget_must_be_finite_and_positive(value, ckpts, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("def f(x):\n")
    rc, out, err = run_cli(capsys, "serve", ckpts / "mla", "--prompts", tmp_path / "p.txt", "--device", "cpu",
                           "--kv-budget-gib", value)
    assert_clean_error(rc, err, "serve", "--kv-budget-gib must be positive and finite", "give a number > 0")


def test_serve_bench_budgets_must_be_finite_and_positive(capsys):
    rc, out, err = run_cli(capsys, "serve-bench", "--preset", "tiny", "--device", "cpu", "--content-group", "32",
                           "--rope-group", "16", "--budgets-gib", "0.1", "nan")
    assert_clean_error(rc, err, "serve-bench", "--budgets-gib must be positive and finite, got nan")


@pytest.mark.parametrize("flags, needles", [
    (["--page-size", "0"], ["--page-size must be positive"]),
    (["--d-c", "100"], ["--d-c 100", "no group size of 32, 64 or 128 divides it", "multiple of 32"]),
    (["--d-r", "48"], ["--d-r 48", "RoPE group"]),
    (["--rope-group", "48"], ["--rope-group 48 is not a power of two"]),
])
def test_bytes_names_the_flag(flags, needles, capsys):
    rc, out, err = run_cli(capsys, "bytes", *flags)
    assert_clean_error(rc, err, "bytes", *needles)


def _not_writable(tmp_path: Path) -> Path:
    """A path no one can write to, even root: a file name under a regular file."""
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "out"


@pytest.mark.parametrize("command", ["serve", "analyze", "serve-bench", "bench-kernel", "train-reference"])
def test_unwritable_output_refused_before_the_work(command, ckpts, tmp_path, capsys, monkeypatch):

    monkeypatch.setattr("quantmla.model.load.load_model", lambda *a, **k: pytest.fail("the weights were read first"))
    bad = _not_writable(tmp_path)
    (tmp_path / "p.txt").write_text("def f(x):\n")
    argv = {"serve": [ckpts / "mla", "--prompts", tmp_path / "p.txt", "--device", "cpu", "--out", bad],
            "analyze": [ckpts / "mla", "--content-group", "32", "--rope-group", "16", "--out", bad],
            "serve-bench": ["--preset", "tiny", "--device", "cpu", "--content-group", "32", "--rope-group", "16",
                            "--out", bad],
            "bench-kernel": ["--out", bad],
            "train-reference": ["--work", tmp_path / "w", "--out", bad, "--size", "tiny", "--device", "cpu"]}[command]
    if command == "bench-kernel":
        import quantmla_lab.bench.kernels.decode_speed as kb

        monkeypatch.setattr(kb, "run_bench", lambda args: pytest.fail("the benchmark ran first"))
    if command == "train-reference":
        import quantmla_lab.training.command as tc

        monkeypatch.setattr(tc, "_prepare", lambda args: pytest.fail("training data was prepared first"))
    rc, out, err = run_cli(capsys, command, *argv)
    assert_clean_error(rc, err, command, f"--out {re.escape(str(bad))}: cannot write")


# -- --help and threads ------------------------------------------------------------------------------------


def test_every_flag_of_every_subcommand_has_help_and_defaults_show():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, p in sub.choices.items() for a in p._actions
               if not (a.help and a.help != argparse.SUPPRESS)]
    assert not missing, missing
    assert {"serve-bench", "train-reference"} <= set(sub.choices)
    serve = " ".join(sub.choices["serve"].format_help().split())
    assert "KV cache budget in GiB over all layers (default: 1.0)" in serve
    assert "(default: None)" not in serve
    train = " ".join(sub.choices["train-reference"].format_help().split())
    assert "peak learning rate (AdamW) (default: 0.003)" in train


def test_threads_default_and_flag(monkeypatch, capsys):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert main(["bytes", "--json"]) == 0
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        assert torch.get_num_threads() == min(cores, 8)
        assert main(["bytes", "--json", "--threads", "1"]) == 0 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert main(["bytes", "--json"]) == 0 and torch.get_num_threads() == 1
        rc, out, err = run_cli(capsys, "bytes", "--threads", "0")
        assert_clean_error(rc, err, "bytes", "--threads must be at least 1")
    finally:
        torch.set_num_threads(before)


def test_prompt_files_split_at_newlines_only(tmp_path):
    """A .txt prompt holding a form feed or U+2028 stays one prompt (str.splitlines cut it in two and shifted every
    later id); \\r\\n ends a line as \\n does; a .jsonl line may hold U+2028 inside a string."""
    from quantmla.serving.serve_command import read_prompts

    p = tmp_path / "p.txt"
    p.write_bytes("first prompt\x0cstill first\r\nsecond \u2028 prompt\n\nthird\n".encode())
    want = ["first prompt\x0cstill first", "second \u2028 prompt", "third"]
    assert [r["prompt"] for r in read_prompts(str(p))] == want
    j = tmp_path / "p.jsonl"
    j.write_text(json.dumps({"prompt": "a \u2028 b"}, ensure_ascii=False) + "\n")
    assert read_prompts(str(j)) == [{"prompt": "a \u2028 b", "id": 0}]


def test_generate_refuses_params_beside_requests(v3):
    """engine.generate(requests, params): params are for token-id lists; beside Request objects (which carry their
    own) they were ignored, so a caller asking for 40 tokens got the Request default's 16."""
    from quantmla.serving.engine import Engine, EngineConfig
    from quantmla.serving.scheduler import Request, SamplingParams

    with Engine(v3, EngineConfig(num_pages=8, page_size=16, backend="torch", cuda_graphs=False)) as eng:
        with pytest.raises(QuantMLAError, match="params are for token-id lists"):
            eng.generate([Request("a", [5, 6, 7])], SamplingParams(max_new_tokens=40))
        out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(out[0].output_ids) == 3
