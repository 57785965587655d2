"""The e4m3 scores design's operand layout on the GPU (e4m3_scores.cu; the design itself is measured slower on sm_90,
where mma.sync on e4m3 is conversions and fp16 products: docs/decode_designs.md): a 16-token tile's scores from the
cache's packed 2- or 4-bit codes read straight into e4m3 A operands (a shift and an AND for four codes) and the query as
1 to 3 e4m3 terms, on mma.sync m16n8k32. Checks the operand layouts (the kernel against fp64 products of the same e4m3
terms: fp32 rounding only, or a layout is wrong) and measures what the query's terms cost against fp64 scores.

    python -m quantmla_lab.bench.kernels.e4m3_scores --out out/e4m3_scores_h200.json

(on the H200: `kernel_designs_on_h200.sh e4m3-scores`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from quantmla.kernels.cuda import build, driver
from quantmla_lab.bench.common import parse_fresh, save
from quantmla_lab.bench.kernels.decode_speed import source_commit

SOURCE = Path(__file__).with_name("e4m3_scores.cu")
E4M3_MAX = 448.0
ROWS = TOKENS = 16


def pack_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [T, D] of `bits` bits -> the cache's planar packing [T, D·bits/8]: byte j holds channel
    j + k·NB in bits [k·bits, (k + 1)·bits)."""
    T, D = codes.shape
    nb = D * bits // 8
    out = torch.zeros(T, nb, dtype=torch.int32)
    for k in range(8 // bits):
        out |= codes[:, k * nb:(k + 1) * nb].to(torch.int32) << (k * bits)
    return out.to(torch.uint8)


def query_terms(q: torch.Tensor, n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """q fp64 [R, D] -> (n e4m3 tensors [R, D], each the rounded remainder of the ones before, of q·f; f [R, 1])."""
    f = E4M3_MAX / q.abs().amax(-1, keepdim=True)
    y, terms, acc = q * f, [], torch.zeros_like(q)
    for _ in range(n):
        t = (y - acc).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        terms.append(t)
        acc = acc + t.double()
    return terms, f


def cubin(bits: int, d: int, nq: int, tmp: Path) -> Path:
    out = tmp / f"e4m3_scores_{bits}_{d}_{nq}.cubin"
    subprocess.run([build.nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                    f"-DBITS={bits}", f"-DD={d}", f"-DNQ={nq}", "-o", str(out), str(SOURCE)], check=True, capture_output=True)
    return out


def run_case(bits: int, d: int, nq: int, seed: int, tmp: Path) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (TOKENS, d), generator=g, dtype=torch.uint8)
    q = torch.randn(ROWS, d, generator=g, dtype=torch.float64).bfloat16().double()
    terms, f = query_terms(q, nq)
    qbytes = torch.stack([t.view(torch.uint8) for t in terms]).contiguous().to(dev)  # [NQ, R, D]
    packed = pack_planes(codes, bits).contiguous().to(dev)
    out = torch.full((TOKENS, ROWS), float("nan"), device=dev)  # poisoned: every element must be written
    fn = driver.function(cubin(bits, d, nq, tmp), "e4m3_scores", 0, dev)
    driver.launch(fn, (1,), 32, 0, torch.cuda.current_stream().cuda_stream,
                  [("p", packed.data_ptr()), ("p", qbytes.data_ptr()), ("p", out.data_ptr())])
    torch.cuda.synchronize()
    got = out.double().cpu() * 2.0**9 / f.T  # [T, R]: undo the codes' 2^-9 and the query's factor
    c = codes.double()
    same_terms = c @ (sum(t.double() for t in terms) / f).T  # what the products must give, in fp64
    exact = c @ q.T
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    return {"bits": bits, "channels": d, "query_terms": nq, "finite": bool(torch.isfinite(got).all()),
            "vs_same_terms_fp64": rel(got, same_terms), "vs_fp64_scores": rel(got, exact),
            "terms_alone_vs_fp64": rel(same_terms, exact)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--channels", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = parse_fresh(ap)
    res = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": source_commit(),
        "command": " ".join(["python -m quantmla_lab.bench.kernels.e4m3_scores", *sys.argv[1:]]), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for bits in (4, 2):
            for nq in (1, 2, 3):
                r = run_case(bits, a.channels, nq, a.seed, Path(tmp))
                r["layout_ok"] = r["finite"] and r["vs_same_terms_fp64"] < 1e-5
                res["rows"].append(r)
                print(json.dumps(r), flush=True)
    save(res, a.out)
    if not all(r["layout_ok"] for r in res["rows"]):
        sys.exit("an operand layout is wrong: the kernel's scores differ from the fp64 products of the same terms")


if __name__ == "__main__":
    main()
