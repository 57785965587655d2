"""One decode call of the API's default kernel, for a profiler to attach to (Nsight Compute).

    ncu --clock-control none -k regex:mla_decode -c 1 -s 2 --section WarpStateStats \\
        python3 -m quantmla_lab.bench.kernels.decode_once int4/int4 16 32 16384

Arguments: cache format, heads, batch, context; `--tokens-m` runs the kernel with tokens as the MMA's M dimension
(`--specialized`: its scores' and output's warps apart). Three calls run (the profiler skips two with -s 2);
the pages are in random order and written by the append kernel, as in decode_speed.
"""

from __future__ import annotations

import argparse

import torch

from quantmla.cache.layout import PageLayout, TokenLayout, preset
from quantmla.kernels import api
from quantmla_lab.bench.kernels import decode_speed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("format", help="a cache format name: bf16, fp8, int4/int4, int2/int4, ...")
    ap.add_argument("heads", type=int)
    ap.add_argument("batch", type=int)
    ap.add_argument("context", type=int)
    ap.add_argument("--tokens-m", action="store_true", help="the CUDA kernel with tokens as the MMA's M dimension")
    ap.add_argument("--specialized", action="store_true", help="with --tokens-m: its scores' and output's warps apart")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_once needs a CUDA GPU")
    lay = PageLayout(TokenLayout(512, 64, preset(a.format)), 64)
    c = decode_speed.Cache(lay, [a.context] * a.batch, seed=1, device="cuda")
    qc = torch.randn(a.batch, a.heads, 512, device="cuda").to(torch.bfloat16)
    qr = torch.randn(a.batch, a.heads, 64, device="cuda").to(torch.bfloat16)
    cfg = None
    if a.tokens_m:
        from quantmla.kernels.schedule import cuda_config

        cfg = cuda_config(a.heads, lay, "cuda", tokens_m=True, specialized=a.specialized)
        if cfg is None:
            raise SystemExit(f"no tokens-as-M plan for {a.format} at {a.heads} heads")
    md = api.get_mla_metadata(c.seq_lens, a.heads, 1, lay, config=cfg)
    for _ in range(3):
        api.mla_decode_with_kvcache(qc, qr, c.pages, c.block_table, c.seq_lens, lay, 0.07, metadata=md)
    torch.cuda.synchronize()
    print(md.variant, md.num_units)


if __name__ == "__main__":
    main()
