"""Layer-streamed, multi-process and resumable calibration (calibration/stream/, distributed.py)."""

from __future__ import annotations

import contextlib
import filecmp
import glob
import json
import os

import pytest
import torch
from helpers.streaming import KillAt, standin_fit

from quantmla.cache.config import QuantCacheConfig
from quantmla.calibration import calibrate
from quantmla.calibration.distributed import assign_layers, calibrate_streamed_distributed, launch_local, spawn_call
from quantmla.calibration.stream import STATE_DIR, RunState, ShardedCheckpoint, Streamer, calibrate_streamed
from quantmla.errors import QuantMLAError
from quantmla.model.tiny import FAMILIES, tiny_config
from quantmla_lab.random_checkpoint import write_random_checkpoint

QUANT = QuantCacheConfig.of_bits(2, 4, 32, 16)
# the real function-aligned fit, kept short: a few Adam steps, closed-form + grid RoPE search
FAST = {"steps": 3, "rope_searches": ("closed", "grid")}
FASTER = {"steps": 2, "rope_searches": ("closed",)}


def _ids(n=6, length=24, seed=0, vocab=128):
    return torch.randint(3, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _same_tensors(a: dict, b: dict) -> list[str]:
    assert sorted(a) == sorted(b)
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def ds3(tmp_path_factory):
    """A sharded random deepseek_v3 checkpoint (YaRN, interleaved RoPE weights, MoE), 4 layers."""
    root = tmp_path_factory.mktemp("ds3")
    write_random_checkpoint(tiny_config("deepseek_v3", num_hidden_layers=4), str(root / "src"), seed=1)
    return root / "src"


# ------------------------------------------------------------------------------------------------
# streamed == in memory
# ------------------------------------------------------------------------------------------------
def test_streamed_equals_in_memory_calibrate(ds3, tmp_path):
    """... also with a timer (ProjectFitter.timer: what benchmarks time the steps with), which sees every
    batch's capture and every layer's content and RoPE fit, and changes nothing."""
    from quantmla.calibration.stream.fitters import ProjectFitter

    timed = []

    class TimedFitter(ProjectFitter):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.timer = lambda step: contextlib.nullcontext(timed.append(step))

    ids = _ids()
    model = _load(ds3)
    rep_mem = calibrate(model, ids, QUANT, method="quantmla", seed=5, progress=False, verbose=False, **FAST)
    rep = calibrate_streamed(ds3, tmp_path / "out", ids, QUANT, method="quantmla", seed=5, fit_kwargs=FAST,
                             attn_implementation="eager", fit_fn=TimedFitter)
    batches = -(-len(ids) // 4)  # capture batches per layer (batch_size 4)
    assert timed == (["capture"] * batches + ["content", "rope"]) * 4
    assert {lr.content["chosen"] for lr in rep_mem.layers} - {"rtn"}, "the fit should pick a transform somewhere"
    streamed = _load(tmp_path / "out")
    assert _same_tensors(model.state_dict(), streamed.state_dict()) == []
    assert streamed.config.quantization_config.to_dict() == model.config.quantization_config
    report = json.loads((tmp_path / "out" / "calibration_report.json").read_text())
    assert [lr["slot"] for lr in report["layers"]] == [0, 1, 2, 3]
    assert report["layers"][1]["content"] == json.loads(json.dumps(rep_mem.layers[1].content))
    assert len(rep.layers) == 4 and all(s.fitted for s in rep.layers)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {os.path.basename(f) for f in glob.glob(str(tmp_path / "out" / "model-*.safetensors"))}


@pytest.mark.parametrize("family", ["deepseek_v2", "longcat_flash", "kimi_linear", "minicpm3"])
def test_streamed_equals_in_memory_across_families(family, tmp_path):
    """Layouts that differ: no q LoRA + complex RoPE (v2), two MLA blocks per layer (longcat),
    mixed linear/MLA layers (kimi), scaled embeddings (minicpm3)."""
    write_random_checkpoint(tiny_config(family), str(tmp_path / "src"), seed=2)
    ids = _ids(n=4, length=16)
    model = _load(tmp_path / "src")
    calibrate(model, ids, QUANT, method="quantmla", seed=1, progress=False, verbose=False, **FASTER)
    calibrate_streamed(tmp_path / "src", tmp_path / "out", ids, QUANT, method="quantmla", seed=1, fit_kwargs=FASTER,
                       attn_implementation="eager")
    assert _same_tensors(model.state_dict(), _load(tmp_path / "out").state_dict()) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_stream_forward_reproduces_the_model_layer_by_layer(family, tmp_path):
    write_random_checkpoint(tiny_config(family), str(tmp_path / "src"), seed=3)
    ids = _ids(n=3, length=16)
    model = _load(tmp_path / "src")
    outs = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        model(ids, use_cache=False)
    st = Streamer(tmp_path / "src", tmp_path / "out", ids, QUANT, method="identity", seed=0, batch_size=3, dtype=None,
                  device="cpu", activations="memory", checkpoint_every=0, fit_fn=standin_fit, fit_kwargs=None,
                  attn_implementation="eager", checksum=False, overwrite=False)
    _, h = st.start(0)
    for i in range(st.L):
        layer, n = st.load_layer(i)
        nxt = st.new_buffer(i + 1)
        st.forward_layer(i, layer, h, nxt, capture=False)
        st.skel.release(layer, n)
        h = nxt
        assert torch.equal(h.t, outs[i]), f"layer {i}"
    assert st.meter.live == 0


# ------------------------------------------------------------------------------------------------
# a model larger than the memory the run may use
# ------------------------------------------------------------------------------------------------
def _big_config(layers=20):
    # ~13 MB of fp32 weights per layer (16 experts), ~260 MB in all
    return tiny_config("deepseek_v3", num_hidden_layers=layers, hidden_size=256, intermediate_size=512,
                       moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=2, num_attention_heads=4,
                       kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                       vocab_size=512)


def test_layer_streamed_calibration_under_a_memory_cap(tmp_path):
    info = write_random_checkpoint(_big_config(), str(tmp_path / "src"), seed=0)
    ckpt = ShardedCheckpoint(tmp_path / "src")
    assert len({ckpt.weight_map[n] for n in ckpt.weight_map}) == 21  # one shard per layer + the rest
    ids = _ids(n=4, length=32, vocab=512)
    # a fresh process, so its peak RSS is this run's alone
    code, rep = spawn_call(calibrate_streamed, str(tmp_path / "src"), str(tmp_path / "out"), ids, QUANT,
                           method="random", seed=0, activations="disk", fit_fn=standin_fit)  # seeded, fast
    assert code == 0, code
    model_bytes, layer_bytes = info["bytes"], info["max_layer_bytes"]
    assert model_bytes > 18 * layer_bytes
    embed = 512 * 256 * 4
    # the loader never holds more than one decoder layer (or the embedding table) at a time
    assert rep.peak_live_weight_bytes <= max(layer_bytes, embed) * 1.01
    assert all(s.live_weight_peak_bytes <= layer_bytes * 1.01 for s in rep.layers)
    # and the process grows by a few layers' worth (the layer, its reads, activations, allocator
    # slack), far below the model's size
    growth = rep.peak_rss_bytes - rep.start_rss_bytes
    assert 0 < growth < min(0.4 * model_bytes, 4 * layer_bytes + (32 << 20)), (growth / 2**20, model_bytes / 2**20)
    out = ShardedCheckpoint(tmp_path / "out")
    assert sorted(out.weight_map) == sorted(ckpt.weight_map)
    # content + RoPE transforms fused into every layer's attention; everything else copied bit for bit
    src, dst = _tensors(tmp_path / "src"), _tensors(tmp_path / "out")
    changed = _same_tensors(src, dst)
    assert len(changed) == 20 * 4
    assert sorted({k.split(".self_attn.")[1] for k in changed}) == [
        "kv_a_layernorm.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "q_b_proj.weight"]


def test_disk_activations_give_the_same_result(ds3, tmp_path):
    ids = _ids()
    kw = dict(method="quantmla", seed=2, fit_kwargs=FASTER, attn_implementation="eager", batch_size=2)
    calibrate_streamed(ds3, tmp_path / "mem", ids, QUANT, activations="memory", **kw)
    calibrate_streamed(ds3, tmp_path / "disk", ids, QUANT, activations="disk", **kw)
    assert _same_tensors(_tensors(tmp_path / "mem"), _tensors(tmp_path / "disk")) == []
    assert not glob.glob(str(tmp_path / "disk" / STATE_DIR / "activations" / "*.bin"))  # cleaned up


# ------------------------------------------------------------------------------------------------
# several processes
# ------------------------------------------------------------------------------------------------
def test_assign_layers_round_robin():
    assert assign_layers([0, 1, 2, 3, 4], 2) == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0}
    assert assign_layers([0, 1, 2, 3], 3, streamer_fits=False) == {0: 1, 1: 2, 2: 1, 3: 2}
    assert assign_layers([3, 5], 1, streamer_fits=False) == {3: 0, 5: 0}


def test_two_process_gloo_run_equals_one_process_run(ds3, tmp_path):
    ids = _ids()
    kw = dict(method="quantmla", seed=7, fit_kwargs=FAST, attn_implementation="eager")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-identity needs the same thread count in every process
    try:
        calibrate_streamed(ds3, tmp_path / "one", ids, QUANT, **kw)
    finally:
        torch.set_num_threads(threads)
    rep = launch_local(calibrate_streamed_distributed, 2, str(ds3), str(tmp_path / "two"), ids, QUANT, threads=1, **kw)
    assert {(s.layer, s.rank) for s in rep.layers if s.fitted} == {(0, 0), (1, 1), (2, 0), (3, 1)}
    assert len(rep.per_rank) == 2
    for f in sorted(glob.glob(str(tmp_path / "one" / "model-*.safetensors"))):
        assert filecmp.cmp(f, str(tmp_path / "two" / os.path.basename(f)), shallow=False), f
    for f in ("config.json", "model.safetensors.index.json"):
        assert json.loads((tmp_path / "one" / f).read_text()) == json.loads((tmp_path / "two" / f).read_text())


# ------------------------------------------------------------------------------------------------
# killed and resumed
# ------------------------------------------------------------------------------------------------
def test_killed_and_resumed_run_equals_an_uninterrupted_one(ds3, tmp_path):
    ids = _ids()
    kw = dict(method="quantmla", seed=4, fit_kwargs=FASTER, attn_implementation="eager")
    calibrate_streamed(ds3, tmp_path / "ref", ids, QUANT, **kw)
    ref = _tensors(tmp_path / "ref")

    out = tmp_path / "out"
    # killed (SIGKILL) in the middle of writing layer 2's shard
    code, _ = spawn_call(calibrate_streamed, str(ds3), str(out), ids, QUANT, _fault=KillAt(2, "tensor_written"), **kw)
    assert code == -9
    state = RunState(str(out))
    assert [state.is_done(f"layer-{i:05d}") for i in range(4)] == [True, True, False, False]
    assert glob.glob(str(out / "model-layer-00002.safetensors.tmp.*"))  # the half-written file
    assert not (out / "model-layer-00002.safetensors").exists()
    assert not (out / "model.safetensors.index.json").exists()

    rep = calibrate_streamed(ds3, out, ids, QUANT, **kw)
    assert rep.skipped == [0, 1] and rep.resumed_from == 2  # restarted from the saved layer-2 inputs
    assert [s.layer for s in rep.layers] == [2, 3]
    assert _same_tensors(ref, _tensors(out)) == []
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "ref" / "config.json").read_text())
    assert not glob.glob(str(out / "*.tmp.*"))  # the killed run's partial file is cleaned up at the end


def test_a_shard_is_trusted_only_with_its_marker(ds3, tmp_path):
    ids = _ids()
    kw = dict(method="quantmla", seed=4, fit_kwargs=FASTER, attn_implementation="eager", checkpoint_every=0)
    calibrate_streamed(ds3, tmp_path / "ref", ids, QUANT, **kw)
    ref = _tensors(tmp_path / "ref")
    out = tmp_path / "out"
    # killed after layer 1's shard was renamed into place but before its marker was written
    code, _ = spawn_call(calibrate_streamed, str(ds3), str(out), ids, QUANT, _fault=KillAt(1, "shard_renamed"), **kw)
    assert code == -9
    assert (out / "model-layer-00001.safetensors").exists()
    state = RunState(str(out))
    assert state.is_done("layer-00000") and not state.is_done("layer-00001")
    # a marked shard damaged afterwards is not trusted either
    with open(out / "model-layer-00000.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(out / "model-layer-00000.safetensors") - 8)
    assert not state.is_done("layer-00000")
    rep = calibrate_streamed(ds3, out, ids, QUANT, **kw)
    assert rep.skipped == [] and rep.resumed_from is None  # no activation checkpoints: from the embeddings
    assert _same_tensors(ref, _tensors(out)) == []


def test_resume_refuses_different_settings_and_foreign_directories(ds3, tmp_path):
    ids = _ids()
    code, _ = spawn_call(calibrate_streamed, str(ds3), str(tmp_path / "out"), ids, QUANT, method="hadamard",
                         _fault=KillAt(1))
    assert code == -9
    with pytest.raises(QuantMLAError, match="different"):
        calibrate_streamed(ds3, tmp_path / "out", ids, QUANT, method="hadamard", seed=1)
    with pytest.raises(QuantMLAError, match="different"):
        calibrate_streamed(ds3, tmp_path / "out", _ids(seed=9), QUANT, method="hadamard")
    rep = calibrate_streamed(ds3, tmp_path / "out", ids, QUANT, method="hadamard", seed=1, overwrite=True)
    assert rep.skipped == []
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"x")
    with pytest.raises(QuantMLAError, match="not written by a streamed calibration"):
        calibrate_streamed(ds3, foreign, ids, QUANT, method="hadamard")
    (foreign / "model.safetensors").unlink()
    (foreign / "pytorch_model.bin").write_bytes(b"x")  # a .bin checkpoint is as foreign
    with pytest.raises(QuantMLAError, match=r"not written by a streamed calibration \(pytorch_model.bin"):
        calibrate_streamed(ds3, foreign, ids, QUANT, method="hadamard")


def test_a_killed_replacement_resumes_with_or_without_overwrite(ds3, tmp_path):
    """A streamed run that replaces a finished streamed checkpoint (overwrite) and is killed before its swap resumes
    from its staging directory when started again, with or without overwrite, and ends as an uninterrupted run."""
    from quantmla.calibration.outdir import staging_dir

    ids, out, kw = _ids(), tmp_path / "out", dict(method="hadamard")
    calibrate_streamed(ds3, tmp_path / "ref", ids, QUANT, seed=1, **kw)
    for again in ({}, {"overwrite": True}):
        calibrate_streamed(ds3, out, ids, QUANT, seed=0, overwrite=True, **kw)  # a finished run of other settings
        code, _ = spawn_call(calibrate_streamed, str(ds3), str(out), ids, QUANT, seed=1, overwrite=True,
                             _fault=KillAt(1), **kw)
        assert code == -9 and os.path.isdir(staging_dir(out))
        rep = calibrate_streamed(ds3, out, ids, QUANT, seed=1, **again, **kw)
        assert rep.skipped == [0], again
        assert _same_tensors(_tensors(tmp_path / "ref"), _tensors(out)) == [] and not os.path.exists(staging_dir(out))


def test_streamed_checkpoint_keeps_the_added_tokens(cli_model, tmp_path):
    """Tokens added to the source's tokenizer (added_tokens.json) are in the streamed checkpoint's tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    model, _ = cli_model
    src = tmp_path / "src"
    shutil.copytree(model, src)
    (src / "added_tokens.json").write_text(json.dumps({"<|extra|>": 300}))
    text = "x = <|extra|> + 1"
    want = AutoTokenizer.from_pretrained(str(src))(text)["input_ids"]
    assert 300 in want
    calibrate_streamed(src, tmp_path / "out", _ids(n=2, length=16), QUANT, method="hadamard")
    assert (tmp_path / "out" / "added_tokens.json").exists()
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out"))(text)["input_ids"] == want


def test_resume_refuses_a_source_rewritten_under_the_same_names(tmp_path):
    """A run stopped, then resumed after its source checkpoint was rewritten with other weights under the same tensor
    names, is refused (it would mix layers fitted on two models)."""
    src, out, ids = tmp_path / "src", tmp_path / "out", _ids()
    write_random_checkpoint(tiny_config("deepseek_v3", num_hidden_layers=2), str(src), seed=1)
    code, _ = spawn_call(calibrate_streamed, str(src), str(out), ids, QUANT, method="hadamard", _fault=KillAt(1))
    assert code == -9
    write_random_checkpoint(tiny_config("deepseek_v3", num_hidden_layers=2), str(src), seed=2)
    with pytest.raises(QuantMLAError, match="different source_weights"):
        calibrate_streamed(src, out, ids, QUANT, method="hadamard")
    # a run begun before the digest was recorded resumes (it cannot tell, as before)
    run = out / ".quantmla_stream" / "run.json"
    manifest = json.loads(run.read_text())
    del manifest["source_weights"]
    run.write_text(json.dumps(manifest))
    assert calibrate_streamed(src, out, ids, QUANT, method="hadamard").skipped == [0]


def test_user_errors(ds3, tmp_path):
    with pytest.raises(FileNotFoundError):
        calibrate_streamed(tmp_path / "nothing", tmp_path / "o", _ids(), QUANT)
    (tmp_path / "bin").mkdir()
    tiny_config("deepseek_v3").save_pretrained(tmp_path / "bin")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        calibrate_streamed(tmp_path / "bin", tmp_path / "o", _ids(), QUANT)
    with pytest.raises(QuantMLAError, match=r"\[sequences, tokens\]"):
        calibrate_streamed(ds3, tmp_path / "o", torch.arange(10), QUANT)
    with pytest.raises(QuantMLAError, match="activations"):
        calibrate_streamed(ds3, tmp_path / "o", _ids(), QUANT, activations="gpu")
    with pytest.raises(QuantMLAError, match="unknown calibration method"):
        calibrate_streamed(ds3, tmp_path / "o", _ids(), QUANT, method="nope")


# ------------------------------------------------------------------------------------------------
# block-FP8 sources (official DeepSeek-V3 / Kimi-K2 releases)
# ------------------------------------------------------------------------------------------------
def test_block_fp8_source_is_dequantized_on_read(ds3, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "fp8"
    src.mkdir()
    cfg = json.loads((ds3 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [32, 32]}
    (src / "config.json").write_text(json.dumps(cfg))
    weight_map, deq = {}, {}
    for f in sorted(glob.glob(str(ds3 / "model-*.safetensors"))):
        sd = load_file(f)
        out = {}
        for k, w in sd.items():
            if ".layers." in k and w.dim() == 2 and "norm" not in k and "gate.weight" not in k:
                m, n = w.shape
                pad = torch.zeros(-(-m // 32) * 32, -(-n // 32) * 32)
                pad[:m, :n] = w.abs()
                blocks = pad.reshape(pad.shape[0] // 32, 32, pad.shape[1] // 32, 32).amax(dim=(1, 3)).clamp_min(1e-8) / 448
                s = blocks.repeat_interleave(32, 0).repeat_interleave(32, 1)[:m, :n]
                w8 = (w / s).to(torch.float8_e4m3fn)
                out[k], out[k + "_scale_inv"] = w8, blocks
                deq[k] = w8.float() * s
            else:
                out[k] = w
        save_file(out, str(src / os.path.basename(f)))
        weight_map.update({k: os.path.basename(f) for k in out})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    calibrate_streamed(src, tmp_path / "out", _ids(), QUANT, method="rtn", attn_implementation="eager")
    got = _tensors(tmp_path / "out")
    assert not any(k.endswith("_scale_inv") for k in got)
    for k, w in deq.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], w.to(torch.bfloat16)), k
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"] == "quantmla"


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_model(tmp_path_factory):
    """A tiny deepseek_v3 checkpoint with its own tokenizer, calibration text, and calibrate's
    options shared by the command-line tests."""
    from quantmla.model.tiny import tiny_model
    from quantmla_lab.training.tokenizer import save_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("cli")
    text = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))
    tok = train_tokenizer([text], vocab_size=300)
    tiny_model("deepseek_v3", vocab_size=300).save_pretrained(root / "model")
    save_tokenizer(tok, root / "model")
    (root / "calib.txt").write_text(text)
    common = ["--content-bits", "2", "--rope-bits", "4", "--content-group", "32", "--rope-group", "16",
              "--calib", str(root / "calib.txt"), "--steps", "3", "--calib-seqs", "4", "--seq-len", "32"]
    return root / "model", common


def test_stream_command_matches_quantmla_calibrate(cli_model, tmp_path, capsys):
    from quantmla.calibration.checkpoint import load_quantized
    from quantmla.calibration.stream_command import main as stream_main
    from quantmla.cli import main

    model, common = cli_model
    assert main(["calibrate", str(model), "--out", str(tmp_path / "mem"), *common, "--json"]) == 0
    capsys.readouterr()
    assert stream_main([str(model), "--out", str(tmp_path / "str"), *common, "--json",
                        "--stream-report", str(tmp_path / "stream.json")]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["layers"]) == 2 and json.loads((tmp_path / "stream.json").read_text())["tokens"] == 128
    m_mem, _, _ = load_quantized(tmp_path / "mem")
    m_str, tok2, qc = load_quantized(tmp_path / "str")
    assert tok2 is not None and (qc.content.bits, qc.rope.bits, qc.method) == (2, 4, "quantmla")
    assert _same_tensors(m_mem.state_dict(), m_str.state_dict()) == []
    assert stream_main([str(model), "--out", str(tmp_path / "x"), *common, "--dtype", "bfloat16"]) == 2


def test_quantmla_calibrate_stream_equals_calibrate_streamed(cli_model, tmp_path, capsys):
    """`quantmla calibrate --stream` (the real entry point) writes what calibrate_streamed writes."""
    from transformers import AutoTokenizer

    from quantmla.calibration.checkpoint import load_quantized
    from quantmla.calibration.data import load_calibration_ids
    from quantmla.calibration.stream_command import main as stream_main
    from quantmla.cli import main

    model, common = cli_model
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    assert "streaming:" in help_text and all(f in help_text for f in ("--stream ", "--nproc", "--activations"))
    with pytest.raises(SystemExit) as e:  # the standalone module still builds its parser (options added once)
        stream_main(["--help"])
    assert e.value.code == 0 and "streaming:" in capsys.readouterr().out

    out = tmp_path / "cli"
    assert main(["calibrate", str(model), "--out", str(out), *common, "--stream", "--no-progress"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    ids = load_calibration_ids(AutoTokenizer.from_pretrained(str(model)), common[common.index("--calib") + 1], 32, 4)
    calibrate_streamed(model, tmp_path / "api", ids, QuantCacheConfig.of_bits(2, 4, 32, 16), method="quantmla", seed=0,
                       fit_kwargs={"paths": ("content", "rope"), "steps": 3, "rope_weighting": "attention"})
    shards = sorted(os.path.basename(f) for f in glob.glob(str(tmp_path / "api" / "*.safetensors")))
    assert shards and shards == sorted(os.path.basename(f) for f in glob.glob(str(out / "*.safetensors")))
    for f in shards:
        assert filecmp.cmp(out / f, tmp_path / "api" / f, shallow=False), f
    for f in ("config.json", "model.safetensors.index.json"):
        assert json.loads((out / f).read_text()) == json.loads((tmp_path / "api" / f).read_text()), f
    reports = [json.loads((d / "calibration_report.json").read_text()) for d in (out, tmp_path / "api")]
    for r in reports:
        for layer in r["layers"]:
            layer.pop("seconds")  # wall times
    assert reports[0] == reports[1]
    m, tok, qc = load_quantized(out)
    assert tok is not None and (qc.content.bits, qc.rope.bits, qc.method) == (2, 4, "quantmla")
    assert _same_tensors(m.state_dict(), load_quantized(tmp_path / "api")[0].state_dict()) == []
    # the same checks as calibrate's, before any weights are read
    assert main(["calibrate", str(out), "--out", str(tmp_path / "x"), *common, "--stream"]) == 2
    assert "already calibrated" in capsys.readouterr().err
    bad_group = [*common[:6], "--rope-group", "48", *common[8:]]
    assert main(["calibrate", str(model), "--out", str(tmp_path / "x"), *bad_group, "--stream"]) == 2
    assert "--rope-bits 4 --rope-group 48" in capsys.readouterr().err
    # streaming options without --stream are refused rather than ignored
    assert main(["calibrate", str(model), "--out", str(tmp_path / "x"), *common, "--nproc", "2"]) == 2
    assert "--nproc: streaming options" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# the output directory holds exactly one checkpoint
# ------------------------------------------------------------------------------------------------
def _files(d) -> list[str]:
    return sorted(os.listdir(d))


def test_stream_overwrite_replaces_an_in_memory_checkpoint_whole(cli_model, tmp_path, capsys):
    """--stream --overwrite into a directory holding a non-streamed calibration leaves one checkpoint:
    the old model.safetensors does not stay beside the new shards."""
    from quantmla.cli import main

    model, common = cli_model
    out = tmp_path / "out"
    int4 = [common[0], "4", *common[2:]]  # --content-bits 4
    assert main(["calibrate", str(model), "--out", str(out), *int4, "--no-progress"]) == 0
    assert (out / "model.safetensors").exists()
    assert main(["calibrate", str(model), "--out", str(out), *common, "--stream", "--no-progress"]) == 2
    assert "not written by a streamed calibration" in capsys.readouterr().err
    assert main(["calibrate", str(model), "--out", str(out), *common, "--stream", "--overwrite", "--no-progress"]) == 0
    assert main(["calibrate", str(model), "--out", str(tmp_path / "fresh"), *common, "--stream", "--no-progress"]) == 0
    assert _files(out) == _files(tmp_path / "fresh")
    assert not (out / "model.safetensors").exists()
    assert not [f for f in os.listdir(tmp_path) if "quantmla-" in f]  # no staging or old directory left
    assert json.loads((out / "config.json").read_text())["quantization_config"]["content"]["bits"] == 2


def test_calibrate_refuses_an_existing_checkpoint_without_overwrite(cli_model, tmp_path, capsys, monkeypatch):
    """One rule for calibrate with and without --stream: a directory holding a checkpoint is replaced
    only with --overwrite (whole), and a bad --out is refused before the fit starts."""
    from quantmla.calibration import api
    from quantmla.cli import main

    model, common = cli_model
    out = tmp_path / "out"
    assert main(["calibrate", str(model), "--out", str(out), *common, "--stream", "--no-progress"]) == 0
    shards = [f for f in _files(out) if f.startswith("model-")]
    assert shards
    calls = []
    real = api.calibrate
    monkeypatch.setattr(api, "calibrate", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert main(["calibrate", str(model), "--out", str(out), *common, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "already holds a checkpoint" in err and "--overwrite" in err and calls == []
    assert main(["calibrate", str(model), "--out", str(out), *common, "--overwrite", "--no-progress"]) == 0
    assert calls == [1]
    assert not any(f.startswith("model-") or f.endswith(".index.json") for f in _files(out))  # the shards went
    assert (out / "model.safetensors").exists() and not (out / ".quantmla_stream").exists()
    # an --out that cannot be written is refused before any work (here: below a regular file)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for extra in ([], ["--stream"]):
        assert main(["calibrate", str(model), "--out", str(blocker / "sub"), *common, *extra, "--no-progress"]) == 2
        assert "not writable" in capsys.readouterr().err
    assert calls == [1]


def test_stream_shows_progress_inside_a_layer(cli_model, tmp_path, capsys):
    """--stream shows progress while a layer runs (its forward batches and its fit), not only after it."""
    from quantmla.cli import main

    model, common = cli_model
    assert main(["calibrate", str(model), "--out", str(tmp_path / "o"), *common, "--stream"]) == 0
    cap = capsys.readouterr()
    assert "layer 0: forward" in cap.err and "slot 0: fit" in cap.err and "layer   0 (rank 0)" in cap.out
    assert main(["calibrate", str(model), "--out", str(tmp_path / "q"), *common, "--stream", "--no-progress"]) == 0
    assert "layer 0: forward" not in capsys.readouterr().err
