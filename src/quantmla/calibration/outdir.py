"""A calibration's output directory holds exactly one checkpoint.

``quantmla calibrate`` (in memory or ``--stream``) refuses a directory that already holds a
checkpoint unless ``--overwrite`` is given; with it, the new checkpoint is written into a staging
directory beside the old one (``.<name>.quantmla-new`` in the same parent, so the final renames stay
on one file system) and swapped in whole when it is complete: the old directory is renamed away,
the new one renamed into its place, then the old one deleted. A reader never sees the old weights
beside the new config, and a run killed before the swap leaves the old checkpoint untouched.
"""

from __future__ import annotations

import os
import shutil

from quantmla.errors import QuantMLAError

STATE_DIR = ".quantmla_stream"  # a streamed run's state (markers, activation checkpoints): calibration/stream
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The names in the directory `path` that belong to a checkpoint: config.json and weight files (safetensors,
    .bin, their indexes); none where `path` is not a directory."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return []
    return sorted(f for f in os.listdir(path) if f == "config.json" or f.endswith(_WEIGHT_SUFFIXES))


def holds_checkpoint(path: str | os.PathLike) -> bool:
    """True if the directory `path` holds a checkpoint or part of one: config.json, weight files
    (safetensors, .bin, their indexes), or a streamed run's state."""
    return bool(checkpoint_files(path)) or os.path.isdir(os.path.join(os.fspath(path), STATE_DIR))


def staging_dir(path: str | os.PathLike) -> str:
    """Where a replacement for the checkpoint at `path` is written before it is swapped in."""
    path = os.path.abspath(os.fspath(path))
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.quantmla-new")


def _old_dir(path: str) -> str:
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.quantmla-old")


def _nearest_existing(path: str) -> str:
    p = path
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def check_output_dir(path: str | os.PathLike, overwrite: bool, flag: str = "--overwrite", what: str = "--out") -> None:
    """Refuse, before any work, an output path that cannot take a new checkpoint: a file, a place
    this process cannot write, or a directory that already holds a checkpoint (unless `overwrite`)."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise QuantMLAError(f"{what} {path} exists and is not a directory; choose a directory path")
    base = _nearest_existing(path)
    if not os.path.isdir(base) or not os.access(base, os.W_OK | os.X_OK):
        raise QuantMLAError(f"{what} {path}: cannot write there ({base} is not writable); choose a writable {what}")
    if holds_checkpoint(path):
        if not overwrite:
            raise QuantMLAError(f"{what} {path} already holds a checkpoint; choose another {what}, or pass {flag} to "
                                "replace it whole")
        parent = os.path.dirname(path)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise QuantMLAError(f"{what} {path}: replacing it needs a writable parent directory ({parent} is not); "
                                f"choose another {what}")


def fresh_staging(path: str | os.PathLike) -> str:
    """An empty staging directory for a replacement of `path` (an earlier run's is discarded)."""
    st = staging_dir(path)
    if os.path.exists(st):
        shutil.rmtree(st)
    os.makedirs(st)
    return st


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def swap_in(staging: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the complete checkpoint in `staging` at `path`, replacing whatever is there whole."""
    staging, path = os.path.abspath(os.fspath(staging)), os.path.abspath(os.fspath(path))
    old = _old_dir(path)
    if os.path.exists(old):
        shutil.rmtree(old)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(staging, path)
    fsync_dir(os.path.dirname(path))
    if os.path.exists(old):
        shutil.rmtree(old)
