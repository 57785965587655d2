"""The plan of the tokens-as-M kernel at 64 query rows (mla_decode_tm64.cu): the tokens as the M of Hopper's warpgroup
MMAs, 64 query rows (heads x query tokens) as their N, the codes dequantized into the register A operands, so no tile
is built. Three warpgroups a CTA (the scores and softmax; the output's two halves), one CTA an SM, 64-token tiles in
STAGES raw stages of bulk copies. It reads INT4/INT4 with DeepSeek's groups (affine, 128 content and 64 RoPE channels,
fp16 metadata) at d_c 512, d_r 64: the many-heads case where the heads-as-M kernel's tile build sets the time."""

from __future__ import annotations

import torch

from quantmla.cache.layout import PageLayout
from quantmla.kernels.cuda.plan import _OUT, SMEM_PER_CTA, DecodePlan, partial_macros

TM64_BLOCK_M, TM64_BLOCK_N, TM64_WARPS, TM64_STAGES = 64, 64, 12, 5
TM64_MIN_ROWS = 64
"""Fewer query rows than this pad the MMA's N; the 16-row tokens-as-M kernel takes them."""


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


def tokens_m64_reason(layout: PageLayout, rows: int) -> str | None:
    """Why the 64-row tokens-as-M kernel cannot read `layout` for `rows` query rows, or None where it can."""
    tok = layout.token
    c, r = tok.fmt.content, tok.fmt.rope
    if rows < TM64_MIN_ROWS:
        return f"{rows} query rows: it takes {TM64_MIN_ROWS} or more (heads x query tokens)"
    if (tok.d_c, tok.d_r) != (512, 64):
        return f"d_c {tok.d_c}, d_r {tok.d_r}: it reads DeepSeek's geometry, 512 and 64"
    for f, name, group in ((c, "content", 128), (r, "RoPE", 64)):
        if (not f.quantized or f.mode != "affine" or f.bits != 4 or f.per_page or f.meta_dtype != "float16"
                or f.group_size != group):
            return (f"{name} path {f.describe()}: it reads 4-bit affine codes with per-token fp16 metadata in groups of "
                    f"{group} (INT4/INT4 with DeepSeek's groups)")
    if layout.page_size % TM64_BLOCK_N:
        return f"page size {layout.page_size}: a multiple of {TM64_BLOCK_N}"
    return None


def smem_bytes_tm64(stages: int = TM64_STAGES) -> int:
    """Dynamic shared memory of one CTA, bytes (the map of mla_decode_tm64.cu, which asserts it): the query block (nine
    64 x 64 fp16 chunks), two P buffers of one chunk, `stages` raw stages of a tile's page sections (19712 bytes),
    their mbarriers, the P buffers' flags, the rows' maxima exchange (1 KiB), their factors, sums, scales and causal
    limits, and 1024 bytes to align the chunks."""
    chunk, raw, bm = 64 * 128, 64 * (256 + 32 + 16 + 4), TM64_BLOCK_M
    return 9 * chunk + 2 * chunk + stages * raw + 8 * stages + 16 + 1024 + 2 * bm * 4 + 3 * bm * 4 + 1024


def tokens_m64_plan(layout: PageLayout, rows: int, out_dtype: torch.dtype, stages: int = TM64_STAGES) -> DecodePlan | str:
    """The 64-row tokens-as-M build for `layout` with `stages` raw stages, 3 or more (or why there is none)."""
    why = tokens_m64_reason(layout, rows)
    if why:
        return why
    if stages < 3:
        return f"{stages} stages: it refills a stage two tiles behind, so it takes 3 or more"
    smem = smem_bytes_tm64(stages)
    if smem > SMEM_PER_CTA:
        return f"{smem} bytes of shared memory a CTA: more than {SMEM_PER_CTA} ({stages} stages)"
    o = layout.offsets
    macros = dict(TM64=1, PS=layout.page_size, PAGE_BYTES=layout.page_bytes, OFF_CC=o["content_codes"],
                  OFF_RC=o["rope_codes"], OFF_CM=o["content_meta"], OFF_RM=o["rope_meta"], HALF=1, NW=TM64_WARPS,
                  BN=TM64_BLOCK_N, STAGES=stages, OUT_KIND=_OUT[out_dtype], SMEM_EXPECTED=smem,
                  **partial_macros(layout))
    return DecodePlan(tuple(sorted(macros.items())), TM64_BLOCK_M, stages, 1, smem)
