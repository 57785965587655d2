"""The tokens-as-M tile loop at 64 query rows on warpgroup MMAs, timed alone (tokens_m_64.cu): µs a 64-token tile
against the heads-as-M kernel's (its BF16 and INT4/INT4 decode kernels at 128 heads, 32 x 8192, timed in the same
process through the API).

    python -m quantmla_lab.bench.kernels.tokens_m_64 --out $OUT/kernels/tokens_m_64_h200.json

Each build (`--builds`: the .cu's macros, `NAME=V,NAME=V`) runs one CTA an SM of three warpgroups, each CTA
`--iters` tiles, one bulk copy a tile from a pool of `--pages` pages (3 stages, 5 with DQA); the values are not
checked (the time is that of the instruction stream and the copies, see the .cu). The macros: DQA 1 the codes
dequantized into the register A operands (one accumulator, no zero-point products, P alone a buffer), else masked in
place (exact fp16 subnormals) with ZL 1 the product that sums P·zero and P over a tile's tokens (0 without) and
ONE_ACC 1 the scores' content products a plane at a time on one set of accumulators; SG the scores' words (of the 4 a
16-byte load) whose products are committed as one group; SW (DQA) the scores' groups left in flight at a wait;
OUT_WAIT the output's k-steps left in flight; REGS_S the scores' warpgroup's registers (setmaxnreg); SKIP_QK, SKIP_PV,
SKIP_COPY 1 leave the scores' code products, the output's, or the refills out (times only). `us_per_tile` is a
launch's time (CUDA events, median of `--reps`) over its iterations. ptxas's registers, spills and whether it
serialized the products come with each build.

The heads-as-M rows give the same figure for the shipped kernel: a decode call's time (the decode and combine
kernels, CUDA-graph replay with L2 flushed before each call) over the 64-token tiles a CTA reads. The model's page
pool, 64 pages by default (1.26 MB), stays in L2; `--pages 4096` (80.7 MB) reads it from DRAM as the shipped calls
do. Without
a GPU it builds the cubins and stops (`--build-only`).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from quantmla.kernels.cuda import build, driver
from quantmla_lab.bench.common import launch_ms, parse_fresh, record, save

SOURCE = Path(__file__).with_name("tokens_m_64.cu")
RAW_BYTES, CHUNK, NT = 19712, 8192, 384  # the .cu's page, chunk and threads


def smem_bytes(dqa: int = 0) -> int:
    """The kernel's dynamic shared memory (its SM_FLAG + 16, plus the chunks' 1024-byte alignment): the query block and
    its sums (10 chunks), two P buffers of 5 chunks (DQA: 1), the raw stages (3; DQA: 5)."""
    stages = 5 if dqa else 3
    return 10 * CHUNK + 2 * (1 if dqa else 5) * CHUNK + stages * RAW_BYTES + 8 * stages + 16 + 1024


MACROS = ("DQA", "SW", "ZL", "ONE_ACC", "OUT_WAIT", "REGS_S", "SG", "SKIP_QK", "SKIP_PV", "SKIP_COPY")
DEFAULT_BUILDS = ["DQA=1,ZL=0,OUT_WAIT=0,SG=2,REGS_S=136", "ZL=1,ONE_ACC=1,OUT_WAIT=0,REGS_S=152",
                  "ZL=0,ONE_ACC=1,OUT_WAIT=0,SG=4,REGS_S=152", "ZL=1,ONE_ACC=0,OUT_WAIT=1,REGS_S=152"]


def parse_build(spec: str) -> dict[str, int]:
    """`NAME=V,NAME=V` -> {NAME: V} over MACROS; SystemExit naming the fix otherwise."""
    got = {}
    for item in spec.split(","):
        name, _, v = item.partition("=")
        if name not in MACROS or not v.isdigit():
            raise SystemExit(f"--builds {spec!r}: write NAME=V[,NAME=V], NAME one of {', '.join(MACROS)}, V an integer")
        got[name] = int(v)
    if got.get("REGS_S", 160) % 8:
        raise SystemExit(f"--builds {spec!r}: REGS_S must be a multiple of 8 (setmaxnreg's steps)")
    return got


def cubin(macros: dict[str, int], iters: int, tmp: Path, pages: int = 64) -> tuple[Path, dict]:
    """The build of `macros` for sm_90a, `iters` tiles a CTA over a pool of `pages` pages, in `tmp`: (its path,
    ptxas's registers, spill-store bytes and whether it serialized the warpgroup products)."""
    out = tmp / ("tokens_m_64_" + "_".join(f"{k}{v}" for k, v in sorted(macros.items())) + f"_{iters}_{pages}.cubin")
    cmd = [build.nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
           f"-I{Path(build.__file__).parent}", *[f"-D{k}={v}" for k, v in sorted(macros.items())],
           f"-DITERS={iters}", f"-DNPAGES={pages}", "-o", str(out), str(SOURCE)]
    log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    regs_used = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return out, {"registers": int(regs_used.group(1)) if regs_used else None,
                 "spill_store_bytes": int(spill.group(1)) if spill else None,
                 "products_serialized": "serialized" in log}


def heads_m_rows() -> list[dict]:
    """The shipped heads-as-M kernel at 128 heads, 32 x 8192 (64 tiles a CTA): BF16 and INT4/INT4 calls, µs a tile."""
    from quantmla.cache.layout import PageLayout, TokenLayout, preset
    from quantmla.kernels import api
    from quantmla_lab.bench.kernels import decode_speed

    rows = []
    for fmt in ("bf16", "int4/int4"):
        lay = PageLayout(TokenLayout(512, 64, preset(fmt)), 64)
        c = decode_speed.Cache(lay, [8192] * 32, seed=1, device="cuda")
        qc = torch.randn(32, 128, 512, device="cuda").to(torch.bfloat16)
        qr = torch.randn(32, 128, 64, device="cuda").to(torch.bfloat16)
        md = api.get_mla_metadata(c.seq_lens, 128, 1, lay)
        out = torch.empty(32, 128, 512, device="cuda", dtype=torch.bfloat16)

        def fn(qc=qc, qr=qr, c=c, lay=lay, md=md, out=out):
            api.mla_decode_with_kvcache(qc, qr, c.pages, c.block_table, c.seq_lens, lay, 0.07, metadata=md, out=out)

        ms, graphed = decode_speed.time_ms(fn, 10, 50)
        tiles = 32 * 8192 // 64 // md.num_units  # tiles a CTA (each of the unit's head blocks reads them all)
        rows.append({"kernel": "heads as M (shipped)", "format": fmt, "variant": str(md.variant), "call_us": ms * 1e3,
                     "tiles_per_cta": tiles, "us_per_tile": ms * 1e3 / tiles, "graph": graphed})
        del c, fn
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--builds", nargs="+", default=DEFAULT_BUILDS, metavar="NAME=V[,NAME=V]")
    p.add_argument("--iters", type=int, default=512)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--pages", type=int, default=64, help="the page pool the copies cycle over (64: 1.26 MB, in L2)")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--out", default=None)
    a = parse_fresh(p) if argv is None else p.parse_args(argv)
    builds = [parse_build(b) for b in a.builds]
    if build.nvcc() is None:
        raise SystemExit("no nvcc: install the CUDA toolkit (or set CUDA_HOME)")
    gpu = torch.cuda.is_available() and not a.build_only
    res = record(iters=a.iters, pages=a.pages, rows=[])
    with tempfile.TemporaryDirectory() as tmp:
        for macros in builds:
            row = {"kernel": "tokens as M, 64 rows", "macros": macros}
            path, ptx = cubin(macros, a.iters, Path(tmp), a.pages)
            row.update(ptx)
            if gpu:
                dev = torch.device("cuda")
                sms = torch.cuda.get_device_properties(dev).multi_processor_count
                pages = torch.zeros(a.pages * RAW_BYTES, dtype=torch.uint8, device=dev)
                out = torch.empty(sms * NT, device=dev)
                smem = smem_bytes(macros.get("DQA", 0))
                fn = driver.function(path, "tokens_m_64", smem, dev)

                def run(fn=fn, smem=smem, pages=pages, out=out, sms=sms):
                    driver.launch(fn, (sms,), NT, smem, torch.cuda.current_stream().cuda_stream,
                                  [("p", pages.data_ptr()), ("p", out.data_ptr())])

                row["us_per_tile"] = round(launch_ms(run, a.reps) * 1e3 / a.iters, 4)
                row["finite"] = bool(torch.isfinite(out).all())
            res["rows"].append(row)
            print(row, flush=True)
    if gpu:
        for r in heads_m_rows():
            res["rows"].append(r)
            print(r, flush=True)
    save(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
