"""Memory accounting of a streamed calibration: resident set, its peak, heap trimming, the bytes
of checkpoint weights held (:class:`WeightMeter`), and tensor sizes of nested structures."""

from __future__ import annotations

import dataclasses
import os

import torch

def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    """High-water mark of the resident set (VmHWM; since the last :func:`reset_peak_rss`)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5). False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc malloc_trim), so a layer's memory does not
    linger as allocator slack when the next, differently shaped layer is loaded."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


class WeightMeter:
    """Bytes of checkpoint weights this process holds materialized right now, and the peak.

    Every tensor the streamer reads from the checkpoint into a module is added when loaded and
    subtracted when the module is released; tests assert on :attr:`peak`."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.loaded_total = 0

    def add(self, n: int) -> None:
        self.live += n
        self.loaded_total += n
        self.peak = max(self.peak, self.live)

    def sub(self, n: int) -> None:
        self.live -= n


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def nbytes_of(obj, _seen=None) -> int:
    """Bytes of the tensors reachable from `obj` (dicts, lists, tuples, dataclasses), each once."""
    seen = set() if _seen is None else _seen
    if torch.is_tensor(obj):
        key = (obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes()) if obj.device.type != "meta" else id(obj)
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes() if obj.device.type != "meta" else 0
    if isinstance(obj, dict):
        return sum(nbytes_of(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes_of(v, seen) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(nbytes_of(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    return 0


def to_device(obj, device):
    """`obj` with every tensor (in dicts, lists, tuples, dataclasses) moved to `device`."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj)
                                           if f.init})
    return obj
