"""The kernel API: a FlashMLA-like surface over the packed paged cache.

    md = get_mla_metadata(seq_lens, num_heads, q_len, layout)              # once per decode step
    out, lse = mla_decode_with_kvcache(q_latent, q_rope, kv_pages, block_table, seq_lens,
                                       layout, softmax_scale, metadata=md)  # every layer
    append_to_pages(kv_pages, layout, slots, latent, k_rope)               # prefill chunk or decode step
    latent, k_rope = read_from_pages(kv_pages, layout, slots)               # a prefill chunk's context
    out = mla_prefill_attention(q_nope, q_rope, kv_b_proj(latent), k_rope, softmax_scale)

``kv_pages`` is one layer of a ``PagePool`` (uint8 ``[num_pages, page_bytes]``, layout from
``cache.layout.PageLayout``), ``block_table`` int32 ``[B, max_pages]``, ``seq_lens`` int32 ``[B]``.
``q_latent`` ``[B, S_q, H, d_c]`` is the absorbed query (``q^C · W_UK``ᵀ), ``q_rope`` ``[B, S_q, H,
d_r]``; ``out`` ``[B, S_q, H, d_c]`` is the latent-space output (the caller applies ``W_UV``) and
``lse`` ``[B, S_q, H]`` the natural-log log-sum-exp, with the causal multi-query semantics of
``reference.absorbed.absorbed_attention`` (query i of S_q sees tokens ``t < L − S_q + i + 1``).

A call checks that its ``metadata`` was cut for its ``seq_lens``: the tensor the metadata read, unchanged, passes
as it is; any other is read once on the host and refused unless it holds the same lengths
(``MLAMetadata.check_lengths``). Every input must be on the cache's device.

CUDA tensors (or any tensors under ``TRITON_INTERPRET=1``) run the Triton kernels; other CPU tensors
take the pure-torch reference path (same results up to bf16 rounding). Formats the kernels cannot
run raise :class:`UnsupportedFormatError` before anything is launched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.cache.layout import PageLayout
from quantmla.cache.paged import gather_sequences, read_tokens, write_tokens, write_tokens_staged
from quantmla.errors import QuantMLAError, UnsupportedFormatError
from quantmla.kernels.launch import launch_decode
from quantmla.kernels.partials import partial_dtype
from quantmla.kernels.schedule import (  # noqa: F401 - the public surface is here
    MAX_Q_LEN,
    CombineShape,
    DecodeConfig,
    MLAMetadata,
    _next_pow2,
    combine_blocks,
    combine_one_step,
    combine_shape,
    decode_bytes,
    decode_flops,
    default_config,
    get_mla_metadata,
    interpreting,
    num_sms_of,
)
from quantmla.kernels.support import KERNEL_BITS, check_layout_supported, layout_constexprs, page_views  # noqa: F401
from quantmla.reference.absorbed import absorbed_attention
from quantmla.reference.prefill import prefill_attention

__all__ = [
    "DecodeConfig",
    "MLAMetadata",
    "get_mla_metadata",
    "mla_decode_with_kvcache",
    "append_to_pages",
    "read_from_pages",
    "mla_prefill_attention",
    "PrefillConfig",
    "check_layout_supported",
    "default_config",
    "decode_flops",
    "decode_bytes",
]

LOG2E = 1.4426950408889634


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreting()


# --------------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------------
def mla_decode_with_kvcache(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: PageLayout,
    softmax_scale: float,
    *,
    metadata: MLAMetadata | None = None,
    causal: bool = True,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA decode over the paged cache -> (out [B, S_q, H, d_c], lse [B, S_q, H] fp32).

    3-D queries [B, H, d] are taken as S_q = 1 and give [B, H, d_c] / [B, H]."""
    check_layout_supported(layout)
    squeeze = q_latent.dim() == 3
    if squeeze:
        q_latent, q_rope = q_latent.unsqueeze(1), q_rope.unsqueeze(1)
    if q_latent.dim() != 4 or q_rope.dim() != 4:
        raise QuantMLAError("q_latent / q_rope must be [B, S_q, H, d_c] / [B, S_q, H, d_r] (or 3-D with S_q = 1)")
    B, SQ, H, DC = q_latent.shape
    tok = layout.token
    if DC != tok.d_c or tuple(q_rope.shape) != (B, SQ, H, tok.d_r):
        raise QuantMLAError(
            f"query shapes {tuple(q_latent.shape)} / {tuple(q_rope.shape)} do not match the layout "
            f"(d_c={tok.d_c}, d_r={tok.d_r})"
        )
    if not 1 <= SQ <= MAX_Q_LEN:
        raise UnsupportedFormatError(f"the decode kernel takes 1 to {MAX_Q_LEN} query tokens per sequence, got {SQ}")
    if block_table.dim() != 2 or block_table.shape[0] != B or seq_lens.reshape(-1).shape[0] != B:
        raise QuantMLAError(f"block_table must be [B={B}, max_pages] and seq_lens [B={B}]")
    _check_outputs(out, lse, (B, SQ, H, DC), squeeze, kv_pages.device)
    pages, pc16, pr16 = page_views(kv_pages, layout)
    out_dtype = q_latent.dtype if q_latent.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16

    device = kv_pages.device
    for name, t in (("q_latent", q_latent), ("q_rope", q_rope), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != device:
            raise QuantMLAError(f"{name} is on {t.device}, the cache on {device}: the kernels read every input on the "
                                f"cache's device (move it with .to({str(device)!r}))")

    def shaped(o: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (o.reshape(B, H, DC), l.reshape(B, H)) if squeeze else (o, l)  # (keeps H where it is 1)

    if B == 0:
        o = out if out is not None else torch.empty((0, SQ, H, DC), dtype=out_dtype, device=device)
        l = lse if lse is not None else torch.empty((0, SQ, H), dtype=torch.float32, device=device)
        return shaped(o, l)
    if metadata is not None and config is not None and config != metadata.config:
        raise QuantMLAError(f"config {config.describe()} differs from the metadata's {metadata.config.describe()}: "
                            "a metadata's units are cut for its own config; pass config to get_mla_metadata instead")
    if metadata is not None:  # checked on every path, the CPU reference's too
        if metadata.num_heads != H or metadata.q_len != SQ or len(metadata.seq_lens) != B:
            raise QuantMLAError(
                f"metadata was made for {metadata.num_heads} heads × {metadata.q_len} query tokens and "
                f"{len(metadata.seq_lens)} sequences, not {H} × {SQ} and {B}"
            )
        if metadata.units.device != device:
            raise QuantMLAError(f"metadata was made on {metadata.units.device}, the cache is on {device}: make it "
                                "from seq_lens on the cache's device")
        metadata.check_lengths(seq_lens)
    triton = _use_triton(kv_pages)
    if triton and metadata is None:
        metadata = get_mla_metadata(seq_lens, H, SQ, layout, config=config)
    need = max(metadata.seq_lens + [0]) if metadata is not None else int(seq_lens.max())
    if need > block_table.shape[1] * layout.page_size:
        raise QuantMLAError(f"a sequence of {need} tokens needs more than the {block_table.shape[1]} pages of its "
                            "block-table row")

    if not triton:  # CPU: the torch reference of the same computation
        lat, kr = gather_sequences(pages, layout, block_table, seq_lens.reshape(-1))
        o, l = absorbed_attention(q_latent.float(), q_rope.float(), lat, kr, softmax_scale,
                                  seq_lens.reshape(-1).to(lat.device), causal, torch.float32)
        o = o.to(out_dtype)
        if out is not None:
            out.copy_(o.reshape(out.shape))
            o = out
        if lse is not None:
            lse.copy_(l.reshape(lse.shape))
            l = lse
        return shaped(o, l)
    cfg = metadata.config
    qc = q_latent.to(torch.bfloat16).contiguous()
    qr = q_rope.to(torch.bfloat16).contiguous()
    bt = block_table if block_table.dtype == torch.int32 and block_table.is_contiguous() else block_table.to(torch.int32).contiguous()
    sl = seq_lens.reshape(-1).to(torch.int32).contiguous()  # the kernels read it with stride 1
    R = H * SQ
    if out is None:
        out = torch.empty((B, SQ, H, DC), dtype=out_dtype, device=device)
    if lse is None:
        lse = torch.empty((B, SQ, H), dtype=torch.float32, device=device)
    if metadata.max_splits > 1:
        c = metadata.combine or combine_shape(B, R, DC, metadata.max_splits, num_sms_of(device))
        c.check(R, DC)  # before any launch
        po, plse = metadata.partials(R, DC, partial_dtype(layout), device)
    else:
        po = plse = lse  # never written
    grid = (metadata.head_blocks, metadata.num_units)
    args = (
        qc, qr, pages, pc16, pr16, bt, sl, metadata.units, out, lse, po, plse,
        bt.stride(0), H, SQ, R, 1 if causal else 0, float(softmax_scale) * LOG2E,
    )
    metadata.workspace["variant"] = launch_decode(grid, args, layout, cfg)
    if metadata.max_splits > 1:
        from quantmla.kernels.decode import _mla_combine_kernel

        _mla_combine_kernel[(B, -(-R // c.block_r), DC // c.block_d)](
            po, plse, metadata.seq_info, out, lse, R, D_C=DC, BLOCK_R=c.block_r, BLOCK_D=c.block_d, BLOCK_S=c.block_s,
            ONE_STEP=c.one_step, num_warps=4, num_stages=2,
        )
    return shaped(out, lse)


def _check_outputs(out, lse, shape: tuple[int, int, int, int], squeeze: bool, device: torch.device) -> None:
    """QuantMLAError unless the caller's `out` and `lse` (where given) are what the kernels write into as they are:
    out [B, S_q, H, d_c] (or [B, H, d_c] for 3-D queries) in bf16, fp16 or fp32, lse [B, S_q, H] (or [B, H]) in fp32,
    both contiguous and on the cache's device."""
    B, SQ, H, DC = shape
    for name, t, full, dtypes in (("out", out, (B, SQ, H, DC), (torch.bfloat16, torch.float16, torch.float32)),
                                  ("lse", lse, (B, SQ, H), (torch.float32,))):
        if t is None:
            continue
        shapes = [full] + ([full[:1] + full[2:]] if squeeze else [])
        if tuple(t.shape) not in shapes or t.dtype not in dtypes or not t.is_contiguous() or t.device != device:
            raise QuantMLAError(
                f"{name} must be a contiguous {' or '.join(str(list(x)) for x in shapes)} tensor of "
                f"{' / '.join(str(d).replace('torch.', '') for d in dtypes)} on {device}: got {list(t.shape)} "
                f"{str(t.dtype).replace('torch.', '')} on {t.device}{'' if t.is_contiguous() else ', not contiguous'} "
                f"(pass out=None / lse=None to have them allocated)")


# --------------------------------------------------------------------------------------------------
# Append (quantize, pack, write)
# --------------------------------------------------------------------------------------------------
def append_to_pages(
    kv_pages: torch.Tensor, layout: PageLayout, slots: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
    block_t: int | None = None, *, rope_stage: torch.Tensor | None = None, stage_rows: torch.Tensor | None = None,
    num_warps: int | None = None, paths_apart: bool | None = None,
) -> None:
    """Quantize tokens and write them at `slots` (int [T]; negative slots are skipped).

    block_t: tokens per program (default: 1 up to 256 tokens, so a decode step's few tokens spread
    over as many SMs; 4 beyond). A power of two. num_warps (1, 2, 4 or 8) and paths_apart (the content and
    RoPE paths in programs of their own) tile the kernel; None takes the defaults (``append_tiling``). The knobs are
    checked on every device, the CPU's reference writer included.

    latent [..., d_c] and k_rope [..., d_r] flatten to T tokens (bf16, fp16 or fp32). Bit-exact with
    ``cache.paged.write_tokens``. NaN/Inf inputs are not checked here (that costs a sync).

    A RoPE path grouped per page needs the full-precision keys of the pages being filled: `rope_stage`
    [S, page_size, d_r] (the caller's, one row per sequence that is filling a page; bf16 or fp32) and
    `stage_rows` int [T], each token's stage row. Each token's key goes to its row at its page offset,
    then every page the call writes is requantized over its tokens so far, each metadata block over its
    tokens (as ``write_tokens`` with ``page_rope`` from the stage). A page's tokens must come contiguous and
    in position order within a call, and its earlier tokens must have been staged in the same row."""
    check_layout_supported(layout)
    tok = layout.token
    per_page = tok.fmt.rope.per_page
    if per_page:
        _check_stage(layout, rope_stage, stage_rows, slots.numel())
    xc = latent.reshape(-1, tok.d_c)
    xr = k_rope.reshape(-1, tok.d_r)
    slots = slots.reshape(-1)
    T = xc.shape[0]
    if xr.shape[0] != T or slots.shape[0] != T:
        raise QuantMLAError(f"latent has {T} tokens, k_rope {xr.shape[0]}, slots {slots.shape[0]}")
    for name, t in (("latent", latent), ("k_rope", k_rope), ("slots", slots)):
        if t.device != kv_pages.device:
            raise QuantMLAError(f"{name} is on {t.device}, the cache on {kv_pages.device}: the append reads every "
                                f"input on the cache's device (move it with .to({str(kv_pages.device)!r}))")
    pages, pc16, pr16 = page_views(kv_pages, layout)
    block_t, num_warps, paths_apart = append_tiling(layout, T, block_t, num_warps, paths_apart)
    if not _use_triton(kv_pages):
        if per_page:
            write_tokens_staged(pages, layout, slots, xc, xr, rope_stage, stage_rows)
        else:
            write_tokens(pages, layout, slots, xc, xr)
        return
    if T == 0:
        return
    from quantmla.kernels.append import _append_kernel, _page_rope_kernel, _stage_rope_kernel

    consts, (cbf, rbf) = layout_constexprs(layout)
    consts.pop("R_PAGE")
    if xc.stride(-1) != 1:
        xc = xc.contiguous()
    if xr.stride(-1) != 1:
        xr = xr.contiguous()
    slots = slots.to(device=kv_pages.device, dtype=torch.int64).contiguous()
    _append_kernel[(-(-T // block_t), 2 if paths_apart else 1)](
        xc, xr, slots, pages, pc16, pr16, T, xc.stride(0), xr.stride(0), **consts, C_BF16=cbf, R_BF16=rbf, BLOCK_T=block_t,
        R_WRITE=not per_page, C_CLIP=tok.fmt.content.clip_exp, R_CLIP=tok.fmt.rope.clip_exp, PATHS_APART=paths_apart,
        num_warps=num_warps,
    )
    if per_page:  # requantize the pages from the call's keys and the stage's, then stage the unfinished pages' keys
        rows = stage_rows.reshape(-1).to(device=kv_pages.device, dtype=torch.int32).contiguous()
        f = tok.fmt.rope
        _page_rope_kernel[(T,)](
            xr, slots, rows, rope_stage, pages, pr16, T, xr.stride(0), rope_stage.stride(0), D_R=tok.d_r,
            PS=layout.page_size, PAGE_BYTES=layout.page_bytes, OFF_RC=layout.offsets["rope_codes"],
            OFF_PM=layout.offsets["rope_page_meta"], BLK=layout.rope_meta_block, BITS=f.bits, GS=f.group_size,
            AFFINE=f.mode == "affine", MB=f.meta_elem_bytes, META_BF16=rbf, CLIP=f.clip_exp, num_warps=4,
        )
        _stage_rope_kernel[(T,)](xr, slots, rows, rope_stage, T, xr.stride(0), rope_stage.stride(0), D_R=tok.d_r,
                                 PS=layout.page_size, num_warps=1)


def append_tiling(layout: PageLayout, T: int, block_t: int | None = None, num_warps: int | None = None,
                  paths_apart: bool | None = None) -> tuple[int, int, bool]:
    """(block_t, num_warps, paths_apart) of an append of T tokens into `layout`: the given knobs checked, the rest
    defaulted (``docs/kernels.md``, "Appending"): up to 256 tokens (a decode step's rows), one token a program, 4 warps
    and the two paths in programs apart; beyond, 4 tokens a program and both paths in one program, on one warp where
    the content path is integer codes and on two otherwise (BF16 with the paths apart). The warps and paths_apart are
    chosen by measurement (``quantmla_lab.bench.kernels.append_tilings``); the 256-token bound and the tokens a
    program are the earlier kernel's. A RoPE path grouped per page is written by its own kernel after the content
    path's program, so paths_apart is False there."""
    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if block_t is not None and (not whole(block_t) or block_t < 1 or block_t & (block_t - 1)):
        raise QuantMLAError(f"block_t must be a power of two >= 1, got {block_t!r}")
    if num_warps is not None and (not whole(num_warps) or num_warps not in (1, 2, 4, 8)):
        raise QuantMLAError(f"num_warps must be 1, 2, 4 or 8, got {num_warps!r}")
    if paths_apart is not None and not isinstance(paths_apart, bool):
        raise QuantMLAError(f"paths_apart must be True, False or None, got {paths_apart!r}")
    content = layout.token.fmt.content
    if T <= 256:
        tiling = (1, 4, True)
    elif content.quantized and content.mode != "fp8":
        tiling = (4, 1, False)
    else:
        tiling = (4, 2, not content.quantized)
    given = (block_t, num_warps, paths_apart)
    block_t, num_warps, paths_apart = (tiling[i] if given[i] is None else given[i] for i in range(3))
    return block_t, num_warps, paths_apart and not layout.token.fmt.rope.per_page  # (a staged RoPE path: one program)


def _check_stage(layout: PageLayout, rope_stage, stage_rows, T: int) -> None:
    """The stage of a per-page RoPE path: [S, page_size, d_r] float, contiguous rows; one row index per token."""
    tok = layout.token
    if rope_stage is None or stage_rows is None:
        raise QuantMLAError(
            f"the RoPE path {tok.fmt.rope.describe()} is grouped per page: pass rope_stage [S, {layout.page_size}, "
            f"{tok.d_r}] (the full-precision keys of the pages being filled) and stage_rows [T] (each token's row)")
    if (rope_stage.dim() != 3 or tuple(rope_stage.shape[1:]) != (layout.page_size, tok.d_r)
            or rope_stage.dtype not in (torch.bfloat16, torch.float32) or not rope_stage[0].is_contiguous()):
        raise QuantMLAError(f"rope_stage must be a bf16 or fp32 [S, {layout.page_size}, {tok.d_r}] tensor with contiguous "
                            f"rows, got {rope_stage.dtype} {tuple(rope_stage.shape)}")
    if stage_rows.numel() != T:
        raise QuantMLAError(f"stage_rows holds {stage_rows.numel()} rows for {T} tokens")



def read_from_pages(
    kv_pages: torch.Tensor, layout: PageLayout, slots: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
    block_t: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized latent [T, d_c] and k_rope [T, d_r] in `dtype` of the tokens at `slots` (int [T], every
    slot written). One launch for both paths; values as ``cache.paged.read_tokens`` (fp32) gives them."""
    check_layout_supported(layout)
    tok = layout.token
    slots = slots.reshape(-1)
    pages, pc16, pr16 = page_views(kv_pages, layout)
    if not _use_triton(kv_pages):
        lat, kr = read_tokens(pages, layout, slots)
        return lat.to(dtype), kr.to(dtype)
    from quantmla.kernels.read import _read_kernel

    T = slots.shape[0]
    oc = torch.empty((T, tok.d_c), dtype=dtype, device=kv_pages.device)
    orr = torch.empty((T, tok.d_r), dtype=dtype, device=kv_pages.device)
    if T == 0:
        return oc, orr
    consts, _ = layout_constexprs(layout)
    slots = slots.to(device=kv_pages.device, dtype=torch.int64).contiguous()
    if slots.data_ptr() % 16:  # a view off 16 bytes (a later chunk's slots) is copied: Triton would compile the
        slots = slots.clone()  # kernel again for the other pointer alignment
    _read_kernel[(-(-T // block_t),)](
        oc, orr, slots, pages, pc16, pr16, T, oc.stride(0), orr.stride(0), **consts, BLOCK_T=block_t, num_warps=4
    )
    return oc, orr


@dataclass(frozen=True)
class PrefillConfig:
    """Tiling of the prefill kernel: block_m queries of one head per program, block_n keys per tile."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    split_diagonal: bool = True  # the key blocks every query sees without masks, the diagonal's masked apart
    tma: bool = False  # key blocks through tensor descriptors (Hopper's bulk tensor copies), where the dims allow

    def describe(self) -> str:
        return (f"M{self.block_m} N{self.block_n} w{self.num_warps} s{self.num_stages}"
                + ("" if self.split_diagonal else " one-loop") + (" tma" if self.tma else ""))

    @classmethod
    def parse(cls, text: str) -> "PrefillConfig":
        """From :meth:`describe`'s words, e.g. "M128 N64 w8 s3", "M64 N64 w4 s2 one-loop" or "M128 N64 w8 s3 tma"."""
        words = text.replace(",", " ").split()
        vals = {w[0]: int(w[1:]) for w in words if w[:1] in "MNws" and w[1:].isdigit()}
        if set(vals) != set("MNws"):
            raise ValueError(f"prefill tiling {text!r}: expected e.g. 'M128 N64 w8 s3' (optionally 'one-loop', 'tma')")
        return cls(vals["M"], vals["N"], vals["w"], vals["s"], "one-loop" not in words, "tma" in words)


def default_prefill_config(n: int, T: int | None = None) -> PrefillConfig:
    """The tiling for a chunk of n queries over T context tokens (T = n: a whole prompt), on the H200 at 16
    heads, d_n 128, d_r 64, d_v 128: M64 N64 w4 s2 for short prompts (n <= 2048 and T <= 4096: 0.19 ms at
    n = T = 1536), M128 N64 w8 s3 beyond, chunks after long contexts included (4096 of 20480: 1.76 against
    1.96 ms with M64; 2048 of 18432: 0.92 against 1.02; 16384 of 16384: 2.87 ms, 479 TFLOP/s;
    lab/results/prefill/tilings_stages_h200.json). Deeper pipelines (s4) time the same, Triton's
    warp-specialized loop (tree 0a13d0b) the same or slower, and 128-key blocks at three stages do not fit in
    shared memory (lab/results/prefill/tilings_long_h200.json). Key blocks through tensor descriptors
    (``tma=True``) are 3.5 % faster at 16384 of 16384 and 3 to 10 % slower at the other long chunks, slower still
    at short prompts (lab/results/prefill/tilings_tma_h200.json), so they are not the default."""
    if interpreting():
        return PrefillConfig(16, 16, 4, 1)
    T = n if T is None else T
    return PrefillConfig() if n <= 2048 and T <= 4096 else PrefillConfig(128, 64, 8, 3)


def mla_prefill_attention(
    q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, k_rope: torch.Tensor, softmax_scale: float,
    out: torch.Tensor | None = None, config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of one prefill chunk in the non-absorbed form (``reference.prefill``).

    q_nope [n, H, d_n] and q_rope [n, H, d_r] (rotated) are the chunk's queries, the last n of T
    positions; kv [T, H, d_n + d_v] is ``kv_b_proj`` of the context latent (k_nope then v per head; a
    view with any row and head strides); k_rope [T, d_r] the context's rotated RoPE keys. Returns
    out [n, H, d_v] in q_nope's dtype (written into `out` when given). On the GPU the operands and the
    probabilities are bf16, the accumulation fp32."""
    n, H, d_n = q_nope.shape
    T, d_r = kv.shape[0], k_rope.shape[-1]
    d_v = kv.shape[-1] - d_n
    if q_rope.shape[:2] != (n, H) or kv.shape[1] != H or k_rope.shape[0] != T or q_rope.shape[-1] != d_r:
        raise QuantMLAError(
            f"prefill attention shapes disagree: q_nope {tuple(q_nope.shape)}, q_rope {tuple(q_rope.shape)}, "
            f"kv {tuple(kv.shape)}, k_rope {tuple(k_rope.shape)}")
    if n > T or d_v < 1:
        raise QuantMLAError(f"a chunk of {n} queries needs at least {n} context tokens and kv wider than d_n "
                            f"(got T={T}, kv width {kv.shape[-1]}, d_n={d_n})")
    if out is None:
        out = torch.empty((n, H, d_v), dtype=q_nope.dtype, device=q_nope.device)
    if out.shape != (n, H, d_v) or out.stride(-1) != 1:
        raise QuantMLAError(f"prefill attention: out must be [{n}, {H}, {d_v}] with unit stride in its last dim, "
                            f"got {tuple(out.shape)} with strides {out.stride()}")
    if n == 0:
        return out
    if not _use_triton(q_nope):
        out.copy_(prefill_attention(q_nope, q_rope, kv, k_rope, softmax_scale, torch.float32))
        return out
    from quantmla.kernels.prefill import _mla_prefill_kernel

    cfg = config or default_prefill_config(n, T)
    dt = torch.float32 if interpreting() else torch.bfloat16
    q_nope, q_rope, kv, k_rope = (x.to(dt) if x.stride(-1) == 1 else x.to(dt).contiguous()
                                  for x in (q_nope, q_rope, kv, k_rope))  # any strides, unit last stride
    grid = (-(-n // cfg.block_m), H)
    descriptors = _prefill_descriptors(kv, k_rope, d_n, d_v, cfg.block_n) if cfg.tma else None
    _mla_prefill_kernel[grid](
        q_nope, q_rope, kv, k_rope, out,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), kv.stride(0), kv.stride(1),
        k_rope.stride(0), out.stride(0), out.stride(1),
        n, T, softmax_scale * LOG2E,
        D_N=d_n, D_R=d_r, D_V=d_v, BD_N=max(16, _next_pow2(d_n)), BD_R=max(16, _next_pow2(d_r)),
        BD_V=max(16, _next_pow2(d_v)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_F32=interpreting(),
        SPLIT_DIAGONAL=cfg.split_diagonal,
        **({} if descriptors is None else {**descriptors, "TMA": True}),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _prefill_descriptors(kv: torch.Tensor, k_rope: torch.Tensor, d_n: int, d_v: int, block_n: int) -> dict | None:
    """Tensor descriptors of the prefill kernel's key blocks (kv's rows as [T, H·stride_h], k_rope [T, d_r]), or
    None where a bulk tensor copy cannot read them: head dims not powers of two from 16, strides or addresses off
    16 bytes, a GPU before Hopper."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    T, H, d_r, esz = kv.shape[0], kv.shape[1], k_rope.shape[-1], kv.element_size()
    if kv.is_cuda and torch.cuda.get_device_capability(kv.device)[0] < 9:
        return None
    if any(d < 16 or d & (d - 1) for d in (d_n, d_r, d_v)) or kv.stride(-1) != 1 or k_rope.stride(-1) != 1:
        return None
    if any((x * esz) % 16 for x in (kv.stride(0), kv.stride(1), k_rope.stride(0), d_n)) or \
            kv.data_ptr() % 16 or k_rope.data_ptr() % 16:
        return None
    rows = kv.as_strided((T, (H - 1) * kv.stride(1) + d_n + d_v), (kv.stride(0), 1))
    return {"KN_D": TensorDescriptor(rows, list(rows.shape), [kv.stride(0), 1], [block_n, d_n]),
            "V_D": TensorDescriptor(rows, list(rows.shape), [kv.stride(0), 1], [block_n, d_v]),
            "KR_D": TensorDescriptor(k_rope, [T, d_r], [k_rope.stride(0), 1], [block_n, d_r])}
