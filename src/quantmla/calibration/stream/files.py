"""Files of a streamed calibration: atomic writes (temporary name, fsync, rename, fsync of the
directory) and a safetensors reader of headers and writer of shards one tensor at a time."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from quantmla.calibration.outdir import fsync_dir as _fsync_dir
from quantmla.errors import QuantMLAError

INDEX_NAME = "model.safetensors.index.json"

# safetensors dtype names
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _tmp_name(path: str) -> str:
    return f"{path}.tmp.{os.getpid()}"


def atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = _tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _write_tensor_bytes(f, t: torch.Tensor, chunk: int = 1 << 28) -> None:
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    arr = flat.numpy()
    for s in range(0, arr.shape[0], chunk):
        f.write(memoryview(arr[s : s + chunk]))


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def read_safetensors_header(path: str) -> dict:
    """The JSON header of a safetensors file (names -> dtype, shape, data_offsets)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise QuantMLAError(f"{path} is not a safetensors file (truncated)")
        (n,) = struct.unpack("<Q", raw)
        if n > 1 << 30:
            raise QuantMLAError(f"{path} is not a safetensors file (header size {n})")
        hdr = f.read(n)
        if len(hdr) < n:
            raise QuantMLAError(f"{path} is truncated inside its header")
    out = json.loads(hdr)
    out.pop("__metadata__", None)
    return out


@dataclass
class ShardEntry:
    """One tensor of a shard being written: its name, dtype, shape and how to produce it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    get: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * torch.empty((), dtype=self.dtype).element_size()


def write_safetensors_streamed(path: str, entries: list[ShardEntry], fault: Callable[[str, int], None] | None = None) -> int:
    """Write a safetensors file one tensor at a time (never holding the whole shard), atomically:
    temporary name, fsync, rename, fsync of the directory. Returns the file size."""
    # larger elements first (keeps every tensor aligned to its element size), then by name
    entries = sorted(entries, key=lambda e: (-torch.empty((), dtype=e.dtype).element_size(), e.name))
    header: dict[str, Any] = {}
    off = 0
    for e in entries:
        if e.dtype not in _ST_NAMES:
            raise QuantMLAError(f"cannot store {e.name} of dtype {e.dtype} in safetensors")
        header[e.name] = {"dtype": _ST_NAMES[e.dtype], "shape": [int(s) for s in e.shape], "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = _tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for k, e in enumerate(entries):
            t = e.get()
            if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
                raise QuantMLAError(f"{e.name}: produced {t.dtype} {tuple(t.shape)}, announced {e.dtype} {e.shape}")
            _write_tensor_bytes(f, t)
            del t
            if fault is not None:
                f.flush()
                fault("tensor_written", k)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return os.path.getsize(path)
