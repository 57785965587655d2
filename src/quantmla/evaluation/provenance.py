"""Fingerprints of what a result row was measured on: the checkpoint and the held-out text.

Rows name their model and held-out set by directory base name (short, readable tables); the fingerprints beside them
tell two checkpoints or two held-out sets of the same name apart, so that rows of one never merge into a table of the
other. A fingerprint is a SHA-256 over the relevant files' relative names, sizes and bytes: whole files up to
``WHOLE_FILE_BYTES``, and for larger ones (weight shards of real checkpoints) their safetensors header and
``SAMPLES`` evenly spaced pieces of ``SAMPLE_BYTES``, so that a 700 GB checkpoint is fingerprinted in seconds (two
checkpoints that differ only outside the sampled pieces of a large shard share a fingerprint).
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

WHOLE_FILE_BYTES = 64 << 20
SAMPLES = 16
SAMPLE_BYTES = 64 << 10
# what of a checkpoint directory the measurements depend on: the model's config, weights and tokenizer
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")
MODEL_SUFFIXES = (".safetensors",)


def _file_digest(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(struct.pack("<Q", size))
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return
        if path.suffix == ".safetensors":  # the header: every tensor's name, dtype, shape and offsets
            n = struct.unpack("<Q", f.read(8))[0]
            h.update(f.read(min(n, WHOLE_FILE_BYTES)))
        for i in range(SAMPLES):
            f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))


def fingerprint(files: list[Path], root: Path) -> str:
    """'sha256:' + 16 hex digits over `files` (paths under `root`, named relative to it, in sorted order)."""
    h = hashlib.sha256()
    for p in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        _file_digest(h, p)
    return "sha256:" + h.hexdigest()[:16]


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """The fingerprint of a checkpoint directory's config, weights (``*.safetensors``) and tokenizer files."""
    root = Path(model_dir)
    files = [p for p in root.iterdir() if p.is_file() and (p.name in MODEL_FILES or p.suffix in MODEL_SUFFIXES)]
    return fingerprint(files, root)


def data_fingerprint(data_dir: str | os.PathLike) -> str:
    """The fingerprint of every file under a held-out data directory."""
    root = Path(data_dir)
    return fingerprint([p for p in root.rglob("*") if p.is_file()], root)
