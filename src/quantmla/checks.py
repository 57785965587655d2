"""Checks of command-line input made before any long work starts: devices, numbers, output paths,
weight files, and the CPU thread count of a process. Each failure is a
:class:`~quantmla.errors.QuantMLAError` whose message names the flag or file and the fix.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

from quantmla.errors import CorruptCheckpointError, QuantMLAError

MAX_DEFAULT_THREADS = 8


# -- numbers --------------------------------------------------------------------------------------


def check_positive(value, flag: str, integer: bool = False) -> None:
    """`value` (a flag's number) is finite and > 0; NaN, Inf, 0 and negatives are refused."""
    ok = value is not None and math.isfinite(value) and value > 0
    if not ok:
        raise QuantMLAError(f"{flag} must be positive and finite, got {value}"
                            + ("; give a whole number >= 1" if integer else "; give a number > 0"))


def check_at_least(value: int, flag: str, lowest: int, why: str = "") -> None:
    """`value` (a flag's whole number) is at least `lowest`."""
    if value < lowest:
        raise QuantMLAError(f"{flag} must be at least {lowest}, got {value}" + (f" ({why})" if why else ""))


# -- devices ---------------------------------------------------------------------------------------


def check_device(device: str | None, flag: str = "--device") -> str | None:
    """`device` if torch can use it here, else QuantMLAError naming `flag` (None passes: the command's default)."""
    if device is None:
        return None
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise QuantMLAError(f"{flag} {device}: not a torch device; use cpu or cuda (cuda:N for GPU N)") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            cpu = "--device cpu" if flag.startswith("--") else f"{flag}='cpu'"
            raise QuantMLAError(f"{flag} {device}: no CUDA device is available here ({why}); use {cpu}, "
                                "or run it on a GPU machine")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise QuantMLAError(f"{flag} {device}: there are only {torch.cuda.device_count()} CUDA devices "
                                f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    return device


# -- output paths ----------------------------------------------------------------------------------


def _check_dir_writable(d: str, what: str) -> None:
    try:
        os.makedirs(d, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        raise QuantMLAError(f"{what}: cannot write into {d!r} ({e.strerror or e}); pick a writable location") from None


def check_output_file(path: str | None, flag: str = "--out") -> None:
    """The file `path` can be written (its directory is created if needed); checked before the work
    so that a bad path fails now, not after it."""
    if not path:
        return
    if os.path.isdir(path):
        raise QuantMLAError(f"{flag} {path}: is a directory; give a file name")
    _check_dir_writable(os.path.dirname(os.path.abspath(path)), f"{flag} {path}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise QuantMLAError(f"{flag} {path}: the file exists and is read-only; pick another path")


def check_output_dir(path: str | None, flag: str = "--out") -> None:
    """The directory `path` exists or can be created, and files can be written into it."""
    if not path:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise QuantMLAError(f"{flag} {path}: exists and is not a directory; give a directory")
    _check_dir_writable(path, f"{flag} {path}")


# -- weight files ----------------------------------------------------------------------------------

INDEX_FILE = "model.safetensors.index.json"


def check_weight_files(path: str | os.PathLike) -> None:
    """Raise CorruptCheckpointError if a safetensors weight file of the checkpoint directory `path`
    (model.safetensors, or the shards its index names) is missing, truncated or not safetensors.
    Reads the headers only (the file sizes they promise are checked); a directory without weight
    files passes (config-only commands need none)."""
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    files = []
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{index} is not a safetensors index ({type(e).__name__}: {e}); "
                                         "copy or download the checkpoint again") from None
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise CorruptCheckpointError(f"{path}: {len(missing)} weight shard(s) named in {INDEX_FILE} are missing "
                                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                                         "copy or download the checkpoint again")
        files = [os.path.join(path, s) for s in shards]
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = [os.path.join(path, "model.safetensors")]
    for f in files:
        try:
            with safe_open(f, "pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise CorruptCheckpointError(
                f"{f} is truncated or not a safetensors file ({e}); copy or download the checkpoint again") from None


# -- CPU threads -----------------------------------------------------------------------------------


def default_threads() -> int:
    """Intra-op CPU threads for one quantmla process: OMP_NUM_THREADS when set, else the CPUs this
    process may use, at most MAX_DEFAULT_THREADS (several processes on one host then do not each
    take every core)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise QuantMLAError(f"OMP_NUM_THREADS={env!r} is not a whole number; unset it or set e.g. 4") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_DEFAULT_THREADS))
