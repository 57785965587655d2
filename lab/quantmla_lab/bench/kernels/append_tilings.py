"""The append kernel's tilings side by side: how long does writing a decode step's tokens (or a prefill chunk's)
into one layer's pages take, for each cache format and each (warps, paths apart) tiling?

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.kernels.append_tilings --out /tmp/append_tilings.json

One figure a (format, tokens, tiling): ``graph_us``, the median wall time of a CUDA graph that appends to
``--layers`` layers' pages in turn, as a decode step's graph does, over the layers (a launch and the kernel: what a
step pays). Tiling "default" passes no knob, so the command also times a tree whose ``append_to_pages`` has none.
Every tiling is checked bit-exact against the reference writer (``cache.paged.write_tokens``) before it is timed.
On the CPU (``TRITON_INTERPRET=1``) it runs the checks and an untimed call of each tiling: a smoke run.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from quantmla.cache.layout import PageLayout, TokenLayout
from quantmla.cache.paged import write_tokens
from quantmla.kernels import api
from quantmla_lab.bench.common import parse_fresh, record, save
from quantmla_lab.bench.kernels.decode_speed import D_C, D_R, METHODS, PAGE
from quantmla_lab.bench.kernels.timing import capture_graph

TILINGS = ("default", "4:0", "1:0", "1:1", "2:0", "2:1", "4:1")  # warps:paths apart; "default": no knob passed


def parse_tiling(s: str) -> tuple[int | None, bool | None]:
    if s == "default":
        return None, None
    w, _, apart = s.partition(":")
    if w not in ("1", "2", "4", "8") or apart not in ("0", "1"):
        raise SystemExit(f"--tilings {s!r}: write WARPS:APART with WARPS 1, 2, 4 or 8 and APART 0 or 1, e.g. 1:1 "
                         "(one warp, the paths in programs apart), or default")
    return int(w), apart == "1"


def inputs(layout: PageLayout, T: int, layers: int, dev: str, seed: int = 0):
    """`layers` page tensors of T scattered tokens' worth of pages, the tokens' slots and values."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n_pages = layout.pages_for(T) * 2
    pages = [torch.zeros(n_pages, layout.page_bytes, dtype=torch.uint8, device=dev) for _ in range(layers)]
    slots = torch.randperm(n_pages * PAGE, generator=g)[:T].to(dev)
    x = (torch.randn(T, D_C, generator=g) * 3).to(torch.bfloat16).to(dev)
    r = (torch.randn(T, D_R, generator=g) * 20).to(torch.bfloat16).to(dev)
    return pages, slots, x, r


def time_graph(fn, reps: int) -> float:
    """Median wall ms of one replay of fn captured as a CUDA graph (L2 not emptied: a step's appends read what the
    kernels before them wrote)."""
    g = capture_graph(fn)
    for _ in range(5):
        g.replay()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in evs:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in evs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["bf16", "fp8", "int4/int4", "int2/int4"], choices=list(METHODS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 8, 16, 128, 8192])
    p.add_argument("--tilings", nargs="+", default=list(TILINGS), metavar="WARPS:APART")
    p.add_argument("--layers", type=int, default=27, help="appends a replay makes, one a layer (default 27)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", default=None)
    a = parse_fresh(p) if argv is None else p.parse_args(argv)
    tilings = [parse_tiling(t) for t in a.tilings]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1 (without it append_to_pages is the reference writer)")
    layouts = {m: PageLayout(TokenLayout(D_C, D_R, METHODS[m]), PAGE) for m in a.methods}
    staged = [m for m, lay in layouts.items() if lay.token.fmt.rope.per_page]
    if staged:
        raise SystemExit(f"{', '.join(staged)}: a RoPE path grouped per page is written with a stage; not timed here")
    layers = a.layers if dev == "cuda" else 1
    res = record(layers=layers, reps=a.reps, how="graph_us: median replay wall time / layers", rows=[])
    for m, layout in layouts.items():
        for T in a.tokens:
            pages, slots, x, r = inputs(layout, T, layers, dev)
            want = pages[0].clone()
            write_tokens(want, layout, slots, x.float(), r.float())
            for w, apart in tilings:
                knobs = {} if w is None else {"num_warps": w, "paths_apart": apart}
                got = torch.zeros_like(want)
                api.append_to_pages(got, layout, slots, x, r, **knobs)
                if not torch.equal(got, want):
                    raise SystemExit(f"{m}, {T} tokens, tiling {knobs or 'default'}: the pages differ from the "
                                     "reference writer's")
                tiling = getattr(api, "append_tiling", None)  # (a library without the knobs times "default" only)
                block_t, warps, apart_used = tiling(layout, T, None, w, apart) if tiling else (None, None, None)
                row = {"method": m, "tokens": T, "tiling": "default" if w is None else "given", "block_t": block_t,
                       "warps": warps, "paths_apart": apart_used}
                if dev == "cuda":

                    def step(knobs=knobs, pages=pages, layout=layout, slots=slots, x=x, r=r):
                        for pg in pages:
                            api.append_to_pages(pg, layout, slots, x, r, **knobs)

                    row["graph_us"] = round(1e3 * time_graph(step, a.reps) / layers, 3)
                    print(f"{m:10s} {T:5d} tokens  tiling {knobs or 'default'!s:40s} {row['graph_us']:7.2f} us",
                          flush=True)
                res["rows"].append(row)
    save(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
