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


def query_channel(K: int, k: int) -> int:
    """The latent (0-511) or RoPE (512-575) channel that column k (0-15) of the scores' k-step K (0-35) holds in the
    query block, as the A operands take a token's codes (tm64_ops.cuh's query_channel, its twin): content k-step K is
    plane K % 2 of word (K // 2) % 4 of 16-byte load K // 8 (of the thread's t), k 2t, 2t + 1 its bytes 0 and 2,
    k 2t + 8, 2t + 9 its bytes 1 and 3; byte c's plane p is channel c + 256p (RoPE: 8 bytes a thread, channel
    512 + c + 32p)."""
    t, e, odd = (k & 7) >> 1, k & 1, k >> 3
    if K < 32:
        return 16 * (4 * (K >> 3) + t) + 4 * ((K >> 1) & 3) + odd + 2 * e + 256 * (K & 1)
    return 512 + 8 * t + 4 * ((K - 32) >> 1) + odd + 2 * e + 32 * (K & 1)


def smem_bytes(dqa: int = 0) -> int:
    """The kernel's dynamic shared memory (its SM_L + 256, plus the chunks' 1024-byte alignment): the query block and
    its sums (10 chunks), two P buffers of 5 chunks (DQA: 1), the raw stages (3; DQA: 5), the barriers, the flags and
    EXACT's row maxima, factors and sums (1792 bytes)."""
    stages = 5 if dqa else 3
    return 10 * CHUNK + 2 * (1 if dqa else 5) * CHUNK + stages * RAW_BYTES + 8 * stages + 16 + 1792 + 1024


MACROS = ("DQA", "EXACT", "SW", "ZL", "ONE_ACC", "OUT_WAIT", "REGS_S", "SG", "SKIP_QK", "SKIP_PV", "SKIP_COPY")
DEFAULT_BUILDS = ["DQA=1,ZL=0,OUT_WAIT=0,SG=2,REGS_S=152", "ZL=1,ONE_ACC=1,OUT_WAIT=0,REGS_S=152",
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


def swizzled(chunks: torch.Tensor) -> torch.Tensor:
    """[c, 64 rows, 64] fp16 -> the bytes of c chunks in the 128-byte swizzle (16-byte unit j of row r at
    r·128 + ((j ^ (r % 8)) << 4)), as wgmma.cuh's swz lays them."""
    c = chunks.shape[0]
    units = chunks.contiguous().view(torch.uint8).view(c, 64, 8, 16)
    out = torch.empty_like(units)
    r = torch.arange(64).view(64, 1)
    out[:, r, torch.arange(8).view(1, 8) ^ (r % 8)] = units
    return out.reshape(-1)


def check_layouts(tmp: Path, seed: int = 0, natural_q: bool = False, natural_p: bool = False, tiles: int = 1,
                  q_scale: float = 1.0) -> dict:
    """The DQA build's one tile (CHECK=1: ITERS 1, one CTA) against fp64: its scores Sᵀ[64 tokens, 64 rows] and its output
    Oᵀ[512 channels, 64 rows] with P = 2^S (each row's reference 0) from random codes, metadata and query; relative
    errors (Frobenius). Checks the query block's channel order, P's token order and both products' layouts. The
    negative controls: `natural_q` stores the query in channel order (the scores' error must be large), `natural_p`
    builds the kernel with P's rows in token order (P_NATURAL=1: the output's error must be large). With `tiles` > 1
    the EXACT build reads that many pages of random codes and gives the attention of its 64 rows over all their tokens
    (each row's reference moved to its exact maximum, the output divided by Σ P): `output_rel_err` is then O's against
    fp64 softmax attention, `scores_rel_err` the last tile's scores'; `q_scale` widens the scores so that the
    references move past their slack of 2^8 on later tiles."""
    g = torch.Generator().manual_seed(seed)
    T = 64 * tiles
    cc = torch.randint(0, 256, (T, 256), generator=g, dtype=torch.uint8)
    rc = torch.randint(0, 256, (T, 32), generator=g, dtype=torch.uint8)
    cm = torch.stack([0.02 + 0.06 * torch.rand(T, 4, generator=g), -0.5 + 0.2 * torch.rand(T, 4, generator=g)], -1)
    rm = torch.stack([0.02 + 0.06 * torch.rand(T, generator=g), -0.5 + 0.2 * torch.rand(T, generator=g)], -1)
    cm, rm = cm.to(torch.float16), rm.to(torch.float16)  # [T, 4, (scale, zero)], [T, (scale, zero)]
    q = ((torch.rand(64, 576, generator=g) - 0.5) * q_scale).to(torch.float16)
    ch = torch.arange(512)
    codes = ((cc[:, ch % 256].to(torch.int64) >> (4 * (ch // 256))) & 15).double()  # [tokens, 512]
    val_c = codes * cm[:, ch // 128, 0].double() + cm[:, ch // 128, 1].double()
    rch = torch.arange(64)
    rcodes = ((rc[:, rch % 32].to(torch.int64) >> (4 * (rch // 32))) & 15).double()
    val_r = rcodes * rm[:, 0:1].double() + rm[:, 1:2].double()
    vals = torch.cat([val_c, val_r], 1).to(torch.float16).double()  # code·scale + zero, rounded once: [T, 576]
    order = torch.arange(576) if natural_q else torch.tensor([query_channel(K, k) for K in range(36) for k in range(16)])
    qblock = swizzled(q[:, order].view(64, 9, 64).transpose(0, 1))
    pages = [torch.cat([cc[i:i + 64].reshape(-1), rc[i:i + 64].reshape(-1), cm[i:i + 64].view(torch.uint8).reshape(-1),
                        rm[i:i + 64].view(torch.uint8).reshape(-1)]) for i in range(0, T, 64)]
    assert all(pg.numel() == RAW_BYTES for pg in pages)
    dev = torch.device("cuda")
    macros = {"DQA": 1, "ZL": 0, "OUT_WAIT": 0, "SG": 2, "REGS_S": 136, "CHECK": 1} | ({"P_NATURAL": 1} if natural_p else {})
    macros |= {"EXACT": 1} if tiles > 1 else {}
    path, _ = cubin(macros, tiles, tmp, pages=tiles)  # CTA 0 reads page i as tile i
    buf = torch.cat(pages + [qblock]).to(dev)
    out = torch.full((NT * 128,), float("nan"), device=dev)
    smem = smem_bytes(1)
    fn = driver.function(path, "tokens_m_64", smem, dev)
    driver.launch(fn, (1,), NT, smem, torch.cuda.current_stream().cuda_stream, [("p", buf.data_ptr()), ("p", out.data_ptr())])
    torch.cuda.synchronize()
    got = out.view(NT, 128).double().cpu()
    s_all = vals @ q.double().T  # [T, rows]
    s_ref = s_all[-64:]  # the last tile's (the one the scores' accumulators hold)
    if tiles == 1:
        p_ref = torch.exp2(s_ref).to(torch.float16).double()
        o_ref = vals[:, :512].T @ p_ref  # [channels, rows]
    else:
        w_ = torch.exp2(s_all - s_all.max(0).values)
        o_ref = vals[:, :512].T @ (w_ / w_.sum(0))  # softmax attention, base 2: [channels, rows]
    s_got, o_got = torch.full_like(s_ref, float("nan")), torch.full_like(o_ref, float("nan"))
    for tid in range(NT):
        w, g_, t = (tid >> 5) & 3, (tid & 31) >> 2, tid & 3
        for i in range(128 if tid >= 128 else 32):
            mb, j, e = i >> 5, (i & 31) >> 2, i & 3
            n = 8 * j + 2 * t + (e & 1)
            if tid < 128:
                s_got[16 * w + g_ + 8 * (e >> 1), n] = got[tid, i]
            else:
                o, p, z = (tid >> 7) - 1, mb >> 1, mb & 1
                o_got[256 * p + 128 * o + 32 * w + 4 * g_ + 2 * z + (e >> 1), n] = got[tid, i]
    rel = lambda a, b: float((a - b).norm() / b.norm())
    return {"scores_rel_err": rel(s_got, s_ref), "output_rel_err": rel(o_got, o_ref),
            "all_written": bool(torch.isfinite(s_got).all() and torch.isfinite(o_got).all())}


def heads_m_rows() -> list[dict]:
    """The shipped heads-as-M kernel at 128 heads, 32 x 8192 (64 tiles a CTA): BF16 and INT4/INT4 calls, µs a tile."""
    from quantmla.cache.layout import PageLayout, TokenLayout, preset
    from quantmla.kernels import api
    from quantmla_lab.bench.kernels import decode_speed, timing

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

        ms, graphed = timing.time_ms(fn, 10, 50)
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
    p.add_argument("--check", action="store_true", help="first check the DQA build's layouts on one tile against fp64")
    p.add_argument("--out", default=None)
    a = parse_fresh(p) if argv is None else p.parse_args(argv)
    builds = [parse_build(b) for b in a.builds]
    if build.nvcc() is None:
        raise SystemExit("no nvcc: install the CUDA toolkit (or set CUDA_HOME)")
    gpu = torch.cuda.is_available() and not a.build_only
    res = record(iters=a.iters, pages=a.pages, rows=[])
    with tempfile.TemporaryDirectory() as tmp:
        if a.check and gpu:  # the layouts, two seeds, then the two negative controls (their errors must be large)
            res["layout_check"] = {"seed_0": check_layouts(Path(tmp), 0), "seed_1": check_layouts(Path(tmp), 1),
                                   "query_in_channel_order": check_layouts(Path(tmp), 0, natural_q=True),
                                   "p_in_token_order": check_layouts(Path(tmp), 0, natural_p=True),
                                   "exact_8_tiles": check_layouts(Path(tmp), 0, tiles=8, q_scale=1.0),
                                   "exact_8_tiles_moving": check_layouts(Path(tmp), 2, tiles=8, q_scale=16.0)}
            print("layout check:", res["layout_check"], flush=True)
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
