"""How long a CUDA-graph decode step's wave of work units is, by how the bucket deals them out: "rows" (S splits to
every row of the bucket, padded rows too) against "length" (the bucket's b·S units dealt to the real sequences by
length, ``serving.triton_backend.bucket_schedule``). No GPU: the schedules are the engine's own, and the figure is
the wave's critical path, the key tiles of its longest unit (every unit of a bucket runs in one wave).

For each real batch (padded to the engine's graph bucket) and each job's contexts (per sequence: a prompt length
drawn from the job's range plus the tokens generated so far, drawn from its output range), the median over draws of:
the longest unit's tiles under each policy, their ratio, and the busy fraction of the wave (the tiles read over
units x longest unit), and the host time of one schedule (`bucket_schedule`, median µs a call: what the
engine adds to each graph step's preparation). Geometry of the H200 plan at 16 heads: 132 SMs x 2 CTAs, 64-token tiles, spans of at least
128 tokens.

    python -m quantmla_lab.bench.serving.bucket_waves --out lab/results/decode_schedule/bucket_waves_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import sys
import timeit

import numpy as np

from quantmla.serving.config import EngineConfig
from quantmla.serving.triton_backend import bucket_schedule
from quantmla_lab.bench.common import parse_fresh, save
from quantmla_lab.bench.kernels.decode_speed import source_commit

JOBS = {"long": ((16384, 24576), (1024, 1536)), "longest": ((61440, 65536), (1024, 1024)), "uniform 16K": ((16384, 16384), (0, 0))}


def wave(lens: np.ndarray, bucket: int, programs: int, min_span: int, tile: int,
         by_length: bool) -> tuple[int, float, float]:
    """(the longest unit's key tiles, busy fraction, µs a schedule) of one bucket's step: padded rows hold 1 token,
    as the engine's."""
    S = max(1, programs // bucket)
    padded = np.concatenate([lens, np.ones(bucket - len(lens), dtype=np.int64)])
    units, _ = bucket_schedule(padded, bucket * S, min_span, tile, by_length)
    us = min(timeit.repeat(lambda: bucket_schedule(padded, bucket * S, min_span, tile, by_length), number=20,
                           repeat=3)) / 20 * 1e6
    tiles = -(-(units[:, 2] - units[:, 1]) // tile)
    return int(tiles.max()), float(tiles.sum() / (len(tiles) * max(1, tiles.max()))), us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 5, 7, 8, 9, 12, 13, 16, 17, 20, 24, 28, 32])
    ap.add_argument("--programs", type=int, default=264, help="CTAs of one wave (SMs x CTAs an SM)")
    ap.add_argument("--tile", type=int, default=64)
    ap.add_argument("--min-span", type=int, default=128)
    ap.add_argument("--draws", type=int, default=50)
    ap.add_argument("--out", required=True)
    a = parse_fresh(ap)
    buckets = EngineConfig().graph_buckets
    rng = np.random.default_rng(0)
    res = {"device": "cpu (schedules only)", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": source_commit(),
        "command": " ".join(["python -m quantmla_lab.bench.serving.bucket_waves", *sys.argv[1:]]),
        "programs": a.programs, "tile": a.tile, "min_span": a.min_span, "draws": a.draws,
        "metric": "median over draws of the longest unit's key tiles (the wave's critical path), the busy fraction "
                  "and the host µs of one bucket_schedule call (best of 3 x 20 calls)",
        "rows": []}
    print(f"{'job':<12} {'batch':>5} {'bucket':>6} {'rows: tiles':>11} {'length: tiles':>13} {'ratio':>6} "
          f"{'busy rows':>9} {'busy length':>11} {'host us rows':>12} {'length':>6}")
    for job, ((p0, p1), (o0, o1)) in JOBS.items():
        for b in a.batches:
            bucket = next(x for x in buckets if x >= b)
            got = {True: [], False: []}
            for _ in range(a.draws):
                lens = rng.integers(p0, p1 + 1, size=b) + rng.integers(o0, o1 + 1, size=b)
                for by_length in (False, True):
                    got[by_length].append(wave(lens, bucket, a.programs, a.min_span, a.tile, by_length))
            med = {k: [float(np.median([x[i] for x in v])) for i in range(3)] for k, v in got.items()}
            row = {"job": job, "batch": b, "bucket": bucket, "rows_tiles": med[False][0], "length_tiles": med[True][0],
                   "ratio": med[True][0] / med[False][0], "rows_busy": med[False][1], "length_busy": med[True][1],
                   "rows_host_us": med[False][2], "length_host_us": med[True][2]}
            res["rows"].append(row)
            print(f"{job:<12} {b:>5} {bucket:>6} {row['rows_tiles']:>11.0f} {row['length_tiles']:>13.0f} "
                  f"{row['ratio']:>6.2f} {row['rows_busy']:>9.2f} {row['length_busy']:>11.2f} {row['rows_host_us']:>12.1f} "
                  f"{row['length_host_us']:>6.1f}", flush=True)
    save(res, a.out)


if __name__ == "__main__":
    main()
