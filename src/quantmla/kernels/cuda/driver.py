"""The few CUDA driver calls the CUDA decode path needs, through ctypes: load a cubin into the current
context, raise a function's dynamic shared-memory limit, encode a tensor map, launch it on a stream. Functions are
cached per (device, cubin)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from quantmla.errors import QuantMLAError

_LIB = None
_FUNCS: dict = {}
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _lib():
    global _LIB
    if _LIB is None:
        _LIB = ctypes.CDLL("libcuda.so.1")
    return _LIB


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(rc, ctypes.byref(name))
        raise QuantMLAError(f"CUDA driver call {what} failed: {name.value.decode() if name.value else rc}")


def function(cubin: Path, name: str, smem: int, device: torch.device):
    """The kernel `name` of `cubin`, loaded into `device`'s primary context, allowed `smem` bytes."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    key = (index, str(cubin), name)
    if key not in _FUNCS:
        with torch.cuda.device(index):
            torch.cuda.init()
            torch.empty(1, device=f"cuda:{index}")  # makes the primary context current on this thread
            lib = _lib()
            image = Path(cubin).read_bytes()
            mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
            _check(lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(image)), "cuModuleLoadData")
            _check(lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
            _check(lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(smem)),
                   "cuFuncSetAttribute")
            _FUNCS[key] = (mod, fn, image)
    return _FUNCS[key][1]


_U16, _SWIZZLE_128B, _L2_256B = 1, 3, 3  # CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion (cuda.h)


class TensorMap(ctypes.Structure):
    """A CUtensorMap: 128 opaque bytes, 128-byte aligned when encoded (`tensor_map_2byte` keeps its backing buffer)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


def tensor_map_2byte(address: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...]):
    """cuTensorMapEncodeTiled over 16-bit elements at `address`: `dims` innermost first, `strides` in bytes of every
    dim but the innermost, boxes of `box` elements, the 128-byte swizzle, no interleave, L2 promotion of 256 bytes.
    Returns the map as a 128-byte ctypes buffer at a 128-byte aligned address (pass it by value: ("s", map))."""
    lib = _lib()
    lib.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    rank = len(dims)
    raw = ctypes.create_string_buffer(256)
    buf = TensorMap.from_address((ctypes.addressof(raw) + 127) // 128 * 128)
    buf._backing = raw  # the aligned view keeps its buffer alive
    _check(lib.cuTensorMapEncodeTiled(ctypes.addressof(buf), _U16, rank, ctypes.c_void_p(address),
                                      (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides),
                                      (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
                                      0, _SWIZZLE_128B, _L2_256B, 0), "cuTensorMapEncodeTiled")
    return buf


def launch(fn, grid: tuple[int, ...], threads: int, smem: int, stream: int, args: list[tuple[str, object]]) -> None:
    """cuLaunchKernel(fn) with grid (x[, y[, z]]), `threads` per block; args as ("p"|"i"|"f", value), or ("s", a ctypes
    buffer) for a struct passed by value (a tensor map)."""
    conv = {"p": ctypes.c_void_p, "i": ctypes.c_int, "f": ctypes.c_float, "s": lambda v: v}
    vals = [conv[k](v) for k, v in args]
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    _check(_lib().cuLaunchKernel(fn, gx, gy, gz, threads, 1, 1, smem, ctypes.c_void_p(stream), params, None),
           "cuLaunchKernel")
