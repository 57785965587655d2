"""The split-KV schedule of a decode step: tilings (``DecodeConfig``), work units (``MLAMetadata``)
and the work a step does (``decode_flops``, ``decode_bytes``).

``get_mla_metadata`` cuts every sequence into units of whole key tiles so that about ``num_SMs x
ctas_per_sm`` programs run; one unit is (sequence, first token, end token, splits of that sequence).
It is computed once per decode step and reused by every layer. ``combine_blocks`` sizes the combine
kernel's programs (``combine_shape``). ``kernels.api`` re-exports all of it.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from quantmla.cache.layout import PageLayout
from quantmla.errors import QuantMLAError, UnsupportedFormatError

MAX_Q_LEN = 16


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


# --------------------------------------------------------------------------------------------------
# Scheduling: work units (sequence, token range) and launch configs
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the decode kernel. block_m: query rows (heads × query tokens) per program;
    block_n: tokens per tile; ctas_per_sm: programs the scheduler aims to keep per SM (it splits
    long sequences until there are about that many); min_chunk: fewest tokens a split covers;
    kernel: "cuda" (kernels/cuda/mla_decode.cu: each tile built once in shared memory as 16-bit values
    and read by both products; block_n and num_warps its tiling, num_stages its cp.async stages), "fused" (Triton,
    generated per format, codes exact in bf16, scales folded into scores and probabilities; BF16 caches
    too) or "generic" (Triton, decode.py: tiles rebuilt to bf16 values);
    unpack: the fused kernel's code unpacking ("asm": inline PTX, once per tile; "tl": Triton ops);
    orient: "heads" (rows are the MMA M dimension) or "tokens" (the transposed problem: tokens and
    channels are M, so 16 heads still fill Hopper's 64-row wgmma);
    deq: the generic kernel's tile rebuild (0: shifts + one reshape; 1: per-channel indexing);
    tokens_m: the CUDA kernel with tokens as the MMA's M dimension (kernels/cuda/mla_decode_tm.cu; up to 16 rows,
    2- or 4-bit affine codes with fp16 metadata or FP8 (fp8_ds_mla), d_c 512 and d_r 64);
    token_blocks: with tokens_m, the blocks of 16 tokens whose scores one warp takes (1 or 2; None: the default for
    the layout, kernels.cuda.tokens_m_default_blocks);
    warpgroup: the CUDA kernel with the query rows as the M of Hopper's warpgroup MMAs (kernels/cuda/mla_decode_wg.cu;
    BF16 caches at 64 rows or more, 64 rows a CTA);
    seesaw: (implies warpgroup) the heads-as-M kernel with its two warpgroups out of phase, each taking a whole
    tile's scores in turn (kernels/cuda/mla_decode_seesaw.cu; BF16 caches, 64 rows or more; not the default);
    specialized: with tokens_m, 8 warps a CTA: 4 take a tile's scores, softmax and P, the other 4 its output
    products a tile behind (WS in mla_decode_tm.cu; ctas_per_sm 1 or 2); False: 4 warps that take both; None: the
    kernel's default for the layout (kernels.cuda.tokens_m_plan);
    s8_scores: with tokens_m and specialized, the scores' products as 8-bit warpgroup MMAs (S8_QK, INT4/INT4; not the
    default);
    scale_vote: with tokens_m, each token's P also held under 65504 / its largest content scale (SCALE_VOTE), so that
    content scales past kernels.cuda.TM_MAX_CONTENT_SCALE read right (not the default: it costs up to 12 %)."""

    block_m: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    ctas_per_sm: int = 2
    min_chunk: int = 256
    kernel: str = "fused"
    unpack: str = "asm"
    orient: str = "heads"
    deq: int = 0
    tokens_m: bool = False
    token_blocks: int | None = None
    warpgroup: bool = False
    specialized: bool | None = None
    s8_scores: bool = False
    scale_vote: bool = False
    seesaw: bool = False

    def __post_init__(self):
        if self.seesaw and not self.warpgroup:  # it takes the heads-as-M launch shape
            object.__setattr__(self, "warpgroup", True)

    def describe(self) -> str:
        tm = ("cuda/tm/ws" if self.specialized else "cuda/tm") + ("q" if self.s8_scores else "") + (
            "v" if self.scale_vote else "")
        wg = "cuda/ss" if self.seesaw else "cuda/wg"
        cuda = tm if self.tokens_m else wg if self.warpgroup else "cuda"
        k = {"fused": f"fused/{self.unpack}/{self.orient[0]}", "cuda": cuda}.get(self.kernel, f"generic/d{self.deq}")
        return f"{k} M{self.block_m} N{self.block_n} w{self.num_warps} s{self.num_stages} c{self.ctas_per_sm} k{self.min_chunk}"


def default_config(rows: int, layout: PageLayout | None = None, device: torch.device | str | None = None,
                   allow_tokens_m: bool = True, scale_vote: bool = False) -> DecodeConfig:
    """A config for `rows` = heads × query tokens per sequence; `allow_tokens_m=False` keeps the tokens-as-M kernel
    out of the choice (the built tile where it would have run); `scale_vote` takes its SCALE_VOTE build where it
    runs (content scales past kernels.cuda.TM_MAX_CONTENT_SCALE)."""
    bm = 16 if rows <= 16 else 32
    if interpreting() or (device is not None and torch.device(device).type != "cuda"):
        return DecodeConfig(block_m=bm, block_n=16, num_warps=4, num_stages=1, ctas_per_sm=1, min_chunk=16)
    if layout is not None and device is not None:
        from quantmla.kernels import cuda

        cfg = None
        if cuda.warpgroup_reason(layout, rows) is None and cuda.warpgroup_by_default(layout):
            # BF16, FP8 or integer codes at 64 rows or more: heads as the warpgroup MMAs' M (sm_90; None before
            # Hopper). On the H200 at 128 heads, 32 x 8192: BF16 174 against the Triton kernel's 542 us
            # (lab/results/kernels/decode_warpgroup_128h_h200.json, decode_warpgroup_tma_128h_h200.json); INT4/INT4
            # 211 against the built tile's 362 us (decode_warpgroup_lowbit_128h_h200.json); FP8 236 against Triton's
            # 407 (decode_vs_peer_128h_h200.json at 9257a95 and 5d09173)
            cfg = cuda_config(rows, layout, device, warpgroup=True)
        if cfg is None and cuda.chosen(layout, rows):
            cfg = cuda_config(rows, layout, device, tokens_m=None if allow_tokens_m else False, scale_vote=scale_vote)
        if cfg is not None:
            return cfg
    quant = layout is not None and layout.token.fmt.content.quantized
    from quantmla.kernels import codegen

    if quant and (layout.token.fmt.content.mode == "fp8" or not codegen.supported(layout)):
        # the generic kernel (e4m3 tiles, or a layout the fused kernel cannot read): its fastest H200 tilings
        # for FP8 over 1 x 131072 and 32 x 16384 (16 heads), 1 x 32768 and 32 x 8192 (128 heads) in
        # lab/results/decode_schedule/decode_schedule_h200.json
        if bm == 16:
            return DecodeConfig(block_m=16, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=2, min_chunk=128, kernel="generic")
        return DecodeConfig(block_m=64, block_n=64, num_warps=8, num_stages=1, ctas_per_sm=1, kernel="generic")
    if bm == 16:  # memory-bound: one head block; the fastest tilings of the H200 sweep, and splits of
        # 128 tokens, not 256: at 1-8 sequences of 1900 tokens a layer's decode is 15-20 % faster in every
        # format, the same at 16 (lab/quantmla_lab/bench/kernels/decode_splits.py, lab/results/decode_splits/h200.json)
        if quant:
            return DecodeConfig(block_m=16, block_n=128, num_warps=8, num_stages=2, ctas_per_sm=1, min_chunk=128)
        return DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2, min_chunk=128)
    # many heads: 32-row blocks (mma.sync; 64-row wgmma tiles spill at d_c = 512), co-scheduled blocks share L2
    return DecodeConfig(block_m=32, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1)


def cuda_config(rows: int, layout: PageLayout, device: torch.device | str, *, num_warps: int | None = None,
                block_n: int | None = None, tokens_m: bool | None = None,
                token_blocks: int | None = None, warpgroup: bool = False, specialized: bool | None = None,
                ctas_per_sm: int | None = None, s8_scores: bool = False,
                scale_vote: bool = False, seesaw: bool = False) -> DecodeConfig | None:
    """The CUDA kernel's config for `rows` query rows, built and loaded now (not inside a later graph capture); None
    where it cannot run here (the reason in ``kernels.cuda.plan_reason``). By default the tokens-as-M kernel where it
    reads the layout (up to 16 rows of 2- or 4-bit affine codes with fp16 metadata, or FP8, at d_c 512, d_r 64: on the
    H200 1.24x and 1.38x the built tile at 32 x 16384 in INT4/INT4 and INT2/INT4, and 0.96x in INT4/INT4 at 1 x 131072,
    where a unit has 8 tiles; lab/results/kernels/decode_tokens_m_h200.json; for FP8 ``get_mla_metadata`` takes the
    built tile where units are short, and for integer codes the 4-warp plan; a RoPE path grouped per page only where
    ``cuda.tokens_m_by_default``), else the built-tile kernel's default tiling; `num_warps` x `block_n` ask for a
    built-tile plan, `tokens_m=True` for the tokens-as-M kernel only (`token_blocks` 1 or 2 a warp;
    `specialized` its scores' and output's warps apart, `ctas_per_sm` of them, `s8_scores` its scores on 8-bit warpgroup
    MMAs, `scale_vote` its SCALE_VOTE build), `tokens_m=False` for the built tile only, `warpgroup=True` for the
    heads-as-M kernel on warpgroup MMAs only (with `seesaw=True` its warpgroups out of phase, BF16 only)."""
    from quantmla.kernels import cuda
    from quantmla.kernels.cuda.build import nvcc

    dev = torch.device(device)
    if nvcc() is None:
        return None
    plans = []  # in order of preference: a failed build falls back to the next (the default: the built tile)
    warpgroup = warpgroup or seesaw  # (it takes the heads-as-M launch shape)
    if warpgroup:
        plans.append(cuda.decode_plan(layout, rows, torch.bfloat16, dev, warpgroup=True, seesaw=seesaw))
    elif tokens_m or (tokens_m is None and num_warps is None and block_n is None
                      and cuda.tokens_m_by_default(layout)):
        plans.append(cuda.decode_plan(layout, rows, torch.bfloat16, dev, tokens_m=True, token_blocks=token_blocks,
                                      specialized=specialized, ctas_per_sm=ctas_per_sm, s8_scores=s8_scores,
                                      scale_vote=scale_vote))
    if not tokens_m and not warpgroup:
        plans.append(cuda.decode_plan(layout, rows, torch.bfloat16, dev, num_warps=num_warps, block_n=block_n))
    plan = None
    for p in plans:
        if p is None:
            continue
        try:
            cuda.prepare(p, dev)
            plan = p
            break
        except (QuantMLAError, OSError) as e:  # a failed build, or no driver library
            cuda.plan_reason[layout] = str(e).splitlines()[0]
    if plan is None:
        return None
    return DecodeConfig(block_m=plan.block_m, block_n=plan.block_n, num_warps=plan.num_warps, num_stages=plan.stages,
                        ctas_per_sm=plan.ctas_per_sm, min_chunk=128, kernel="cuda",
                        tokens_m=bool(dict(plan.macros).get("TM")), token_blocks=dict(plan.macros).get("TPW", 1) if dict(plan.macros).get("TM") else None,
                        warpgroup=bool(dict(plan.macros).get("WG")), seesaw=bool(dict(plan.macros).get("SEESAW")),
                        specialized=bool(dict(plan.macros).get("WS")),
                        s8_scores=bool(dict(plan.macros).get("S8_QK")),
                        scale_vote=bool(dict(plan.macros).get("SCALE_VOTE")))


@dataclass
class MLAMetadata:
    """The split-KV schedule of one decode step (reuse it for every layer).

    units: int32 [U, 4] rows (sequence, token start, token end, splits of that sequence);
    seq_info: int32 [B, 2] rows (first unit, splits); combine: the combine kernel's program shape (None: sized by
    ``combine_shape`` for these sequences and splits at launch); lengths: the ``seq_lens`` tensors whose values the
    units were cut for (weak references with their version counters; :meth:`check_lengths`), None where the units'
    owner deals them out to the lengths itself (a CUDA-graph bucket's ``StaticDecodePlan.update``)."""

    units: torch.Tensor
    seq_info: torch.Tensor
    num_units: int
    max_splits: int
    num_heads: int
    q_len: int
    config: DecodeConfig
    seq_lens: list[int]
    chunk_tokens: int
    combine: CombineShape | None = None
    workspace: dict = field(default_factory=dict, repr=False)
    lengths: list | None = field(default_factory=list, repr=False)

    def check_lengths(self, seq_lens: torch.Tensor) -> None:
        """QuantMLAError unless `seq_lens` holds the lengths these units were cut for: the tensor they were cut from,
        unchanged since (its version counter), needs no check; any other is read on the host once (a sync; refused
        inside a CUDA-graph capture) and remembered if it holds the same values. An inference-mode tensor keeps no
        version counter, so it is read on the host at every call, except inside a capture, where the tensor the units
        were cut from passes unread (nothing can be read there). Writes torch does not count (through `.data`, a
        numpy view, a kernel's stores) are not seen. Stale units would drop tokens past their ends, or read slots
        never written. An owner that deals units out to the lengths itself sets ``lengths`` to None: no check."""
        if self.lengths is None:
            return
        capturing = seq_lens.is_cuda and torch.cuda.is_current_stream_capturing()
        now_v = _version(seq_lens)
        if any(ref() is seq_lens and (v == now_v if v is not None else capturing) for ref, v in self.lengths):
            return
        how = "make the metadata with get_mla_metadata for these lengths"
        if capturing:
            raise QuantMLAError(f"metadata was made from another seq_lens tensor, or this one changed since: {how}, "
                                "and pass the tensor it read, unchanged, to every call in the capture")
        now = [int(x) for x in seq_lens.reshape(-1).tolist()]
        if now != self.seq_lens:
            shown = lambda v: str(v[:8])[:-1] + (", ...]" if len(v) > 8 else "]")  # noqa: E731
            raise QuantMLAError(
                f"metadata was made for sequence lengths {shown(self.seq_lens)}, not {shown(now)}: {how}")
        alive = [(r, v) for r, v in self.lengths if r() is not None]
        self.lengths = alive + [(weakref.ref(seq_lens), _version(seq_lens))]

    @property
    def variant(self) -> str | None:
        """The decode kernel variant the last launch with this metadata ran ("fused/<unpack>/<orient>" or
        "generic/d<deq>/s<stages>"), which differs from ``config`` when that failed to compile and a
        fallback ran; None before the first launch."""
        return self.workspace.get("variant")

    def partials(self, rows: int, d_c: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The split partials' workspace of calls with this schedule, made on first use and kept: (outputs [units, rows,
        d_c] of `dtype`, ``partials.partial_dtype``; log-sum-exps [units, rows] fp32)."""
        key = (rows, d_c, dtype, str(torch.device(device)))
        if key not in self.workspace:
            self.workspace[key] = (torch.empty((self.num_units, rows, d_c), dtype=dtype, device=device),
                                   torch.empty((self.num_units, rows), dtype=torch.float32, device=device))
        return self.workspace[key]

    @property
    def rows(self) -> int:
        return self.num_heads * self.q_len

    @property
    def head_blocks(self) -> int:
        return -(-self.rows // self.config.block_m)


def _version(t: torch.Tensor) -> int | None:
    """`t`'s version counter (bumped by torch's in-place writes), None for an inference-mode tensor (it keeps none)."""
    try:
        return t._version
    except RuntimeError:
        return None


_SM_COUNT: dict = {}


def num_sms_of(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached); 4 for the CPU interpreter."""
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def get_mla_metadata(
    seq_lens: torch.Tensor,
    num_heads: int,
    q_len: int = 1,
    layout: PageLayout | None = None,
    *,
    config: DecodeConfig | None = None,
    num_sms: int | None = None,
    chunk_tokens: int | None = None,
    combine: CombineShape | None = None,
    follow_units: bool = False,
) -> MLAMetadata:
    """Split every sequence into work units so that at most ``num_sms × ctas_per_sm`` programs run (one
    wave: a second, partial wave would double the step's time), as many as the lengths allow.

    Reads ``seq_lens`` on the host (one sync per decode step). ``chunk_tokens`` forces the split size; ``combine``
    the combine kernel's program shape (any shape of the same rows and d_c merges correctly: an engine gives its
    eager decode calls its CUDA graphs' shapes, so they compile no other variant of the kernel).
    Without ``config``, an FP8 cache whose units are shorter than ``cuda.FP8_TM_MIN_TOKENS`` is read by the
    built-tile kernel rather than the tokens-as-M one, and 4-bit content codes whose units are shorter than
    ``cuda.TM_WS_MIN_TOKENS`` by the tokens-as-M kernel's 4-warp plan rather than the one with the warps apart, with
    one token block a warp where the units are shorter than ``cuda.TM_TWO_BLOCKS_MIN_TOKENS`` and their CTAs fit one an
    SM (``config_for_units``; each measured faster there). A ``config`` is kept as given, unless ``follow_units``
    (default False): then those rules apply to it as to the default, ``config`` being where they start (the engine
    passes it for its ``latent_range.WideLatentsConfig``, ``triton_backend.follows_units``); without a ``config`` the
    rules apply whatever ``follow_units`` says.
    """
    if num_heads < 1:
        raise UnsupportedFormatError(f"num_heads must be >= 1, got {num_heads}")
    if not 1 <= q_len <= MAX_Q_LEN:
        raise UnsupportedFormatError(f"the decode kernel takes 1 to {MAX_Q_LEN} query tokens per sequence, got {q_len}")
    device = seq_lens.device
    lens = [int(x) for x in seq_lens.reshape(-1).tolist()]
    if any(n < 0 for n in lens):
        raise QuantMLAError("sequence lengths must be >= 0")
    rows = num_heads * q_len
    cfg = config or default_config(rows, layout, device)
    bn = cfg.block_n
    hb = -(-rows // cfg.block_m)
    tiles = np.asarray([-(-n // bn) for n in lens], dtype=np.int64)
    if chunk_tokens is None:
        target_units = max(1, (num_sms or num_sms_of(device)) * cfg.ctas_per_sm // hb)
        chunk_tiles = fewest_tiles(tiles, target_units, -(-cfg.min_chunk // bn))
    else:
        chunk_tiles = max(1, -(-chunk_tokens // bn))
    units, info = cut_units(np.asarray(lens, dtype=np.int64), chunk_tiles, bn)
    one_an_sm = len(units) * hb <= (num_sms or num_sms_of(device))
    if (config is None or follow_units) and (
            chosen := config_for_units(cfg, rows, layout, device, chunk_tiles * bn, one_an_sm)) is not cfg:
        return get_mla_metadata(seq_lens, num_heads, q_len, layout, config=chosen, num_sms=num_sms,
                                chunk_tokens=chunk_tokens, combine=combine)
    return MLAMetadata(
        units=torch.from_numpy(units).to(device=device, dtype=torch.int32).reshape(-1, 4),
        seq_info=torch.from_numpy(info).to(device=device, dtype=torch.int32).reshape(-1, 2),
        num_units=len(units),
        max_splits=int(info[:, 1].max()) if len(info) else 1,
        num_heads=num_heads,
        q_len=q_len,
        config=cfg,
        seq_lens=lens,
        chunk_tokens=chunk_tiles * bn,
        combine=combine,
        lengths=[(weakref.ref(seq_lens), _version(seq_lens))],
    )


def fewest_tiles(tiles: np.ndarray, num_units: int, min_tiles: int) -> int:
    """The fewest key tiles a split may hold (at least `min_tiles`) for which sequences of `tiles` key tiles each
    take at most `num_units` units, one at least a sequence (or, where even one a sequence is more, the longest
    sequence's tiles: one unit each).

    The answer c lies between ceil(T / num_units) and ceil(T / (num_units - b)), T the tiles in all and b the
    sequences (each sequence's units round up by less than one): where that window is narrow, all of it is tried
    at once; else it is searched by halving."""
    t = np.asarray(tiles, dtype=np.int64)
    total, b, longest = int(np.maximum(t, 1).sum()), t.shape[0], int(t.max(initial=1))
    lo = max(min_tiles, -(-total // max(1, num_units)), 1)
    hi = max(lo, min(longest, -(-total // (num_units - b)) if num_units > b else longest))
    if hi - lo < 64:
        c = np.arange(lo, hi + 1)
        fit = np.maximum(1, -(-t[None, :] // c[:, None])).sum(axis=1) <= num_units
        return int(c[np.argmax(fit)]) if fit.any() else hi  # none fits (fewer units than sequences): hi
    fits = lambda c: int(np.maximum(1, -(-t // c)).sum()) <= num_units  # noqa: E731
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def cut_units(lens: np.ndarray, chunk_tiles: int, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences of `lens` tokens cut into splits of at most `chunk_tiles` key tiles of `tile` tokens, evened out
    (equal whole tiles, the last one shorter; a sequence of 0 tokens one empty unit) -> (units int64 [U, 4] rows
    (sequence, token start, token end, splits), seq_info int64 [B, 2] rows (first unit, splits))."""
    n = np.asarray(lens, dtype=np.int64).reshape(-1)
    t = -(-n // tile)
    splits = np.maximum(1, -(-t // chunk_tiles))
    per = -(-t // splits)  # tiles a split, balanced
    splits = np.where(per > 0, -(-t // np.maximum(per, 1)), 1)
    first = (np.cumsum(splits) - splits).astype(np.int64)
    seq = np.repeat(np.arange(len(n)), splits)
    j = np.arange(len(seq)) - first[seq]
    units = np.stack([seq, np.minimum(n[seq], j * per[seq] * tile), np.minimum(n[seq], (j + 1) * per[seq] * tile),
                      splits[seq]], axis=1).astype(np.int64).reshape(-1, 4)
    return units, np.stack([first, splits], axis=1).astype(np.int64).reshape(-1, 2)


def config_for_units(cfg: DecodeConfig, rows: int, layout: PageLayout | None, device,
                     unit_tokens: int, one_cta_an_sm: bool = False) -> DecodeConfig:
    """The default config `cfg` for work units of `unit_tokens` tokens (`one_cta_an_sm`: the call's CTAs, units times
    head blocks, are at most the SMs): an FP8 cache on the tokens-as-M kernel whose units are shorter than
    ``cuda.FP8_TM_MIN_TOKENS`` is read by the built-tile kernel instead, and integer codes on the tokens-as-M kernel
    with the warps apart whose units are shorter than ``cuda.tokens_m_ws_min_tokens`` (4-bit content codes:
    ``cuda.TM_WS_MIN_TOKENS``; 2-bit: none) by its 4-warp plan, with one token
    block a warp where the CTAs fit one an SM and the units are shorter than ``cuda.TM_TWO_BLOCKS_MIN_TOKENS`` (each
    measured faster there), where those build (the 4-warp plan with the SCALE_VOTE build where `cfg` has it); every
    other config is kept. ``get_mla_metadata`` applies it to an
    eager call's units, the engine's decode graphs to a bucket's."""
    from quantmla.kernels import cuda

    if cfg.tokens_m and layout is not None and unit_tokens < _fp8_tm_min_tokens(layout):
        built = cuda_config(rows, layout, device, tokens_m=False)
        if built is not None:
            return built
    if cfg.tokens_m and cfg.specialized and layout is not None and unit_tokens < cuda.tokens_m_ws_min_tokens(layout):
        blocks = 1 if one_cta_an_sm and unit_tokens < cuda.TM_TWO_BLOCKS_MIN_TOKENS else None  # None: the default
        four_warps = cuda_config(rows, layout, device, tokens_m=True, specialized=False, token_blocks=blocks,
                                 scale_vote=cfg.scale_vote)
        if four_warps is not None:
            return four_warps
    return cfg


def _fp8_tm_min_tokens(layout: PageLayout) -> int:
    """The fewest tokens a work unit needs for the API to keep `layout` on the tokens-as-M kernel (0: any)."""
    from quantmla.kernels import cuda

    return cuda.FP8_TM_MIN_TOKENS if cuda.is_fp8(layout) else 0


COMBINE_TILE = 4096  # fp32 elements of a combine step's [splits, rows, channels] tile
COMBINE_ONE_STEP_TILE = 8192  # .. and of the tile a program loads at once where every split fits one step


COMBINE_ROWS_FIRST_SPLITS = 64
"""From this many splits a sequence (the next power of two of the most) a combine program merges one query row's whole
pieces of channels: 1 row x 64 channels (128 bytes of a 16-bit partial), 1 x 32 where that leaves fewer than about two
programs an SM or the [splits, 1, 64] tile would pass COMBINE_ONE_STEP_TILE. In whole decode calls in CUDA graphs
(H100, INT4/INT4, 16 heads) that took 38.4 to 34.5 µs a layer at 7 x 20480 (36 splits), 25.7 to 23.9 at 4 x 20480
(64) and 31.6 to 30.2 at 1 x 131072 (256, 1 x 32); at 32 splits it moved nothing and at 8 or fewer it lost
(docs/kernels.md, "The combine's blocks")."""

COMBINE_MANY_ROWS = 64
COMBINE_MANY_ROWS_BLOCK = (8, 32)
"""With at least COMBINE_MANY_ROWS query rows and 8 to 63 splits a sequence, a combine program takes at most 8 rows x 32
channels (a [splits, 8, 32] tile) rather than the channels-first rule's 16 x 64. In whole decode calls in CUDA graphs
at 128 heads (H100, two processes each) that took 66.8 and 66.2 to 62.9 µs a layer at 8 x 8192 (8 splits, INT4/INT4;
BF16 54.2 and 55.9 to 50.6) and 65.1 to 64.1 at 4 x 16384 (16 splits); at 4 and 2 splits 16 x 64 stays faster
(docs/kernels.md, "The combine's blocks")."""


def combine_blocks(B: int, R: int, d_c: int, max_splits: int, num_sms: int, one_step: bool = True) -> tuple[int, int, int]:
    """(rows, channels, splits) per step of a combine program. Sequences of at least COMBINE_ROWS_FIRST_SPLITS splits:
    a row's whole 64 (or 32) channels a program. Fewer: narrower channel blocks, then row blocks, until about two
    programs per SM run; with many rows and 8 or more splits, at most COMBINE_MANY_ROWS_BLOCK. As many splits are
    read per step as a [splits, rows, channels] tile of COMBINE_TILE fp32 holds, so a lone sequence's hundreds of splits merge in a few wide steps rather than many dependent narrow ones.
    Where every split fits a tile of COMBINE_ONE_STEP_TILE, the splits are one step (``combine_one_step``), unless
    ``one_step`` is False (the two-pass loop's blocks, which benchmarks time beside it)."""
    widest = min(64, d_c & -d_c)  # the widest power-of-two block of channels that divides d_c
    if _next_pow2(max_splits) >= COMBINE_ROWS_FIRST_SPLITS:
        block_d = widest
        while block_d > 32 and (B * R * (d_c // block_d) < 2 * num_sms
                                or _next_pow2(max_splits) * block_d > COMBINE_ONE_STEP_TILE):
            block_d //= 2
        return 1, block_d, combine_step_splits(1, block_d, max_splits, one_step)
    block_r, block_d = min(16, _next_pow2(R)), widest
    while B * -(-R // block_r) * (d_c // block_d) < 2 * num_sms and (block_d > 16 or block_r > 2):
        if block_d > 16:
            block_d //= 2
        else:
            block_r //= 2
    if R >= COMBINE_MANY_ROWS and max_splits >= 8:
        block_r, block_d = min(block_r, COMBINE_MANY_ROWS_BLOCK[0]), min(block_d, COMBINE_MANY_ROWS_BLOCK[1])
    return block_r, block_d, combine_step_splits(block_r, block_d, max_splits, one_step)


def combine_step_splits(block_r: int, block_d: int, max_splits: int, one_step: bool = True) -> int:
    """The splits a combine program of `block_r` rows x `block_d` channels reads a step: all of them (the next power of
    two of `max_splits`) where that [splits, rows, channels] tile holds at most COMBINE_ONE_STEP_TILE fp32 and
    `one_step`, else as many as a tile of COMBINE_TILE holds."""
    splits = _next_pow2(max_splits)
    if one_step and splits * block_r * block_d <= COMBINE_ONE_STEP_TILE:
        return splits
    return max(1, min(splits, COMBINE_TILE // (block_r * block_d)))


def combine_one_step(max_splits: int, block_s: int) -> bool:
    """Whether a combine program reads every split of a sequence in one step (at most ``max_splits``)."""
    return max_splits <= block_s


@dataclass(frozen=True)
class CombineShape:
    """A combine program's shape, the kernel's constexprs (one compiled variant each): block_r query rows and block_d
    latent channels a program, block_s splits read a step; one_step: a sequence of at most block_s splits is read in
    one step (one with more takes the two passes). Any shape merges any split counts correctly."""

    block_r: int
    block_d: int
    block_s: int
    one_step: bool

    def check(self, rows: int, d_c: int) -> None:
        """QuantMLAError unless this shape can merge `rows` query rows of `d_c` channels."""
        if not all(_pow2(x) for x in (self.block_r, self.block_d, self.block_s)) or d_c % self.block_d:
            raise QuantMLAError(f"combine shape {self} for {rows} rows of {d_c} channels: block_r, block_d and block_s "
                                f"must be powers of two and block_d must divide d_c")


def combine_shape(B: int, R: int, d_c: int, max_splits: int, num_sms: int) -> CombineShape:
    """The combine shape the API launches for B sequences of R query rows, up to ``max_splits`` splits each
    (``combine_blocks``, one step where every split fits)."""
    r, d, s = combine_blocks(B, R, d_c, max_splits, num_sms)
    return CombineShape(r, d, s, combine_one_step(max_splits, s))


# --------------------------------------------------------------------------------------------------
# Work counts (benchmarks)
# --------------------------------------------------------------------------------------------------
def _visible(lens: list[int], q_len: int, causal: bool = True) -> int:
    """Σ over sequences and query tokens of visible cached tokens."""
    tot = 0
    for n in lens:
        for i in range(q_len):
            tot += max(0, n - (q_len - 1 - i)) if causal else n
    return tot


def decode_flops(lens: list[int], num_heads: int, q_len: int, d_c: int, d_r: int, causal: bool = True) -> int:
    """2·(d_c + d_r) for the scores plus 2·d_c for p·c, per head, query token and visible token."""
    return 2 * (2 * d_c + d_r) * num_heads * _visible(lens, q_len, causal)


def decode_bytes(lens: list[int], layout: PageLayout, num_heads: int, q_len: int) -> int:
    """Bytes the decode must read: each cached token's record once, each page's own metadata (a RoPE path grouped
    per page) once, the queries and block tables."""
    tok = layout.token
    pages = sum(layout.pages_for(n) for n in lens)
    cache = sum(lens) * tok.bytes_per_token + pages * sum(layout.page_field_bytes.values())
    q = len(lens) * q_len * num_heads * (tok.d_c + tok.d_r) * 2
    tables = pages * 4 + 4 * len(lens)
    return cache + q + tables
