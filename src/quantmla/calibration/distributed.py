"""Parallel streamed calibration across processes and GPUs (torch.distributed).

Each layer's transforms depend only on that layer's full-precision inputs, and those come from
running all previous layers. So one rank streams the full-precision forward and the others fit:

    rank 0:   embeddings -> layer 0 -> layer 1 -> ...   (load a layer, run the calibration tokens
              through it, capture what its MLA modules see; send the captured data to the layer's
              owner; free the layer)
    rank r:   for each layer it owns: receive the captured data, load only that layer's attention
              weights, fit (seed = base seed + cache slot), fuse, write the layer's shard (its
              other tensors copied from the source) and done-marker.

Layers are assigned round-robin over the ranks (rank 0 included unless ``streamer_fits=False``).
The captured data is exactly what the single-process run fits on, and each fit is seeded per
layer, so the output is bit-identical to a single-process run (same devices and thread counts).
Sends are blocking: when every fitting rank is busy, rank 0 waits (bounded memory).

Resuming works as in :mod:`quantmla.calibration.stream`: rank 0 reads the markers of the shared
output directory, broadcasts the layers still to do, and restarts its forward from the newest
activation checkpoint. The output directory must be visible to every rank (one host, or a shared
file system).

Launch with torchrun (``torchrun --nproc-per-node 8 -m quantmla.calibration.stream_command ...``),
with :func:`launch_local` (spawns processes on this host), or call
:func:`calibrate_streamed_distributed` on every rank after ``init_process_group``. Backends: gloo on
CPU, NCCL on GPUs (each rank computes on ``cuda:<local rank>``).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from quantmla.cache.config import QuantCacheConfig
from quantmla.calibration.stream.memory import nbytes_of, reset_peak_rss, to_device
from quantmla.calibration.stream.run import Streamer, _stream_layers
from quantmla.calibration.stream.state import LayerStats, StreamReport
from quantmla.errors import QuantMLAError


def assign_layers(layers: list[int], world: int, streamer_fits: bool = True) -> dict[int, int]:
    """Layer -> rank, round-robin over the fitting ranks (1 .. world−1 when rank 0 only streams)."""
    ranks = list(range(world)) if (streamer_fits or world == 1) else list(range(1, world))
    return {layer: ranks[k % len(ranks)] for k, layer in enumerate(sorted(layers))}


def _comm_device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bcast(obj: Any, device: torch.device) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def calibrate_streamed_distributed(
    source,
    output,
    calib_ids: torch.Tensor,
    quant: QuantCacheConfig | None = None,
    *,
    method: str = "quantmla",
    seed: int = 0,
    batch_size: int = 4,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    activations: str = "memory",
    checkpoint_every: int = 1,
    fit_fn=None,
    fit_kwargs: dict | None = None,
    attn_implementation: str | None = None,
    checksum: bool = False,
    overwrite: bool = False,
    streamer_fits: bool = True,
    progress: Callable[[LayerStats], None] | None = None,
    _fault: Callable[[str, int], None] | None = None,
) -> StreamReport:
    """Streamed calibration over the default process group; call on every rank with the same
    arguments. Returns rank 0's report with every rank's per-layer stats (other ranks: their own).
    Arguments as :func:`quantmla.calibration.stream.calibrate_streamed`; `device` defaults to
    ``cuda:<local rank>`` under NCCL, else the CPU."""
    if not dist.is_available() or not dist.is_initialized():
        raise QuantMLAError("calibrate_streamed_distributed needs torch.distributed initialized (torchrun, or launch_local)")
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    cdev = _comm_device(backend)
    quant = quant or QuantCacheConfig()
    kw = dict(method=method, seed=seed, batch_size=batch_size, dtype=dtype, device=device, activations=activations,
              checkpoint_every=checkpoint_every, fit_fn=fit_fn, fit_kwargs=fit_kwargs,
              attn_implementation=attn_implementation, checksum=checksum, overwrite=overwrite)

    # rank 0 prepares (or validates, when resuming) the output directory first
    err = work = None
    st = None
    if rank == 0:
        try:
            st = Streamer(source, output, calib_ids, quant, prepare=True, **kw)
            work = st.state.output  # the output directory, or the staging one that replaces it
        except Exception as e:  # noqa: BLE001 (re-raised on every rank below)
            err = f"{type(e).__name__}: {e}"
    err, work = _bcast((err, work), cdev)
    if err is not None:
        raise QuantMLAError(f"rank 0 could not start the streamed calibration: {err}")
    if rank != 0:
        kw["overwrite"] = False
        st = Streamer(source, output, calib_ids, quant, prepare=False, work_dir=work, **kw)
    st.fault = _fault
    st.show_progress = st.fitter.show_progress = progress is not None and rank == 0

    plan = None
    if rank == 0:
        st.write_raw_units()
        done = st.done_layers()
        need = [i for i in range(st.L) if i not in done]
        fit_layers = [i for i in need if st.skel.mla_submodules(st.skel.layer_module(i))]
        owners = assign_layers(fit_layers, world, streamer_fits)
        plan = {"need": need, "owners": owners, "done": sorted(done)}
    plan = _bcast(plan, cdev)
    need, owners = plan["need"], plan["owners"]
    st.report.skipped = plan["done"]

    def owner(i: int) -> int:
        return owners.get(i, 0)  # layers without MLA (nothing to fit) are written by rank 0

    if rank == 0:
        if need:
            def send(i: int, captured: dict) -> None:  # as CPU tensors: each owner moves them to its own device
                dist.send_object_list([{"layer": i, "captured": to_device(captured, "cpu")}], dst=owner(i), device=cdev)

            _stream_layers(st, need, owner=owner, rank=0, send=send, progress=progress)
    else:
        for i in sorted(layer for layer, r in owners.items() if r == rank):
            box = [None]
            t_wait = time.perf_counter()
            dist.recv_object_list(box, src=0, device=cdev)
            msg = box[0]
            if msg["layer"] != i:
                raise QuantMLAError(f"rank {rank} expected layer {i}, received layer {msg['layer']}")
            cap_bytes = nbytes_of(msg["captured"])
            reset_peak_rss()
            t0 = time.perf_counter()
            mods, nbytes = st.skel.materialize_attention(i)
            t1 = time.perf_counter()
            fused, info = st.fit_modules(mods, msg["captured"], st.ckpt.layer_key(i), st.skel.layer_module(i))
            t2 = time.perf_counter()
            st.write_layer(i, fused, {"fit": info, "slots": list(mods), "rank": rank})
            t3 = time.perf_counter()
            del msg, fused
            for _, (_, m) in mods.items():
                m.to_empty(device="meta")
            st.meter.sub(nbytes)
            stats = st.stats(i, mods, nbytes, load_s=t1 - t0, forward_s=0.0, fit_s=t2 - t1, write_s=t3 - t2, rank=rank,
                             wait_s=t0 - t_wait, captured_bytes=cap_bytes)
            st.report.layers.append(stats)
            if progress is not None:
                progress(stats)

    # every layer written: rank 0 collects the stats and finalizes
    gathered = [None] * world if rank == 0 else None
    peak_rss = max([st.close_report().peak_rss_bytes] + [s.peak_rss_bytes for s in st.report.layers])
    dist.gather_object(
        {"layers": st.report.layers, "peak_live": st.meter.peak, "peak_rss": peak_rss,
         "start_rss": st.report.start_rss_bytes},
        gathered, dst=0,
    )
    err = None
    if rank == 0:
        try:
            st.finalize()
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        rep = st.close_report()
        rep.layers = sorted((s for g in gathered for s in g["layers"]), key=lambda s: (s.layer, s.rank))
        rep.peak_live_weight_bytes = max(g["peak_live"] for g in gathered)
        rep.per_rank = [{"rank": r, "peak_live_weight_bytes": g["peak_live"], "peak_rss_bytes": g["peak_rss"],
                         "start_rss_bytes": g["start_rss"]} for r, g in enumerate(gathered)]
    err = _bcast(err, cdev)
    if err is not None:
        raise QuantMLAError(f"finalizing the streamed calibration failed on rank 0: {err}")
    dist.barrier()
    return st.close_report() if rank != 0 else rep


# ------------------------------------------------------------------------------------------------
# local launcher (tests, single host without torchrun)
# ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, threads: int | None, timeout_s: float,
            fn: Callable, args: tuple, kwargs: dict, result_file: str) -> None:
    if threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        out = fn(*args, **kwargs)
        if rank == 0:
            torch.save(out, result_file + ".tmp")
            os.replace(result_file + ".tmp", result_file)
    finally:
        dist.destroy_process_group()


def launch_local(fn: Callable, world_size: int, *args, backend: str = "gloo", threads: int | None = None,
                 timeout_s: float = 7200.0, **kwargs) -> Any:
    """Run ``fn(*args, **kwargs)`` on `world_size` spawned processes of this host (loopback
    rendezvous), each in an initialized process group; returns rank 0's result. `fn` must be
    importable (module level). `threads`: torch threads per process."""
    import tempfile

    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="quantmla-launch-") as tmp:
        result_file = os.path.join(tmp, "result.pt")
        mp.start_processes(_worker, args=(world_size, port, backend, threads, timeout_s, fn, args, kwargs, result_file),
                           nprocs=world_size, join=True, start_method="spawn")
        return torch.load(result_file, weights_only=False) if os.path.exists(result_file) else None


def _call_to_file(fn: Callable, args: tuple, kwargs: dict, result_file: str, threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    out = fn(*args, **kwargs)
    torch.save(out, result_file + ".tmp")
    os.replace(result_file + ".tmp", result_file)


def spawn_call(fn: Callable, *args, threads: int | None = None, **kwargs) -> tuple[int, Any]:
    """Run ``fn(*args, **kwargs)`` in a fresh spawned process (clean memory accounting, or a run
    that may be killed); -> (exit code, result or None)."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="quantmla-call-") as tmp:
        result_file = os.path.join(tmp, "result.pt")
        p = ctx.Process(target=_call_to_file, args=(fn, args, kwargs, result_file, threads))
        p.start()
        p.join()
        out = torch.load(result_file, weights_only=False) if os.path.exists(result_file) else None
        return p.exitcode, out


def rank_summary(report: StreamReport) -> str:
    per = getattr(report, "per_rank", None) or []
    gb = 1 << 30
    lines = [report.summary()]
    for p in per:
        lines.append(f"  rank {p['rank']}: peak live weights {p['peak_live_weight_bytes'] / gb:.3f} GiB, "
                     f"peak RSS {p['peak_rss_bytes'] / gb:.3f} GiB (start {p['start_rss_bytes'] / gb:.3f})")
    return "\n".join(lines)


__all__ = ["assign_layers", "calibrate_streamed_distributed", "launch_local", "free_port", "rank_summary", "spawn_call"]
