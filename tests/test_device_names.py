"""lab/scripts/device_names.sh: a GPU run's result files carry the name of the device that measured them."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "lab" / "scripts" / "device_names.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path: Path, gpu_name: str | None) -> tuple[list[str], str]:
    """Write a run's files under OUT as the scripts' steps do, rename them, and return (files under OUT, stdout)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    if gpu_name is not None:
        (fake / "nvidia-smi").write_text(f"#!/bin/sh\necho '{gpu_name}'\n")
        (fake / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    (out / "kernels").mkdir(parents=True)
    earlier = out / "kernels" / "earlier_h200.json"
    earlier.write_text("an earlier run's file")
    os.utime(earlier, (1_000_000_000, 1_000_000_000))  # long before the run starts
    body = (f"source {SCRIPT}; NAME_SINCE=$(mktemp); touch -d '2001-09-10' $NAME_SINCE; "
            "echo a > $OUT/kernels/append_h200_h200.json; echo b > $OUT/kernels/taken_h200.json; "
            "echo c > $OUT/kernels/taken_h100.json; mkdir -p $OUT/decode_splits $OUT/dir_h200; "
            "echo d > $OUT/decode_splits/h200.json; echo e > $OUT/dir_h200/inner.log; name_by_device")
    path = f"{fake}:/usr/bin:/bin" if gpu_name is None else f"{fake}:{os.environ['PATH']}"
    if gpu_name is None and shutil.which("nvidia-smi", path=path):
        pytest.skip("an nvidia-smi is on /usr/bin or /bin")
    env = dict(os.environ, PATH=path, OUT=str(out))
    r = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, check=True)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    return files, r.stdout


def test_an_h100_run_names_its_files_h100_and_overwrites_nothing(tmp_path):
    files, log = _run(tmp_path, "NVIDIA H100 80GB HBM3")
    assert files == ["decode_splits/h100.json", "dir_h200/inner.log", "kernels/append_h100_h100.json",
                     "kernels/earlier_h200.json", "kernels/taken_h100.json", "kernels/taken_h200.json"]
    assert (tmp_path / "out" / "kernels" / "taken_h100.json").read_text() == "c\n"  # the file already there is kept
    assert "taken_h100.json exists" in log


def test_other_gpus_get_their_own_tag(tmp_path):
    files, _ = _run(tmp_path, "NVIDIA A100-SXM4-80GB")
    assert "decode_splits/a100.json" in files and "kernels/append_a100_a100.json" in files


def test_an_h200_run_keeps_its_names(tmp_path):
    files, _ = _run(tmp_path, "NVIDIA H200")
    assert "kernels/append_h200_h200.json" in files and "decode_splits/h200.json" in files


def test_without_nvidia_smi_nothing_is_renamed_and_it_says_so(tmp_path):
    files, log = _run(tmp_path, None)
    assert "kernels/append_h200_h200.json" in files and "names no GPU" in log


def test_start_run_refuses_a_run_without_its_commit_and_sets_out(tmp_path):
    """start_run stops the script (exit 2, naming the fix) where QUANTMLA_COMMIT is unset, before any step; with it,
    OUT defaults to /tmp/out and NAME_SINCE names a file that exists."""
    env = {k: v for k, v in os.environ.items() if k not in ("QUANTMLA_COMMIT", "OUT")}
    body = f"source {SCRIPT}; start_run; echo after-start"
    r = subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "after-start" not in r.stdout
    assert "QUANTMLA_COMMIT=$(git rev-parse --short HEAD)" in r.stderr
    body = f"source {SCRIPT}; start_run; echo \"$OUT\"; test -f \"$NAME_SINCE\" && echo since-ok"
    r = subprocess.run(["bash", "-c", body], env=dict(env, QUANTMLA_COMMIT="abc1234"), capture_output=True, text=True,
                       check=True)
    assert r.stdout.split() == ["/tmp/out", "since-ok"]
