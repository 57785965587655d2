"""Hidden states of the calibration sequences between decoder layers, in memory, on the device or
in a file-backed mapping on disk; saved as resume checkpoints."""

from __future__ import annotations

import json
import os

import torch

from quantmla.calibration.stream.files import _ST_DTYPES, _ST_NAMES, _fsync_dir, _tmp_name, _write_tensor_bytes, atomic_write_json
from quantmla.calibration.stream.memory import _tensor_bytes

class ActivationBuffer:
    """[N, S, hidden] hidden states: in memory ("memory"/"device") or in a file-backed shared
    mapping ("disk", pages written back by the kernel, so RAM holds only what is being used)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, mode: str, device, path: str | None = None,
                 tensor: torch.Tensor | None = None):
        self.shape, self.dtype, self.mode, self.path = tuple(shape), dtype, mode, path
        if tensor is not None:
            self.t = tensor
        elif mode == "disk":
            numel = 1
            for s in shape:
                numel *= s
            if os.path.exists(path):
                os.remove(path)
            self.t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(*shape)
        else:
            self.t = torch.empty(shape, dtype=dtype, device=device if mode == "device" else "cpu")

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.t)

    def save(self, final: str, meta: dict) -> None:
        """Commit these activations as a checkpoint file (atomic); for disk mode the mapping's file."""
        if self.mode == "disk":
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self.path, final)
            self.path = final
        else:
            tmp = _tmp_name(final)
            with open(tmp, "wb") as f:
                _write_tensor_bytes(f, self.t)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        _fsync_dir(os.path.dirname(final))
        atomic_write_json(final + ".json", {**meta, "shape": list(self.shape), "dtype": _ST_NAMES[self.dtype],
                                            "bytes": os.path.getsize(final)})

    @classmethod
    def load(cls, final: str, mode: str, device) -> "ActivationBuffer":
        with open(final + ".json") as f:
            meta = json.load(f)
        shape, dtype = tuple(meta["shape"]), _ST_DTYPES[meta["dtype"]]
        numel = 1
        for s in shape:
            numel *= s
        if mode == "disk":  # read-only input: map the checkpoint itself (private, paged lazily)
            t = torch.from_file(final, shared=False, size=numel, dtype=dtype).view(*shape)
            return cls(shape, dtype, mode, device, final, tensor=t)
        t = torch.from_file(final, shared=False, size=numel, dtype=dtype).view(*shape).clone()
        return cls(shape, dtype, mode, device, None, tensor=t.to(device) if mode == "device" else t)

    @staticmethod
    def valid(final: str) -> bool:
        try:
            with open(final + ".json") as f:
                meta = json.load(f)
            return os.path.getsize(final) == meta["bytes"]
        except (OSError, ValueError, KeyError):
            return False
