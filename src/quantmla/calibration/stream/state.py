"""The run of a streamed calibration: its output (or staging) directory's manifest, per-unit
done-markers, activation checkpoints, and the per-layer report."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field

import torch

from quantmla.calibration.outdir import STATE_DIR, checkpoint_files, fresh_staging, holds_checkpoint, staging_dir
from quantmla.calibration.stream.activations import ActivationBuffer
from quantmla.calibration.stream.files import _sha256_file, atomic_write_json, read_safetensors_header
from quantmla.errors import QuantMLAError

FORMAT_VERSION = 1
EXTRA_UNIT = "extra"

@dataclass
class LayerStats:
    layer: int
    slots: list[int]
    weight_bytes: int
    load_s: float = 0.0
    forward_s: float = 0.0
    fit_s: float = 0.0
    write_s: float = 0.0
    rss_bytes: int = 0
    peak_rss_bytes: int = 0
    live_weight_peak_bytes: int = 0
    activation_bytes: int = 0
    device_peak_bytes: int = 0
    rank: int = 0
    fitted: bool = True
    wait_s: float = 0.0  # distributed: time a fitting rank waited for this layer's data
    captured_bytes: int = 0  # what the fit works from (the fitter's captured data)


@dataclass
class StreamReport:
    output: str
    num_layers: int
    tokens: int
    model_bytes: int
    max_layer_bytes: int
    layers: list[LayerStats] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # done before this run (resumed)
    resumed_from: int | None = None  # activation checkpoint used (input index), None: embeddings
    peak_live_weight_bytes: int = 0
    peak_rss_bytes: int = 0
    start_rss_bytes: int = 0
    seconds: float = 0.0
    per_rank: list = field(default_factory=list)  # distributed runs: memory per rank

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        gb = 1 << 30
        fitted = sum(1 for s in self.layers if s.fitted)
        return (
            f"{fitted} layers fitted, {len(self.layers)} layer steps ({len(self.skipped)} done before), {self.tokens} tokens, "
            f"{self.seconds:.1f} s; model {self.model_bytes / gb:.3f} GiB, largest layer {self.max_layer_bytes / gb:.3f} GiB, "
            f"peak live weights {self.peak_live_weight_bytes / gb:.3f} GiB, peak RSS growth "
            f"{(self.peak_rss_bytes - self.start_rss_bytes) / gb:.3f} GiB"
        )


def _calib_digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes() + str(tuple(ids.shape)).encode()).hexdigest()


def _unit_file(unit: str) -> str:
    return f"model-{unit}.safetensors"


def _layer_unit(i: int) -> str:
    return f"layer-{i:05d}"


def _manifest_diff(old: dict, manifest: dict) -> list[str]:
    """The settings in which a stored run manifest differs from `manifest` (empty: the same run)."""
    old = dict(old)
    old.setdefault("source_weights", manifest.get("source_weights"))  # a run begun before the digest
    return sorted(k for k in set(old) | set(manifest) if old.get(k) != manifest.get(k))


def holds_run(directory: str, manifest: dict) -> bool:
    """Whether `directory` holds the state of a streamed run with exactly these settings."""
    try:
        with open(os.path.join(directory, STATE_DIR, "run.json")) as f:
            return not _manifest_diff(json.load(f), manifest)
    except (OSError, ValueError):
        return False


def choose_work_dir(output: str, overwrite: bool, manifest: dict | None = None) -> str:
    """Where a streamed run into `output` writes: `output` itself (a new run, or resuming one),
    or, when `overwrite` replaces a checkpoint already there, a fresh staging directory beside it
    (calibration/outdir.py) that finalize swaps in. A staging directory that holds a run is a replacement killed
    before its swap (finalize renames a finished one away): a run with the same settings (`manifest`) resumes there,
    with or without `overwrite`, ahead of any finished run in `output`; without `overwrite` a staged run with other
    settings is resumed only where `output` holds no run (RunState.prepare then names the settings that differ)."""
    staged = staging_dir(output)
    if manifest is not None and holds_run(staged, manifest):
        return staged
    if overwrite:
        return fresh_staging(output) if holds_checkpoint(output) else output
    if os.path.isfile(os.path.join(output, STATE_DIR, "run.json")):
        return output
    if os.path.isfile(os.path.join(staged, STATE_DIR, "run.json")):
        return staged
    return output


class RunState:
    """The output directory's state: run manifest, unit markers, activation checkpoints."""

    def __init__(self, output: str):
        self.output = os.path.abspath(output)
        self.dir = os.path.join(self.output, STATE_DIR)
        self.acts = os.path.join(self.dir, "activations")

    def marker(self, unit: str) -> str:
        return os.path.join(self.dir, f"{unit}.json")

    def prepare(self, manifest: dict, overwrite: bool) -> None:
        os.makedirs(self.output, exist_ok=True)
        run = os.path.join(self.dir, "run.json")
        if overwrite and os.path.isdir(self.dir) and not holds_run(self.output, manifest):
            shutil.rmtree(self.dir)  # (the same run's state is kept: a killed replacement resumes)
        if os.path.isfile(run):
            with open(run) as f:
                diff = _manifest_diff(json.load(f), manifest)
            if diff:
                raise QuantMLAError(
                    f"{self.output} holds a streamed calibration with different {', '.join(diff)}; "
                    "resume with the same settings, use another output directory, or pass overwrite=True (--overwrite)"
                )
        else:
            stray = checkpoint_files(self.output)
            if stray and not overwrite:
                raise QuantMLAError(
                    f"{self.output} already holds a checkpoint not written by a streamed calibration "
                    f"({stray[0]}, ...); choose an empty output directory or pass overwrite=True (--overwrite)"
                )
            os.makedirs(self.dir, exist_ok=True)
            atomic_write_json(run, manifest)
        os.makedirs(self.acts, exist_ok=True)

    def is_done(self, unit: str, checksum: bool = False) -> bool:
        """A unit is done only if its marker exists and its shard matches it (size, tensor names,
        and sha256 when `checksum`). A shard without a marker, or a bad one, is not done."""
        try:
            with open(self.marker(unit)) as f:
                m = json.load(f)
            path = os.path.join(self.output, m["file"])
            if os.path.getsize(path) != m["bytes"]:
                return False
            if sorted(read_safetensors_header(path)) != sorted(m["tensors"]):
                return False
            if checksum and m.get("sha256") and _sha256_file(path) != m["sha256"]:
                return False
            return True
        except (OSError, ValueError, KeyError, QuantMLAError):
            return False

    def mark_done(self, unit: str, file: str, checksum: bool, info: dict) -> dict:
        path = os.path.join(self.output, file)
        tensors = sorted(read_safetensors_header(path))
        m = {"unit": unit, "file": file, "bytes": os.path.getsize(path), "tensors": tensors, **info}
        if checksum:
            m["sha256"] = _sha256_file(path)
        atomic_write_json(self.marker(unit), m)
        return m

    def read_marker(self, unit: str) -> dict:
        with open(self.marker(unit)) as f:
            return json.load(f)

    # activation checkpoints: h-{k}.bin holds the hidden states entering layer k
    def act_path(self, k: int) -> str:
        return os.path.join(self.acts, f"h-{k:05d}.bin")

    def act_checkpoints(self) -> list[int]:
        out = []
        for f in os.listdir(self.acts):
            m = re.fullmatch(r"h-(\d{5})\.bin", f)
            if m and ActivationBuffer.valid(os.path.join(self.acts, f)):
                out.append(int(m[1]))
        return sorted(out)

    def drop_act_checkpoints(self, keep: int) -> None:
        for k in self.act_checkpoints():
            if k != keep:
                for p in (self.act_path(k), self.act_path(k) + ".json"):
                    with contextlib.suppress(OSError):
                        os.remove(p)
        for f in os.listdir(self.acts):  # stale work files of killed runs
            if ".tmp." in f or f.startswith("work-"):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.acts, f))
