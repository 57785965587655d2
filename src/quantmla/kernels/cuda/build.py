"""nvcc builds of mla_decode.cu, one cubin per set of constants, cached on disk.

The cache key is the source and the headers it includes, the constants, the target architecture and nvcc's version, so an edited
source or another toolkit never loads a stale cubin. Files are written under a temporary name and
renamed, so concurrent processes never read half a file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from quantmla.errors import QuantMLAError

SOURCE = Path(__file__).with_name("mla_decode.cu")
SOURCE_TM = Path(__file__).with_name("mla_decode_tm.cu")  # tokens as the MMA's M dimension (plans with TM=1)
SOURCE_WG = Path(__file__).with_name("mla_decode_wg.cu")  # heads as M on warpgroup MMAs (plans with WG=1)
SOURCE_SEESAW = Path(__file__).with_name("mla_decode_seesaw.cu")  # heads as M, warpgroups out of phase (WG=1, SEESAW=1)
# the headers the sources include (every .cuh beside them): part of every build's cache key
HEADERS = tuple(sorted(p.name for p in SOURCE.parent.glob("*.cuh")))


def source_of(macros: tuple[tuple[str, int], ...]) -> Path:
    """The kernel source a plan's constants build: mla_decode_tm.cu where TM=1, mla_decode_wg.cu where WG=1
    (mla_decode_seesaw.cu where SEESAW=1 too), else mla_decode.cu."""
    m = dict(macros)
    if m.get("WG"):
        return SOURCE_SEESAW if m.get("SEESAW") else SOURCE_WG
    return SOURCE_TM if m.get("TM") else SOURCE


def cache_dir() -> Path:
    return Path(os.environ.get("QUANTMLA_CUDA_CACHE") or Path.home() / ".cache" / "quantmla" / "cuda")


def nvcc() -> str | None:
    """The nvcc on PATH, under CUDA_HOME, or in /usr/local/cuda."""
    found = shutil.which("nvcc")
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if not found and home and (Path(home) / "bin" / "nvcc").exists():
            found = str(Path(home) / "bin" / "nvcc")
    return found


_VERSION: dict = {}
BUILDS: list[tuple[str, float]] = []  # (cubin file name, seconds) of each nvcc build this process ran, in order


def _nvcc_version(exe: str) -> str:
    if exe not in _VERSION:
        _VERSION[exe] = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    return _VERSION[exe]


def arch_of(device: torch.device | str | int) -> str:
    """sm_XY of a device (sm_90a on Hopper: its architecture-specific target)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if major == 9 else "")


def compile_cubin(macros: tuple[tuple[str, int], ...], arch: str, out: Path | None = None,
                  extra: tuple[str, ...] = ()) -> Path:
    """Compile the plan's source (`source_of`) with `macros` for `arch` (e.g. "sm_90a") into the cache (or `out`)."""
    exe = nvcc()
    if exe is None:
        raise QuantMLAError("the CUDA decode kernel needs nvcc (on PATH, CUDA_HOME or /usr/local/cuda); "
                            "set QUANTMLA_DECODE_KERNEL=triton to use the Triton kernels instead")
    source = source_of(macros)
    src = source.read_bytes() + b"".join(source.with_name(h).read_bytes() for h in HEADERS)
    key = hashlib.sha256(src + repr((macros, arch, extra)).encode() + _nvcc_version(exe).encode()).hexdigest()[:24]
    path = out or cache_dir() / f"mla_decode_{arch}_{key}.cubin"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    code = arch.replace("sm_", "compute_")
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        tmp_out = Path(tmp) / path.name
        cmd = [exe, "-cubin", "-O3", "-std=c++17", f"-gencode=arch={code},code={arch}", *extra,
               *[f"-D{k}={v}" for k, v in macros], "-o", str(tmp_out), str(source)]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise QuantMLAError(f"nvcc failed to build the CUDA decode kernel ({' '.join(cmd)}):\n{r.stderr.strip()}")
        os.replace(tmp_out, path)
        BUILDS.append((path.name, time.perf_counter() - t0))
    return path


_CUBINS: dict = {}  # (macros, arch, extra) -> cubin path: each launch's lookup, the sources hashed once a process


def cubin_for(macros: tuple[tuple[str, int], ...], device: torch.device) -> Path:
    """The cubin of `macros` for `device` (QUANTMLA_CUDA_LINEINFO=1: with source lines, for a profiler). Every
    launch asks; the build's cache key (the sources read and hashed) is computed once a process."""
    extra = ("-lineinfo",) if os.environ.get("QUANTMLA_CUDA_LINEINFO") == "1" else ()
    key = (macros, arch_of(device), extra)
    if key not in _CUBINS:
        _CUBINS[key] = compile_cubin(*key[:2], extra=extra)
    return _CUBINS[key]
