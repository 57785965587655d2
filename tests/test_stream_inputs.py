"""The streamed calibration's inputs and outputs at their edges: tensors no fusion changes keep the source's bytes
whatever the compute dtype, options that disagree with the run are refused, the fit runs on the device asked for,
and token ids outside the vocabulary are refused before anything is written."""

from __future__ import annotations

import argparse
import glob
import os

import pytest
import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.calibration.options import CalibrationOptions
from quantmla.calibration.stream import calibrate_streamed
from quantmla.errors import QuantMLAError
from quantmla.model.tiny import tiny_config
from quantmla.transforms.fuse import FUSED_INTO
from quantmla_lab.random_checkpoint import write_random_checkpoint

QUANT = QuantCacheConfig.of_bits(2, 4, 32, 16)


def _ids(vocab=128):
    return torch.randint(3, vocab, (6, 24), generator=torch.Generator().manual_seed(0))


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def fp32_source(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp32")
    write_random_checkpoint(tiny_config("deepseek_v3", num_hidden_layers=2), str(root / "src"), seed=1,
                            dtype=torch.float32)
    return root / "src"


@pytest.mark.parametrize("method", ["rtn", "hadamard"])
def test_tensors_no_fusion_changes_keep_the_source_bytes_in_a_narrower_compute_dtype(fp32_source, tmp_path, method):
    """bf16 compute on an fp32 checkpoint: rtn fuses nothing, so every tensor is the source's; hadamard changes only
    the weights a transform fuses into (o_proj, q_a_proj and the norms are the source's, not rounded to bf16)."""
    calibrate_streamed(fp32_source, tmp_path / "o", _ids(), QUANT, method=method, attn_implementation="eager",
                       dtype=torch.bfloat16)
    a, b = _tensors(fp32_source), _tensors(tmp_path / "o")
    changed = sorted(k for k in a if not torch.equal(a[k], b[k]))
    if method == "rtn":
        assert changed == []
    else:
        assert changed and all(k.split(".self_attn.", 1)[1].split(".", 1)[0] in FUSED_INTO for k in changed), changed
        assert any(".o_proj." in k for k in a) and not any(".o_proj." in k for k in changed)


def test_options_that_disagree_with_the_run_are_refused(fp32_source, tmp_path):
    with pytest.raises(QuantMLAError, match="method='hadamard'"):
        calibrate_streamed(fp32_source, tmp_path / "o", _ids(), QUANT, fit_kwargs=CalibrationOptions(method="hadamard"))
    with pytest.raises(QuantMLAError, match="seed=7"):
        calibrate_streamed(fp32_source, tmp_path / "o", _ids(), QUANT, method="rtn",
                           fit_kwargs=CalibrationOptions(method="rtn", seed=7))
    assert not (tmp_path / "o").exists()


def test_ids_outside_the_vocabulary_are_refused_before_anything_is_written(fp32_source, tmp_path):
    ids = _ids()
    ids[2, 5] = 133  # the tiny config's vocabulary has 128 tokens
    with pytest.raises(QuantMLAError, match=r"outside the model's vocabulary \[0, 128\)"):
        calibrate_streamed(fp32_source, tmp_path / "o", ids, QUANT, method="rtn")
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")


@pytest.mark.parametrize("extra,device", [([], "cuda:1"), (["--nproc", "2"], "cuda")])
def test_the_fit_runs_on_the_device_asked_for(extra, device):
    """One process: the fit goes where the layers run (cuda:1); several ranks: "cuda", each rank's own GPU."""
    from quantmla.calibration.stream_command import _options, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["MODEL", "--out", "OUT", "--device", "cuda:1", *extra])
    assert _options(args)["fit_kwargs"].device == device
