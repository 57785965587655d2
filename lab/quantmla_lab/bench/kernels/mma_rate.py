"""The tensor pipe's rate at the decode kernel's occupancy (mma_rate.cu): mma.sync m16n8k16 per warp against wgmma
m64n16k16 and m64n32k16 per warpgroup, fp16 operands in registers (wgmma's B in shared memory), fp32 accumulators;
mma.sync m16n8k32 on 8-bit operands (e4m3 into fp32, s8 into s32); wgmma on 8-bit operands at N = 32 and 16 (e4m3,
s8) and 48 (e4m3), 4-warp CTAs at 1 to 4 CTAs per SM. Gives the floor that
the products alone put under a tokens-as-M decode tile, and what 8-bit operands would buy. Each row names the tensor
and conversion instructions its build compiled to (SASS opcodes, from cuobjdump): on sm_90 the e4m3 mma.sync is
F2FP conversions and HMMA.16816, no 8-bit tensor instruction.

    python -m quantmla_lab.bench.kernels.mma_rate --out lab/results/kernels/mma_rate_h200.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from quantmla.kernels.cuda import build, driver
from quantmla_lab.bench.kernels.decode_speed import source_commit
from quantmla_lab.bench.common import launch_ms, save

SOURCE = Path(__file__).with_name("mma_rate.cu")
# per warp (mma.sync: two a chain step) / per warpgroup (wgmma)
FLOP = {0: 2 * 16 * 8 * 16 * 2, 1: 2 * 64 * 16 * 16, 2: 2 * 16 * 8 * 32 * 2, 3: 2 * 16 * 8 * 32 * 2,
        4: 2 * 64 * 32 * 16, 5: 2 * 64 * 32 * 32, 6: 2 * 64 * 32 * 32, 7: 2 * 64 * 16 * 32, 8: 2 * 64 * 48 * 32}
NAME = {0: "mma.sync m16n8k16 f16", 1: "wgmma m64n16k16 f16", 2: "mma.sync m16n8k32 e4m3", 3: "mma.sync m16n8k32 s8",
        4: "wgmma m64n32k16 f16", 5: "wgmma m64n32k32 e4m3", 6: "wgmma m64n32k32 s8", 7: "wgmma m64n16k32 e4m3",
        8: "wgmma m64n48k32 e4m3"}
WGMMA = {1, 4, 5, 6, 7, 8}  # modes whose unit is a warpgroup


def cubin(mode: int, chains: int, iters: int, tmp: Path) -> Path:
    out = tmp / f"mma_rate_{mode}_{chains}.cubin"
    cmd = [build.nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
           f"-I{Path(build.__file__).parent}", f"-DMODE={mode}", f"-DCHAINS={chains}", f"-DITERS={iters}", "-o", str(out),
           str(SOURCE)]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def sass_ops(path: Path) -> dict[str, int] | None:
    """The tensor and conversion instructions of a cubin's SASS (cuobjdump), by opcode; None without cuobjdump."""
    try:
        sass = subprocess.run(["cuobjdump", "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return dict(collections.Counter(re.findall(r"\b((?:[HIQ]MMA|HGMMA|QGMMA|IGMMA|F2FP)\.[A-Z0-9_.]+)", sass)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--ctas-per-sm", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--iters", type=int, default=4096)
    ap.add_argument("--modes", type=int, nargs="+", default=sorted(NAME), choices=sorted(NAME), help=str(NAME))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": source_commit(), "command": " ".join(["python -m quantmla_lab.bench.kernels.mma_rate",
                                                                              *sys.argv[1:]]), "sms": sms, "rows": []}
    out = torch.zeros(1024, device=dev)
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes:
            for chains in a.chains:
                path = cubin(mode, chains, a.iters, Path(tmp))
                ops = sass_ops(path)
                print(f"{NAME[mode]:23s} chains {chains}: SASS {ops}", flush=True)
                fn = driver.function(path, "mma_rate", 0, dev)
                for cps in a.ctas_per_sm:
                    grid = sms * cps
                    run = lambda: driver.launch(fn, (grid,), 128, 0, torch.cuda.current_stream().cuda_stream,  # noqa: E731
                                                [("p", out.data_ptr()), ("i", 12345)])
                    t = launch_ms(run, 10) * 1e-3  # s
                    units = grid * (1 if mode in WGMMA else 4)  # warps (mma.sync) or warpgroups (wgmma)
                    flop = units * a.iters * chains * FLOP[mode]
                    r = {"mode": NAME[mode], "chains": chains, "sass_ops": ops,
                         "ctas_per_sm": cps, "warps_per_sm": 4 * cps, "s": t, "tflops": flop / t / 1e12}
                    res["rows"].append(r)
                    print(f"{r['mode']:23s} chains {chains} warps/SM {4 * cps:2d}: {r['tflops']:7.1f} TFLOP/s", flush=True)
    save(res, a.out)


if __name__ == "__main__":
    main()
