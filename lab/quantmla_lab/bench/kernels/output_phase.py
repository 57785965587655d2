"""The tokens-as-M decode kernel's output phase alone (output_phase.cu): one 64-token tile of INT4 content codes and
16 query rows, on mma.sync fp16 products (today's loop) against 8-bit warpgroup MMAs (e4m3 or u8·u8, two terms of
P·scale side by side as N = 32, the codes transposed into 4 tokens of one channel a register, or stored so already: a
build with a trailing `:T`, the bound of a cache layout that interleaves tokens). Each CTA of 4 warps
(the kernel's output warpgroup) repeats the tile `--iters` times from shared memory, so the time is the phase's own:
no copies, no scores, no softmax.

    python -m quantmla_lab.bench.kernels.output_phase --out $OUT/kernels/output_phase_h200.json

First every build (the binary that is timed) runs on one CTA, its tiles summed over the iterations and divided by
them, against an fp64 reference of the same operands (the codes times P·scale as that build holds it: fp16, two e4m3
terms, or two u8 terms), which checks the operand and accumulator layouts; then each build is timed at `--ctas-per-sm` CTAs an SM (2: the kernel's 8 output warps an SM) with CUDA
events, median of `--reps` launches. `ns_per_tile` is a launch's time over its iterations: one tile of every CTA,
side by side. Registers and spills come from ptxas. Without a GPU it builds the cubins and stops (`--build-only`).
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

SOURCE = Path(__file__).with_name("output_phase.cu")
MODES = {0: "mma.sync m16n8k16 f16", 1: "wgmma m64n32k32 e4m3", 2: "wgmma m64n32k32 u8"}
BN, FB_CC, BM, CG, LDP = 64, 256, 16, 4, 72


def cubin(mode: int, iters: int, minb: int, inflight: int, tmp: Path, pret: bool = False) -> tuple[Path, dict]:
    out = tmp / f"output_phase_{mode}_{iters}_{minb}_{inflight}_{int(pret)}.cubin"
    cmd = [build.nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
           f"-I{Path(build.__file__).parent}", f"-DMODE={mode}", f"-DITERS={iters}", f"-DMINB={minb}",
           f"-DINFLIGHT={inflight}", f"-DPRET={int(pret)}", "-o", str(out), str(SOURCE)]
    log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return out, {"registers": int(regs.group(1)) if regs else None, "spill_store_bytes": int(spill.group(1)) if spill else None}


def operands(seed: int = 0):
    """codes [64, 256] u8; x [4 groups, 16 rows, 64 tokens] P·scale (positive, exponents spread as a tile's P)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (BN, FB_CC), generator=g, dtype=torch.uint8)
    x = torch.exp2(-12 * torch.rand(CG, BM, BN, generator=g, dtype=torch.float64)) * (0.5 + torch.rand(CG, 1, BN, generator=g, dtype=torch.float64))
    return codes, x


def channel_codes(codes: torch.Tensor) -> torch.Tensor:
    """[64 tokens, 512 channels] code values: channel c < 256 is byte c's low nibble, c >= 256 byte c - 256's high."""
    c = codes.to(torch.int64)
    return torch.cat([c & 15, c >> 4], dim=1).to(torch.float64)


def mode0_p16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p16 [4, 16, 64] fp16 in the kernel's k order, the values it holds [4, 16, 64] in token order)."""
    h = x.to(torch.float16)
    pos_token = []
    for pos in range(16):  # k 2q, 2q + 1 -> tokens 2q, 2q + 8; k 2q + 8, 2q + 9 -> tokens 2q + 1, 2q + 9
        q, odd = (pos % 8) // 2, pos % 2
        pos_token.append(2 * q + 8 * odd + (1 if pos >= 8 else 0))
    order = torch.tensor([16 * j + t for j in range(4) for t in pos_token])
    return h[:, :, order].contiguous(), h.to(torch.float64)


def terms(x: torch.Tensor, mode: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hi, lo bytes [4, 16, 64], the value the two terms hold [4, 16, 64], the factor f [4, 16, 1]) of P·scale times
    f, the factor that makes each group's and row's largest 448 (e4m3) or 255 (u8): the kernel sums the codes times
    the value, which stands for x·f."""
    top = 448.0 if mode == 1 else 255.0
    f = top / x.amax(dim=2, keepdim=True)
    y = x * f
    if mode == 1:
        hi = y.to(torch.float8_e4m3fn)
        lo = (y - hi.to(torch.float64)).to(torch.float8_e4m3fn)
        return hi.view(torch.uint8), lo.view(torch.uint8), hi.to(torch.float64) + lo.to(torch.float64), f
    hi = torch.floor(y).clamp(0, 255)
    lo = torch.round((y - hi) * 256).clamp(0, 255)
    return hi.to(torch.uint8), lo.to(torch.uint8), hi + lo / 256, f


def pretransposed(codes: torch.Tensor) -> torch.Tensor:
    """codes [64 tokens, 256 byte columns] -> the PRET=1 tile, [64 words, 16 slots, 16 bytes]: byte 4b + i of the
    slot of (word, quad) is column 4·word + b of token 4·quad + i, quad at slot quad ^ 4·(word & 1)."""
    t = codes.view(16, 4, 64, 4)  # [quad, i, word, b]
    t = t.permute(2, 0, 3, 1).contiguous()  # [word, quad, b, i]
    slot = torch.arange(16).view(1, 16) ^ (4 * (torch.arange(64).view(64, 1) & 1))  # [word, quad]
    out = torch.empty(64, 16, 16, dtype=torch.uint8)
    out[torch.arange(64).view(64, 1), slot] = t.view(64, 16, 16)
    return out


def b8_layout(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """[4 groups, 2 k-steps, 1024] bytes in query_s8.cuh's q8_at order: rows n < 16 hi of query row n, 16 + n lo."""
    b = torch.zeros(CG, 2, 1024, dtype=torch.uint8)
    both = torch.cat([hi, lo], dim=1)  # [4, 32 rows, 64 tokens]
    for s in range(2):
        for n in range(32):
            for k in range(32):
                b[:, s, (k >> 4) * 512 + (n >> 3) * 128 + (n & 7) * 16 + (k & 15)] = both[:, n, 32 * s + k]
    return b


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--builds", nargs="+", default=["0:4:1", "1:4:1", "2:4:1", "1:2:1", "2:2:1", "1:2:2", "2:2:2"],
                   metavar="MODE:MINB:INFLIGHT[:T]", help="MODE 0 mma.sync, 1 e4m3 wgmma, 2 u8 wgmma; MINB CTAs an SM "
                   "the registers are capped for (4: 128 a thread); INFLIGHT M blocks in flight (modes 1, 2: 0, 1, 2 or "
                   "4); a trailing :T (modes 1, 2) reads the tile stored pre-transposed (no byte permutes)")
    p.add_argument("--iters", type=int, default=2048)
    p.add_argument("--ctas-per-sm", type=int, nargs="+", default=[2])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--probe", default=None, metavar="FILE.pt",
                   help="also run each 8-bit build once on one-hot terms (hi: token n of query row n, lo: token n + 32) "
                        "and save codes, terms and outputs to FILE.pt, to read the hardware's fragment layout from")
    p.add_argument("--out", default=None)
    a = parse_fresh(p) if argv is None else p.parse_args(argv)
    builds = []
    for b in a.builds:
        f = b.split(":")
        pret = len(f) == 4 and f[3] == "T"
        f = f[:3] if pret else f
        if (len(f) != 3 or not all(v.isdigit() for v in f) or int(f[0]) not in MODES or int(f[2]) not in (0, 1, 2, 4)
                or (pret and int(f[0]) == 0)):
            raise SystemExit(f"--builds {b!r}: write MODE:MINB:INFLIGHT[:T], MODE 0, 1 or 2, INFLIGHT 0, 1, 2 or 4 and "
                             ":T only with MODE 1 or 2, e.g. 1:2:2 or 2:2:2:T")
        builds.append((*(int(v) for v in f), pret))
    if a.probe and (not torch.cuda.is_available() or a.build_only or all(m == 0 or t for m, _, _, t in builds)):
        raise SystemExit("--probe needs a GPU and an 8-bit build on the tokens' rows (MODE 1 or 2, without :T)")
    if build.nvcc() is None:
        raise SystemExit("no nvcc: install the CUDA toolkit (or set CUDA_HOME)")
    gpu = torch.cuda.is_available() and not a.build_only
    res = record(iters=a.iters, ctas_per_sm=a.ctas_per_sm, rows=[])
    codes, x = operands()
    cc = channel_codes(codes)
    probes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, minb, inflight, pret in builds:
            row = {"mode": MODES[mode], "minb": minb, "inflight": inflight if mode else None,
                   "codes": "pre-transposed" if pret else "tokens' rows"}
            path, ptx = cubin(mode, a.iters, minb, inflight, Path(tmp), pret)
            row.update(ptx)
            if gpu:
                dev = torch.device("cuda")
                if mode == 0:
                    p16, held = mode0_p16(x)
                    b8, f = torch.zeros(1, dtype=torch.uint8), torch.ones(1, dtype=torch.float64)
                else:
                    hi, lo, held, f = terms(x, mode)
                    b8, p16 = b8_layout(hi, lo), torch.zeros(1, dtype=torch.float16)
                args = [(pretransposed(codes) if pret else codes).to(dev), p16.to(dev), b8.to(dev)]
                want = torch.einsum("tc,gnt->gnc", cc, held)  # [group, row, channel]: each channel reads its group
                want = torch.stack([want[(c % 256) // 128 + 2 * (c // 256), :, c] for c in range(512)])  # [512, 16]
                fn = driver.function(path, "output_phase", 0, dev)
                stream = torch.cuda.current_stream().cuda_stream

                def once(operands: list[torch.Tensor]) -> torch.Tensor:
                    """The timed build on one CTA: its --iters tiles summed, [512, 16] on the CPU."""
                    o = torch.full((8192,), float("nan"), device=dev)
                    driver.launch(fn, (1,), 128, 0, stream, [("p", t.data_ptr()) for t in operands] + [("p", o.data_ptr())])
                    torch.cuda.synchronize()
                    return o.view(512, 16).double().cpu() / a.iters

                got = once(args)
                row["rel_err_vs_fp64"] = float((got - want).norm() / want.norm())
                row["held_rel_err_vs_p_scale"] = float(((held / f - x).norm() / x.norm()))
                if a.probe and mode and not pret:
                    eye = torch.zeros(CG, BM, BN, dtype=torch.uint8)
                    for n in range(BM):
                        eye[:, n, n] = 1
                    one = 56 if mode == 1 else 1  # e4m3 0x38 is 1.0
                    pb = b8_layout(eye * one, eye.roll(32, dims=2) * one)
                    pb_dev = pb.to(dev)  # held while the kernel runs
                    probes[mode] = {"codes": codes, "b8": pb, "out": once([args[0], args[1], pb_dev]),
                                    "out_random": got, "b8_random": b8}
                sms = torch.cuda.get_device_properties(dev).multi_processor_count
                for cps in a.ctas_per_sm:
                    grid = sms * cps
                    big = torch.empty(grid * 8192, device=dev)
                    run = lambda: driver.launch(fn, (grid,), 128, 0, torch.cuda.current_stream().cuda_stream,  # noqa: E731
                                                [("p", t.data_ptr()) for t in args] + [("p", big.data_ptr())])
                    row[f"ns_per_tile_{cps}_ctas_per_sm"] = round(launch_ms(run, a.reps) * 1e6 / a.iters, 1)
            res["rows"].append(row)
            print(row, flush=True)
    save(res, a.out)
    if a.probe:
        torch.save(probes, a.probe)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def emulate(codes: torch.Tensor, b8: torch.Tensor, mode: int, pret: bool = False) -> torch.Tensor:
    """MODES 1, 2 of output_phase.cu in the kernel's own index arithmetic, on the CPU: each thread's words, their
    transposes and plane masks as A registers (row 16w + g (+ 8), k 4q + i (+ 16)), B read through q8_at, the
    accumulators d[4j + e] (row g + 8·(e >> 1), column 8j + 2q + (e & 1)) folded as the kernel folds them, stored
    as it stores them: [512 channels, 16 rows] in the kernel's units (before its 512 of e4m3). With `pret` it reads
    each thread's transposed words from the PRET=1 tile (`pretransposed(codes)`) at the kernel's slot instead."""
    words = codes.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [64 tokens, 64 words]
    tile = pretransposed(codes).view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [word, slot, b]
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)

    def val(byte: int) -> float:
        return float(e4m3[byte]) if mode == 1 else float(byte)

    def plane(x: int, p: int) -> int:
        if mode == 1:
            return x & 0x0F0F0F0F if p == 0 else (x >> 4) & 0x0F0F0F0F
        return x & ((0xF << (4 * p)) * 0x01010101)

    def b_at(grp: int, s: int, k: int, n: int) -> float:
        return val(int(b8[grp, s, (k >> 4) * 512 + (n >> 3) * 128 + (n & 7) * 16 + (k & 15)]))

    out = torch.zeros(512, BM, dtype=torch.float64)
    for h in range(2):
        for p in range(2):
            for e in range(2):
                grp = 2 * p + h
                d = torch.zeros(64, 32, dtype=torch.float64)  # the M block's accumulator, [row, column]
                for w in range(4):
                    for g in range(8):
                        word = 8 * w + g + 32 * h
                        for q in range(4):
                            for s in range(2):
                                for u in range(2):
                                    if pret:
                                        slot = (8 * s + 4 * u + q) ^ (4 * (word & 1))
                                        r = [int(tile[word, slot, b]) for b in range(4)]
                                    else:
                                        ws = [int(words[32 * s + 16 * u + 4 * q + i, word]) for i in range(4)]
                                        r = [sum(((ws[i] >> (8 * b)) & 255) << (8 * i) for i in range(4)) for b in range(4)]
                                    for hi8 in range(2):
                                        reg = plane(r[2 * e + hi8], p)
                                        row = 16 * w + g + 8 * hi8
                                        for i in range(4):
                                            a = val((reg >> (8 * i)) & 255)
                                            k = 16 * u + 4 * q + i
                                            for n in range(32):
                                                d[row, n] += a * b_at(grp, s, k, n)
                for row in range(64):
                    w, g, hi8 = row // 16, row % 8, (row % 16) // 8
                    ch = 256 * p + 4 * (8 * w + g + 32 * h) + 2 * e + hi8
                    for n in range(16):
                        v = d[row, n] + d[row, 16 + n] if mode == 1 else (d[row, n] * 256 + d[row, 16 + n]) / (256 * 16 ** p)
                        out[ch, n] = v
    return out
