"""lab/scripts/device_names.sh: a GPU run's result files carry the name of the device that measured them."""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "lab" / "scripts" / "device_names.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path: Path, gpu_name: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\necho '{gpu_name}'\n")
    (fake / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    (out / "kernels").mkdir(parents=True)
    (out / "kernels" / "earlier_h200.json").write_text("an earlier run's file")
    time.sleep(0.05)
    body = (f"source {SCRIPT}; NAME_SINCE=$(mktemp); sleep 0.05; "
            "echo a > $OUT/kernels/append_h200.json; echo b > $OUT/kernels/taken_h200.json; "
            "echo c > $OUT/kernels/taken_h100.json; mkdir -p $OUT/profile; echo d > $OUT/profile/grid_h200.log; "
            "name_by_device")
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", OUT=str(out))
    return subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, check=True)


def test_an_h100_run_names_its_files_h100_and_overwrites_nothing(tmp_path):
    r = _run(tmp_path, "NVIDIA H100 80GB HBM3")
    out = tmp_path / "out"
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert names == ["kernels/append_h100.json", "kernels/earlier_h200.json", "kernels/taken_h100.json",
                     "kernels/taken_h200.json", "profile/grid_h100.log"]
    assert (out / "kernels" / "taken_h100.json").read_text() == "c\n"  # the file already there is kept
    assert "taken_h100.json exists" in r.stderr


def test_an_h200_run_keeps_its_names(tmp_path):
    _run(tmp_path, "NVIDIA H200")
    out = tmp_path / "out"
    assert (out / "kernels" / "append_h200.json").exists() and (out / "profile" / "grid_h200.log").exists()
