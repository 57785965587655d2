"""``quantmla bench-kernel``: the decode kernels on the GPU against the copy bandwidth, our BF16 kernel
and (optionally) an external BF16 MLA decode kernel, over batch × context shapes and head counts.

Every timed call is a CUDA-graph replay of one decode step (decode + combine kernels, schedule and
buffers prepared outside), timed with ``triton.testing.do_bench`` medians, which flushes the L2
between repetitions. Before timing, each (method, heads, config) is checked against the torch
reference on a small random batch; a config that fails is dropped and reported.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from quantmla.cache.layout import PRESETS, CacheFormat, PageLayout, TokenLayout, int_format
from quantmla.cache.paged import compression_report, gather_sequences, write_tokens
from quantmla.kernels import api, cuda, schedule
from quantmla.kernels.api import DecodeConfig, decode_bytes, decode_flops
from quantmla.kernels.partials import partials_setting
from quantmla.serving.rope_stage import page_grouped
from quantmla.reference.absorbed import absorbed_attention
from quantmla_lab.bench.kernels import timing
from quantmla_lab.bench.kernels.peer import load_peer, peer_indexes, peer_kv
from quantmla_lab.bench.kernels.timing import time_ms

D_C, D_R, PAGE = 512, 64, 64
METHODS: dict[str, CacheFormat] = {
    **PRESETS, "int4/int4-g64/g32": int_format(4, 4, 64, 32),
    # the RoPE path per channel per page (one fp16 scale and zero point per channel of a 64-token page), or per
    # 16-token block of it (-page16: four sets a page, the KIVI-style baseline's RoPE bytes)
    **{f"{n}-page": CacheFormat(PRESETS[n].content, page_grouped(PRESETS[n].rope)) for n in ("int4/int4", "int2/int4")},
    **{f"{n}-page16": CacheFormat(PRESETS[n].content, page_grouped(PRESETS[n].rope, 16))
       for n in ("int4/int4", "int2/int4")},
}
DEFAULT_SHAPES = {16: "1x131072,8x16384,8x65536,32x16384,64x4096,128x2048", 128: "1x32768,32x8192,64x4096"}
"""Batch x context shapes per head count: 16 heads (DeepSeek-V2-Lite) reads up to 512K tokens per call,
128 heads (DeepSeek-V3) up to 256K."""
PEER_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""The peer's num_kv_splits swept: its grid is (batch, head blocks, splits), so a lone 131072-token sequence wants 256
(the work of 8 x 16384 at 32), and 128 x 2048 at 128 heads wants 2; a best at either end is flagged in its row."""


def source_commit() -> str | None:
    """The commit the running code is from: $QUANTMLA_COMMIT (set it where the tree travels without its
    .git, as on a lent GPU machine), else `git rev-parse --short HEAD` with "+dirty" for uncommitted edits."""
    import subprocess

    import quantmla
    import quantmla_lab

    if os.environ.get("QUANTMLA_COMMIT"):
        return os.environ["QUANTMLA_COMMIT"]
    try:
        here = Path(__file__).parent
        code = [str(Path(quantmla.__file__).parent), str(Path(quantmla_lab.__file__).parent)]  # library and lab
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *code], cwd=here, capture_output=True, text=True).stdout
        return head.stdout.strip() + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def candidates(method: str, rows: int) -> list[DecodeConfig]:
    """Configs the sweep tries (the first is the API default). Chosen from register/shared-memory
    reports of offline sm_90 compiles and a first H200 run."""
    quant = method != "bf16"
    C = DecodeConfig
    layout = PageLayout(TokenLayout(D_C, D_R, METHODS[method]), PAGE)
    first = schedule.default_config(rows, layout, "cuda" if DEV == "cuda" else "cpu")
    if first.kernel == "cuda":  # the CUDA kernel (the API default), the built tile beside the tokens-as-M kernel
        # where the API picks between them by the units' lengths (FP8); RoPE pages, which the API reads on the built
        # tile by default (cuda.tokens_m_by_default, cuda.warpgroup_by_default), also on the kernels that can read
        # them when asked; then the Triton tilings
        other = [schedule.cuda_config(rows, layout, "cuda", tokens_m=False)] if first.tokens_m and cuda.is_fp8(layout) \
            else [schedule.cuda_config(rows, layout, "cuda", **kw) for kw in ({"tokens_m": True}, {"warpgroup": True})
                  if not (first.tokens_m or first.warpgroup) and layout.token.fmt.rope.per_page]
        return [first, *[o for o in other if o is not None], *_triton_candidates(method, rows, quant, C)]
    # the API's Triton default first (no device: the GPU's tiling, the generic kernel where the fused one cannot read
    # the layout), the CUDA kernel measured beside it, then the other Triton tilings
    tri = schedule.default_config(rows, layout)
    cu = schedule.cuda_config(rows, layout, "cuda") if DEV == "cuda" else None
    rest = [c for c in _triton_candidates(method, rows, quant, C) if c != tri]
    return [tri, *([cu] if cu is not None else []), *rest]


def _triton_candidates(method: str, rows: int, quant: bool, C) -> list[DecodeConfig]:
    if METHODS[method].content.mode == "fp8" and METHODS[method].content.quantized:  # the generic kernel
        if rows <= 16:
            return [
                C(block_m=16, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=2, min_chunk=128, kernel="generic"),
                C(block_m=16, block_n=64, num_warps=4, num_stages=2, ctas_per_sm=2, min_chunk=128, kernel="generic"),
                C(block_m=16, block_n=32, num_warps=4, num_stages=3, ctas_per_sm=2, min_chunk=128, kernel="generic"),
            ]
        return [
            C(block_m=64, block_n=64, num_warps=8, num_stages=1, ctas_per_sm=1, kernel="generic"),
            C(block_m=32, block_n=32, num_warps=4, num_stages=2, ctas_per_sm=1, kernel="generic"),
        ]
    if rows <= 16:
        if not quant:
            return [
                C(block_m=16, block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2, min_chunk=128),
                C(block_m=16, block_n=32, num_warps=4, num_stages=3, ctas_per_sm=2),
                C(block_m=16, block_n=64, num_warps=4, num_stages=2, ctas_per_sm=2, orient="tokens"),
                C(block_m=16, block_n=64, num_warps=4, num_stages=3, ctas_per_sm=1, orient="tokens"),
            ]
        return [
            C(block_m=16, block_n=128, num_warps=8, num_stages=2, ctas_per_sm=1, min_chunk=128),
            C(block_m=16, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=2),
            C(block_m=16, block_n=64, num_warps=4, num_stages=2, ctas_per_sm=2, orient="tokens"),
            C(block_m=16, block_n=128, num_warps=8, num_stages=2, ctas_per_sm=1, orient="tokens"),
            # fallbacks, also measured: Triton-op unpacking, and the generic dequantizing kernel
            C(block_m=16, block_n=128, num_warps=8, num_stages=2, ctas_per_sm=1, unpack="tl"),
            C(block_m=16, block_n=32, num_warps=4, num_stages=2, ctas_per_sm=2, kernel="generic"),
        ]
    c = [
        C(block_m=32, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1),
        C(block_m=32, block_n=32, num_warps=8, num_stages=2 if quant else 3, ctas_per_sm=1),
    ]
    if not quant:
        return c + [C(block_m=64, block_n=32, num_warps=8, num_stages=2, ctas_per_sm=1)]
    return c + [
        C(block_m=32, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1, unpack="tl"),
        C(block_m=32, block_n=32, num_warps=4, num_stages=2, ctas_per_sm=1, kernel="generic"),
    ]


# --------------------------------------------------------------------------------------------------
class Cache:
    """One layer's paged cache of B sequences of `lens`, pages in random order, written by the append kernel."""

    def __init__(self, layout: PageLayout, lens: list[int], seed: int, device=None, data=None):
        device = device or DEV
        self.layout, self.lens = layout, lens
        pages_per = [layout.pages_for(n) for n in lens]
        n_pages = sum(pages_per)
        g = torch.Generator(device=device).manual_seed(seed)
        self.pages = torch.empty((n_pages, layout.page_bytes), dtype=torch.uint8, device=device)
        perm = torch.randperm(n_pages, generator=g, device=device).to(torch.int32)
        width = max(pages_per + [1])
        self.block_table = torch.zeros((len(lens), width), dtype=torch.int32, device=device)
        off = 0
        for b, p in enumerate(pages_per):
            self.block_table[b, :p] = perm[off : off + p]
            off += p
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        for b, n in enumerate(lens):
            if n == 0:
                continue
            pos = torch.arange(n, device=device)
            slots = self.block_table[b].long()[pos // PAGE] * PAGE + pos % PAGE
            if data is not None:
                x, r = data(b, n)
            else:
                x = torch.randn(n, layout.token.d_c, generator=g, device=device, dtype=torch.bfloat16)
                r = torch.randn(n, layout.token.d_r, generator=g, device=device, dtype=torch.bfloat16) * 2
            if layout.token.fmt.rope.per_page:  # no append kernel: the reference writer, a page over its tokens
                bt = self.block_table[b].long()
                page_rope = {int(bt[i]): r[i * PAGE: (i + 1) * PAGE].float() for i in range(pages_per[b])}
                write_tokens(self.pages, layout, slots, x.float(), r, page_rope=page_rope)
            else:
                api.append_to_pages(self.pages, layout, slots, x, r)


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the bench's device (the CPU: smoke runs in the interpreter)


def check_config(method: str, fmt: CacheFormat, H: int, q_len: int, cfg: DecodeConfig | None, seed: int = 0) -> dict:
    """Run on a small odd-length batch with NaN-poisoned outputs; compare with the fp32 torch reference."""
    layout = PageLayout(TokenLayout(D_C, D_R, fmt), PAGE)
    lens = [1, 63, 64, 65, 777, 3001] if DEV == "cuda" else [1, 64, 65, 130]
    c = Cache(layout, lens, seed=seed)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    B = len(lens)
    qc = torch.randn(B, q_len, H, D_C, generator=g, device=DEV).to(torch.bfloat16)
    qr = torch.randn(B, q_len, H, D_R, generator=g, device=DEV).to(torch.bfloat16)
    out = torch.full((B, q_len, H, D_C), float("nan"), device=DEV, dtype=torch.bfloat16)
    lse = torch.full((B, q_len, H), float("nan"), device=DEV)
    md = api.get_mla_metadata(c.seq_lens, H, q_len, layout, config=cfg, chunk_tokens=256)
    scale = 1 / math.sqrt(192)
    api.mla_decode_with_kvcache(qc, qr, c.pages, c.block_table, c.seq_lens, layout, scale, metadata=md, out=out, lse=lse)
    lat, kr = gather_sequences(c.pages, layout, c.block_table, c.seq_lens)
    ro, rl = absorbed_attention(qc.float(), qr.float(), lat, kr, scale, c.seq_lens, compute_dtype=torch.float32)
    nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
    fin = torch.isfinite(rl)
    rel = float((out.float() - ro).norm() / ro.norm())
    lse_err = float((lse - rl)[fin].abs().max()) if fin.any() else 0.0
    ok = (not nan) and rel < 2e-2 and lse_err < 2e-2 and bool(torch.equal(torch.isinf(lse), ~fin))
    return {"ok": ok, "rel_err": rel, "lse_err": lse_err, "nan": nan, "variant": md.workspace.get("variant")}


# --------------------------------------------------------------------------------------------------
def bench_command(argv: list[str], kernel_mode: str) -> str:
    """The command line a result records, with the QUANTMLA_DECODE_KERNEL setting it ran under where that is not the
    default (a Triton-only run's command alone would rerun the CUDA kernels)."""
    env = f"QUANTMLA_DECODE_KERNEL={kernel_mode} " if kernel_mode != "auto" else ""
    return env + "quantmla bench-kernel " + " ".join(argv[2:] if argv[1:2] == ["bench-kernel"] else argv[1:])


def parse_methods(text: str) -> list[str]:
    """--methods "a,b,..." -> method names, bf16 (the baseline) first; bits the kernels cannot run
    and unknown names are a clear UnsupportedFormatError."""
    methods = [m.strip().lower() for m in text.split(",") if m.strip()]
    for m in methods:
        if m in METHODS:
            continue
        parts = m.split("/")
        bits = [p.split("-")[0].removeprefix("int") for p in parts]
        if len(parts) == 2 and all(b.isdigit() for b in bits):
            bad = [int(b) for b in bits if int(b) not in api.KERNEL_BITS + (16,)]
            if bad:
                raise api.UnsupportedFormatError(
                    f"--methods {m}: the decode kernels take {'/'.join(map(str, api.KERNEL_BITS))}-bit codes or BF16, "
                    f"not {bad[0]}-bit; choose from {', '.join(METHODS)}")
        raise api.UnsupportedFormatError(f"--methods: unknown method {m!r}; choose from {', '.join(METHODS)}")
    return ["bf16"] + [m for m in methods if m != "bf16"]  # the baseline first


def parse_shapes(text: str, flag: str) -> list[tuple[int, int]]:
    """ "BxL,BxL" -> [(B, L), ...]."""
    shapes = []
    for s in text.split(","):
        if not s.strip():
            continue
        parts = s.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise api.QuantMLAError(f"{flag}: {s.strip()!r} is not BATCHxCONTEXT; write e.g. 32x16384 (comma separated)")
        shapes.append((int(parts[0]), int(parts[1])))
    if not shapes:
        raise api.QuantMLAError(f"{flag}: no shape given; write e.g. 32x16384")
    return shapes


def run_bench(args) -> dict:
    timing.FLUSH = getattr(args, "flush", "write")
    import triton

    methods = parse_methods(args.methods)  # bad input is reported before the device is looked at
    shapes_of = {H: parse_shapes(args.shapes or DEFAULT_SHAPES.get(H, DEFAULT_SHAPES[16]), "--shapes") for H in args.heads}
    sb, sl_ = parse_shapes(args.sweep_shape, "--sweep-shape")[0]
    if DEV != "cuda" and not (getattr(args, "smoke", False) and api.interpreting()):
        raise api.QuantMLAError("bench-kernel needs a CUDA GPU (the kernels are timed on the device); "
                                "run it on a machine with an NVIDIA GPU")
    t_start = time.time()
    dev = torch.cuda.get_device_properties(0) if DEV == "cuda" else None
    heads = args.heads
    res: dict = {
        "device": dev.name if dev else "cpu (smoke, TRITON_INTERPRET=1)",
        "sms": dev.multi_processor_count if dev else 0,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": bench_command(sys.argv, cuda.mode()),
        "commit": source_commit(),
        "partials": partials_setting(),
        "decode_kernel": cuda.mode(),  # QUANTMLA_DECODE_KERNEL: "triton" times the Triton kernels alone
        "host": platform.node(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "d_c": D_C, "d_r": D_R, "page_size": PAGE, "q_len": args.q_len,
        "timing": "median over CUDA-graph replays of one decode step, L2 emptied before each by "
                  + ("reading a 256 MB buffer" if getattr(args, "flush", "write") == "read"
                     else "triton.testing.do_bench (zeroing a 256 MB buffer)"),
        "formats": {m: METHODS[m].describe() for m in methods},
    }
    log = print

    # -- ceilings: copy bandwidth (bytes read + written) and a bf16 matmul -----------------------------
    n = 1 << 31 if DEV == "cuda" else 1 << 24
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    ms, _ = time_ms(lambda: dst.copy_(src), 25, 200, graph=False)
    copy = 2 * n / (ms * 1e-3) / 1e9
    src = dst = None  # the buffers go before the matmul
    k = 8192 if DEV == "cuda" else 256
    a = torch.randn(k, k, device=DEV, dtype=torch.bfloat16)
    ms, _ = time_ms(lambda: a @ a, 25, 100, graph=False)
    mm = 2 * k**3 / (ms * 1e-3) / 1e12
    a = None
    res["copy_GBps"], res["matmul_bf16_TFLOPs"] = copy, mm
    log(f"device {res['device']} ({res['sms']} SMs); copy {copy:.0f} GB/s; bf16 matmul {mm:.0f} TFLOP/s", flush=True)

    # -- compression (allocated bytes) ---------------------------------------------------------------
    res["compression"] = [r for m in methods for r in compression_report(D_C, D_R, METHODS[m], (4096, 32768, 131072), PAGE)]

    # -- correctness gate (compiles every candidate; in parallel processes on the GPU) + config sweep
    chosen: dict[tuple, DecodeConfig] = {}
    res["checks"], res["sweep"], res["skipped"] = [], [], []  # skipped: methods asked for that no config could run
    jobs = []
    for H in heads:
        for m in methods:
            cands = candidates(m, H * args.q_len)
            for cfg in cands if not args.no_sweep else cands[:1]:
                jobs.append((m, H, args.q_len, asdict(cfg)))
    t0 = time.time()
    results = _run_checks(jobs, parallel=DEV == "cuda" and not getattr(args, "serial", False))
    log(f"checked {len(jobs)} (method, heads, config) candidates in {time.time() - t0:.0f} s", flush=True)
    for (m, H, _, cd), chk in zip(jobs, results):
        cfg = DecodeConfig(**cd)
        chk.update(method=m, heads=H, config=cfg.describe())
        res["checks"].append(chk)
        log(f"check {m:10s} H={H:3d} {cfg.describe():40s} ok={chk['ok']} rel={chk.get('rel_err', float('nan')):.2e} "
            f"{chk.get('variant') or chk.get('error', '')}", flush=True)
    for H in heads:
        for m in methods:
            layout = PageLayout(TokenLayout(D_C, D_R, METHODS[m]), PAGE)
            ok_cands = [DecodeConfig(**cd) for (mm, hh, _, cd), chk in zip(jobs, results) if mm == m and hh == H and chk["ok"]]
            if not ok_cands:
                log(f"!! no config of {m} at {H} heads passed the check; skipped", flush=True)
                res["skipped"].append({"method": m, "heads": H, "why": "no config passed the check (see checks)"})
                continue
            if len(ok_cands) == 1:
                chosen[(m, H)] = ok_cands[0]
                continue
            cache = Cache(layout, [sl_] * sb, seed=7)
            q = queries(sb, args.q_len, H)
            best = None
            for cfg in ok_cands:
                t, _, _ = time_decode(cache, q, cfg, args)
                res["sweep"].append({"method": m, "heads": H, "batch": sb, "context": sl_, "config": cfg.describe(), "ms": t * 1e3})
                log(f"sweep {m:10s} H={H:3d} {sb}x{sl_} {cfg.describe():40s} {t * 1e6:9.1f} us", flush=True)
                if best is None or t < best[0]:
                    best = (t, cfg)
            chosen[(m, H)] = best[1]
            del cache
            _empty_cache()
    res["chosen"] = {f"{m}@{H}": asdict(c) for (m, H), c in chosen.items()}

    # -- peer ----------------------------------------------------------------------------------------
    peer = None
    if args.peer:
        peer = load_peer(args.peer)
        res["peer"] = {"file": os.path.basename(args.peer), "entry": peer[1], "num_kv_splits_swept": list(PEER_SPLITS)}

    # -- the table: every format on the same tokens, side by side ------------------------------------
    rows_out = []
    bf16_layout = PageLayout(TokenLayout(D_C, D_R, METHODS["bf16"]), PAGE)
    for H in heads:
        for B, L in shapes_of[H]:
            lens = [L] * B
            q = queries(B, args.q_len, H)
            flops = decode_flops(lens, H, args.q_len, D_C, D_R)
            bf16_bytes = decode_bytes(lens, bf16_layout, H, args.q_len)
            t_bf16 = t_peer = None
            shape_rows = []
            for m in methods:
                if (m, H) not in chosen:
                    continue
                cache = Cache(PageLayout(TokenLayout(D_C, D_R, METHODS[m]), PAGE), lens, seed=B * 7 + L)
                if m == "bf16" and peer is not None and args.q_len == 1:
                    t_peer = _time_peer(peer, cache, q, H, B, L, bf16_bytes, flops, copy, shape_rows, args)
                # the API's own choice where the sweep kept its default (it may differ by the units' lengths)
                api_default = chosen[(m, H)] == candidates(m, H * args.q_len)[0]
                t, graph, ran = time_decode(cache, q, None if api_default else chosen[(m, H)], args)
                nbytes = decode_bytes(lens, cache.layout, H, args.q_len)
                if m == "bf16":
                    t_bf16 = t
                shape_rows.append(_row(H, B, L, m, t, nbytes, bf16_bytes, flops, copy, t_bf16, ran, graph))
                del cache
                _empty_cache()
            for r in shape_rows:
                # in ms, as each row stores its own time: the BF16 row's ratio is exactly 1 (s -> ms -> s is not)
                r["speedup_vs_bf16"] = t_bf16 * 1e3 / r["ms"] if t_bf16 else None
                r["speedup_vs_peer"] = t_peer * 1e3 / r["ms"] if t_peer else None
                _print_row(r)
            rows_out += shape_rows
    res["rows"] = rows_out
    res["append"] = _bench_append(methods, args)

    res["wall_s"] = time.time() - t_start
    return res


def _check_job(job) -> dict:
    m, H, q_len, cd = job
    try:
        return check_config(m, METHODS[m], H, q_len, DecodeConfig(**cd))
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}


def _run_checks(jobs: list, parallel: bool) -> list[dict]:
    """Check (and so compile) every candidate; on the GPU in spawned processes, which fills Triton's
    on-disk cache in parallel for the timing process."""
    if not parallel or len(jobs) < 2:
        return [_check_job(j) for j in jobs]
    import concurrent.futures as cf
    import multiprocessing as mp

    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1, 12))
    try:
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
            return list(ex.map(_check_job, jobs))
    except Exception as e:  # noqa: BLE001 - e.g. a broken pool: do them here
        print(f"(parallel checks failed: {type(e).__name__}: {e}; checking serially)", flush=True)
        return [_check_job(j) for j in jobs]


def _empty_cache():
    if DEV == "cuda":
        torch.cuda.empty_cache()


def queries(B, q_len, H):
    """Random bf16 queries seeded by the shape: (q_latent [B, q_len, H, d_c], q_rope [B, q_len, H, d_r])."""
    g = torch.Generator(device=DEV).manual_seed(B * 1000 + H)
    qc = torch.randn(B, q_len, H, D_C, generator=g, device=DEV).to(torch.bfloat16)
    qr = torch.randn(B, q_len, H, D_R, generator=g, device=DEV).to(torch.bfloat16)
    return qc, qr


def time_decode(cache: Cache, q, cfg: DecodeConfig | None, args) -> tuple[float, bool, DecodeConfig]:
    """Median seconds of one decode call of `cfg` over `cache` (a CUDA-graph replay where it captures), whether
    it was a replay, and the config that ran (`cfg` None: the API's own choice for these lengths)."""
    qc, qr = q
    B, SQ, H, _ = qc.shape
    md = api.get_mla_metadata(cache.seq_lens, H, SQ, cache.layout, config=cfg)
    out = torch.empty(B, SQ, H, D_C, device=DEV, dtype=torch.bfloat16)
    lse = torch.empty(B, SQ, H, device=DEV)
    scale = 1 / math.sqrt(192)

    def fn():
        api.mla_decode_with_kvcache(qc, qr, cache.pages, cache.block_table, cache.seq_lens, cache.layout, scale,
                                    metadata=md, out=out, lse=lse)

    ms, graph = time_ms(fn, args.warmup_ms, args.rep_ms)
    return ms * 1e-3, graph, md.config


def _time_peer(peer, cache: Cache, q, H, B, L, bf16_bytes, flops, copy, rows: list, args) -> float | None:
    """The peer's BF16 decode on the same tokens, at each num_kv_splits of PEER_SPLITS; appends its best
    row (with every split's time) and returns its best time in seconds, or None if it failed."""
    try:
        kv = peer_kv(cache)
        times = {}
        skipped = [n for n in PEER_SPLITS if peer[1] == "decode_attention_fwd" and not peer_indexes(B, H, n)]
        for n in PEER_SPLITS:
            if n in skipped:
                continue
            fn = peer[0](q[0][:, 0], q[1][:, 0], kv, cache.block_table, cache.seq_lens, 1 / math.sqrt(192), num_kv_splits=n) \
                if peer[1] == "decode_attention_fwd" else peer[0](q[0][:, 0], q[1][:, 0], kv, cache.block_table, cache.seq_lens, 1 / math.sqrt(192))
            t, graph = time_ms(fn, args.warmup_ms, args.rep_ms)
            times[n] = t * 1e-3
            if peer[1] != "decode_attention_fwd":
                break
        best = min(times, key=times.get)
        row = _row(H, B, L, "peer-bf16", times[best], bf16_bytes, bf16_bytes, flops, copy, None, None, graph)
        if hasattr(fn, "out"):  # the same answer as our BF16 kernel on the same tokens?
            ours, _ = api.mla_decode_with_kvcache(q[0], q[1], cache.pages, cache.block_table, cache.seq_lens, cache.layout,
                                                  1 / math.sqrt(192))
            fn()
            row["rel_diff_vs_ours"] = float((fn.out.float() - ours[:, 0].float()).norm() / ours.float().norm())
        row["peer_num_kv_splits"] = best
        row["peer_best_at_sweep_edge"] = len(times) > 1 and best in (min(times), max(times))
        row["peer_ms_by_splits"] = {str(k): v * 1e3 for k, v in times.items()}
        row["peer_splits_skipped"] = skipped  # past the peer's int32 offsets (peer.peer_indexes)
        rows.append(row)
        del kv
        return times[best]
    except Exception as e:  # noqa: BLE001 - the peer is optional: report and go on
        print(f"peer failed at H={H} {B}x{L}: {type(e).__name__}: {e}", flush=True)
        return None


def _row(H, B, L, method, t, nbytes, bf16_bytes, flops, copy, t_bf16, cfg, graph) -> dict:
    gbps = nbytes / t / 1e9
    return {
        "heads": H, "batch": B, "context": L, "method": method,
        "ms": t * 1e3,
        "bytes_read": nbytes,
        "GBps": gbps,
        "frac_copy": gbps / copy,
        "bf16_equiv_GBps": bf16_bytes / t / 1e9,
        "TFLOPs": flops / t / 1e12,
        "speedup_vs_bf16": (t_bf16 / t) if t_bf16 else None,
        "speedup_vs_peer": None,
        "config": cfg.describe() if cfg else None,
        "cuda_graph": graph,
    }


def _print_row(r):
    sp = f"{r['speedup_vs_bf16']:.2f}x bf16" if r["speedup_vs_bf16"] else "   -"
    if r.get("speedup_vs_peer"):
        sp += f" {r['speedup_vs_peer']:.2f}x peer"
    print(
        f"H={r['heads']:3d} {r['batch']:4d}x{r['context']:<7d} {r['method']:18s} {r['ms'] * 1e3:9.1f} us "
        f"{r['GBps']:7.0f} GB/s ({r['frac_copy']:.2f} copy) bf16-eq {r['bf16_equiv_GBps']:7.0f} GB/s "
        f"{r['TFLOPs']:6.1f} TFLOP/s {sp}",
        flush=True,
    )


def _bench_append(methods, args) -> list[dict]:
    """Quantize-and-append throughput: one decode step of 128 tokens and an 8192-token prefill chunk."""
    out = []
    for m in methods:
        layout = PageLayout(TokenLayout(D_C, D_R, METHODS[m]), PAGE)
        if layout.token.fmt.rope.per_page:  # written page by page (cache.paged.write_tokens), no append kernel
            continue
        for T in (128, 8192) if DEV == "cuda" else (128,):
            pages = torch.zeros(layout.pages_for(T) + 1, layout.page_bytes, dtype=torch.uint8, device=DEV)
            slots = torch.randperm(T, device=DEV)
            x = torch.randn(T, D_C, device=DEV, dtype=torch.bfloat16)
            r = torch.randn(T, D_R, device=DEV, dtype=torch.bfloat16)
            t, graph = time_ms(lambda: api.append_to_pages(pages, layout, slots, x, r), args.warmup_ms, args.rep_ms)
            moved = T * ((D_C + D_R) * 2 + layout.token.bytes_per_token)
            out.append({"method": m, "tokens": T, "ms": t, "GBps": moved / (t * 1e-3) / 1e9, "cuda_graph": graph})
            print(f"append {m:10s} {T:5d} tokens {t * 1e3:8.1f} us {out[-1]['GBps']:6.0f} GB/s", flush=True)
    return out
