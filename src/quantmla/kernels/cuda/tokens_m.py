"""The plan of the tokens-as-M decode kernel (mla_decode_tm.cu): tokens are the MMA's M dimension and the
codes are read in place as the products' operands; 4 warps (or 8, the scores' and the output's apart), 64-token tiles,
the most stages that fit (3 for 2-bit content codes with the warps apart). It reads
2- or 4-bit affine codes with fp16 metadata on both paths, and FP8 (fp8_ds_mla: e4m3 content with an fp32 scale
a group, the RoPE key in bf16)."""

from __future__ import annotations

import torch

from quantmla.cache.layout import PageLayout
from quantmla.kernels.cuda.plan import _OUT, SMEM_PER_SM, SMEM_RESERVED, DecodePlan, is_fp8, partial_macros

TM_BLOCK_N, TM_WARPS, TM_MIN_STAGES, TM_MAX_STAGES = 64, 4, 3, 6
TM_P_BUFFERS = 2  # P·scale is double-buffered: one CTA barrier a tile
TM_MAX_CONTENT_SCALE = 65504.0 / 256
"""The largest content-group scale the kernel's default builds read right (255.875): the output products take P·scale
as an fp16 operand, with P up to 2^8 (the slack of the rows' reference maximum), so a larger scale can overflow fp16's
65504 into NaN. Layouts whose latents' norm allows larger scales decode on the `scale_vote` build
(serving/latent_range.py)."""
TM_VOTE_MAX_CONTENT_SCALE = torch.finfo(torch.float16).max  # 65504; 2^LOG2_P_SCALE_MAX (softmax_tm.cuh) stays under it
"""The largest content-group scale the `scale_vote` build (SCALE_VOTE) reads right: every scale fp16 metadata holds
(FP8's fp32 scales past it overflow P·scale at P = 1). The build caps P·scale at 2^LOG2_P_SCALE_MAX (softmax_tm.cuh)
or the scale itself, whichever is larger, so both stay finite fp16 values; tests/test_decode_configs.py
(test_the_scale_votes_bound_keeps_p_scale_a_finite_fp16) reads the header's constant and checks it against this and
TM_MAX_CONTENT_SCALE. It costs the decode kernel alone, on an H100, 0.9 to 2.1 % in INT4/INT4, 3.1 to 4.8 % in INT2/INT4
on its plan's 3 stages (3 to 12 % on 6) and nothing in FP8 (lab/results/kernels/decode_tokens_m_scale_vote_h100.json,
decode_tokens_m_scale_vote_two_bit_h100.json), so it is built only where asked."""
TM_TOKEN_BLOCKS = TM_BLOCK_N // 16  # the scores' blocks of 16 tokens
TM_WS_SCORE_REGS = 152  # with the warps apart at two CTAs an SM: the scores' warps' registers (the output's: 104)
TM_WS_2BIT_STAGES = 3
"""With the warps apart at two CTAs an SM, 2-bit content codes take at most this many stages (6 fit; the S8_QK build,
not measured so, keeps the most). The decode kernel alone, INT2/INT4, 3 / 4 / 6 stages, one process each: on an H100
(lab/results/kernels/decode_tokens_m_stage_plans_long_h100.json, ..._short_1blocks_h100.json) 28.7 / 28.9 / 28.9 µs at
1 x 131072, 78.5 / 77.8 / 79.2 at 32 x 16384, 45.1 / 45.5 / 46.7 at 64 x 4096, 24.7 / 25.1 / 25.6 at 64 x 1536; on an
H200 (decode_tokens_m_stage_plans_long_h200.json) 27.7 / 27.9 / 28.3 at 1 x 131072, 77.7 / 77.9 / 78.4 at 32 x 16384,
45.0 / 44.9 / 46.1 at 64 x 4096. In the other H100 processes 3 stages are within 0.7 % of 6 or faster
(docs/decode_tokens_m.md, "Stages for 2-bit content")."""
TM_WS_MIN_TOKENS = 384
"""4-bit content codes in work units shorter than this (tokens; 6 tiles of 64) read faster on the 4-warp plan than with
the scores' and the output's warps apart: in CUDA graphs of 27 layers on an H100 (a cache a layer, 16 heads),
INT4/INT4's decode kernel takes 12.3 against 13.1 µs at 8 x 2048 (128-token units), 17.7 against 19.5 at 16 x 2048,
21.9 against 23.0 at 8 x 8192 (256 tokens), the same at 12 x 8192 (384 tokens), and with the warps apart 0.6 µs less
at 16 x 8192 (512 tokens) and 1.6 less at 24 x 8192 (768) (docs/decode_tokens_m.md, "Short units on 4 warps";
lab/results/kernels/decode_in_graph_warps_apart_h100.json). 2-bit content codes keep the warps apart at any length
(``tokens_m_ws_min_tokens``)."""
TM_TWO_BLOCKS_MIN_TOKENS = 256
"""On the 4-warp plan (units shorter than TM_WS_MIN_TOKENS), 4-bit content codes take one token block a warp instead
of the default two where the units are shorter than this (tokens) and the call's CTAs fit one an SM
(``schedule.config_for_units``). In CUDA graphs of 27 layers on an H100, INT4/INT4's decode kernel over 128-token units
takes 9.92 against 10.43 µs at 2 x 2048 (32 CTAs) and 11.48 against 12.14 at 8 x 2048 (128 CTAs) with one block, but
16.09 against 15.61 at 9 x 2304 (162 CTAs), 16.52 against 15.79 at 12 x 2048 (192) and 19.81 against 18.97 at
16 x 2048 (256); over 256-token units (256 CTAs) two blocks stay ahead by 1.0 to 1.1 µs; 256-token units at one CTA an
SM are not measured (docs/decode_tokens_m.md, "Short units on 4 warps"; lab/results/kernels/
decode_in_graph_short_plans_h100.json, decode_in_graph_token_blocks_h100.json,
decode_in_graph_token_blocks_ctas_h100.json)."""
FP8_TM_MIN_TOKENS = 576
"""FP8 work units shorter than this (tokens; 9 tiles of 64) read faster on the built tile: on the H200 at 16 heads the
tokens-as-M build is 13 % slower at 320-token units (4 x 20480) and 3 to 6 % slower at 512 (1 x 131072, 8 x 16384),
3.2 % faster at 576 (7 x 20480) and 9 to 18 % faster at 1024 tokens and more (docs/decode_tokens_m.md, "FP8 on the
tokens-as-M kernel"; lab/results/decode_schedule/long_decode_batches_h200.json)."""


TM_ROPE_PAGE_DEFAULT = True
"""Whether the API's default config reads a RoPE path grouped per page on the tokens-as-M kernel
(`tokens_m_by_default`; False: on the built tile, as before rope_page_tm.cuh). On an H100 its whole calls take
INT4/INT4 with 16-token RoPE blocks in 37.4 against the built tile's 48.0 µs at 1 x 131072 and 99.1 against 141.3 at
32 x 16384, 1.05 to 1.09x the per-token format's on the same kernel
(lab/results/kernels/decode_rope_pages_16h_h100.json; GPU tests: rope_pages_gpu_tests_h100.log)."""


def tokens_m_by_default(layout: PageLayout) -> bool:
    """Whether the API's default config tries the tokens-as-M kernel for `layout` first (where it reads it):
    per-token formats always, a RoPE path grouped per page where TM_ROPE_PAGE_DEFAULT is set."""
    return TM_ROPE_PAGE_DEFAULT or not layout.token.fmt.rope.per_page


def tokens_m_reason(layout: PageLayout, rows: int) -> str | None:
    """Why the tokens-as-M kernel (mla_decode_tm.cu: tokens are the MMA's M dimension, the codes masked in
    place into its A operand) cannot read `layout` for `rows` query rows, or None where it can."""
    tok = layout.token
    c, r = tok.fmt.content, tok.fmt.rope
    if rows > 16:
        return f"{rows} query rows: it takes at most 16 (heads x query tokens)"
    if (tok.d_c, tok.d_r) != (512, 64):
        return f"d_c {tok.d_c}, d_r {tok.d_r}: it reads DeepSeek's geometry, 512 and 64"
    if is_fp8(layout):
        if c.group_size % 128:
            return f"content groups of {c.group_size}: a multiple of 128 channels (a warp's output channels)"
        return None if layout.page_size % TM_BLOCK_N == 0 else f"page size {layout.page_size}: a multiple of {TM_BLOCK_N}"
    for f, name in ((c, "content"), (r, "RoPE")):
        if r.per_page and f is r:
            continue
        if not f.quantized or f.mode != "affine" or f.bits not in (2, 4) or f.per_page or f.meta_dtype != "float16":
            return (f"{name} path {f.describe()}: 2- or 4-bit affine codes with per-token fp16 metadata (or FP8: "
                    "e4m3 content with fp32 scales and a bf16 RoPE key; or a RoPE path grouped per page)")
    if c.group_size % 64:
        return f"content groups of {c.group_size}: a multiple of 64 channels"
    if r.per_page:
        why = rope_page_reason(layout)
        if why:
            return f"RoPE path {r.describe()}: {why}"
    elif r.group_size % (tok.d_r * r.bits // 8) or tok.d_r % r.group_size:
        return f"RoPE groups of {r.group_size}: a whole number of code planes ({tok.d_r * r.bits // 8} channels)"
    if layout.page_size % TM_BLOCK_N:
        return f"page size {layout.page_size}: a multiple of {TM_BLOCK_N}"
    return None


def rope_page_reason(layout: PageLayout) -> str | None:
    """Why the tokens-as-M kernel cannot read `layout`'s RoPE path grouped per page (rope_page_tm.cuh: a scale, or a
    scale and zero point, per channel or channel pair, folded into the query of each 16-token block), or None."""
    r = layout.token.fmt.rope
    if r.mode not in ("affine", "symmetric") or r.bits not in (2, 4) or r.meta_dtype != "float16":
        return "2- or 4-bit affine or symmetric codes with fp16 metadata"
    if r.group_size not in (1, 2):
        return "groups of one or two channels"
    blk = layout.rope_meta_block
    if blk % 16 or not layout.tile_covers_rope_sets(TM_BLOCK_N):
        return (f"a metadata set per {blk} tokens: a warp's 16-token block must lie in one set, and a "
                f"{TM_BLOCK_N}-token tile cover whole sets or lie in one")
    return None


def smem_bytes_tm(layout: PageLayout, stages: int, p_buffers: int = TM_P_BUFFERS, blocks_per_warp: int = 1,
                  specialized: bool = False) -> int:
    """Dynamic shared memory of one tokens-as-M CTA whose warps take `blocks_per_warp` token blocks each (with
    `specialized`, the scores' and the output's warps apart: each P buffer's row factors), bytes: the map of
    mla_decode_tm.cu (which asserts it)."""
    tok = layout.token
    fb = tok.field_bytes
    a16 = lambda n: (n + 15) // 16 * 16  # noqa: E731
    bn, bm, cg = TM_BLOCK_N, 16, tok.d_c // tok.fmt.content.group_size
    ng = cg + (0 if is_fp8(layout) or tok.fmt.rope.per_page else tok.d_r // tok.fmt.rope.group_size)
    stage = a16(a16(a16(bn * fb["content_codes"]) + bn * fb["rope_codes"]) + bn * fb["content_meta"])
    stage = a16(stage + layout.tile_rope_meta_bytes(bn))
    head = a16(bm * (tok.d_c + tok.d_r + 8) * 2 + ng * bm * 4 + bm * 4 + p_buffers * cg * bm * (bn + 8) * 2)
    # two warps a token group: the partial scores they hand each other
    exchange = TM_WARPS * 32 * 16 * blocks_per_warp if blocks_per_warp == 2 else 0
    factors = p_buffers * (bm + 4) * 4 if specialized else 0
    return head + stages * stage + TM_TOKEN_BLOCKS * bm * (1 + cg) * 4 + exchange + factors + 8 * stages


def tokens_m_ws_min_tokens(layout: PageLayout) -> int:
    """The fewest tokens a work unit needs for the API to keep integer codes on the warps-apart plan (shorter units
    take the 4-warp plan): TM_WS_MIN_TOKENS for 4-bit content codes; 0 for 2-bit, whose warps-apart plan (3 stages,
    TM_WS_2BIT_STAGES) reads short units faster than the 4-warp plan in CUDA graphs of 27 layers on an H100: 9.01
    against 9.29 µs a layer at 8 x 2048 (128-token units), 10.69 against 10.83 at 16 x 1536 (128), 13.08 against 13.42
    at 32 x 1536 (192), 15.05 against 15.47 at 16 x 4096 (256)
    (lab/results/kernels/decode_in_graph_three_ctas_h100.json; on 6 stages the 4-warp plan is ahead by 0.1 to 0.4 µs,
    decode_in_graph_warps_apart_h100.json)."""
    return TM_WS_MIN_TOKENS if layout.token.fmt.content.bits == 4 else 0


def tokens_m_default_blocks(layout: PageLayout) -> int:
    """The token blocks a warp's scores take by default in the 4-warp plans: 2 for 4-bit content codes, 1 for 2-bit
    (measured on the H200, docs/decode_tokens_m.md "Two token blocks a warp"); with the warps apart, 1."""
    return 2 if layout.token.fmt.content.bits == 4 and not is_fp8(layout) else 1


def tokens_m_plan(layout: PageLayout, rows: int, out_dtype: torch.dtype, ctas_per_sm: int = 2,
                  blocks_per_warp: int | None = None, specialized: bool | None = None,
                  s8_scores: bool = False, scale_vote: bool = False) -> DecodePlan | str:
    """The tokens-as-M build for `layout` (or why there is none): 4 warps whose scores take `blocks_per_warp` blocks
    of 16 tokens each (1: a warp's scores over all 576 channels of 16 tokens; 2: two warps split the channels of 32
    tokens, so each query fragment read from shared memory serves 32 tokens, and each finishes 8 rows' softmax;
    None: `tokens_m_default_blocks`), the most stages (up to TM_MAX_STAGES; TM_WS_2BIT_STAGES for 2-bit content codes
    with the warps apart at two CTAs an SM) that fit `ctas_per_sm` CTAs per SM
    (registers are capped to match: 2 CTAs allow 255 a thread, 3 allow 168). `specialized`: 8 warps, 4 that take
    the scores, the softmax and P and 4 that take the output products a tile behind (WS; 2 CTAs allow 128 registers
    a thread); None: `specialized` for integer codes where it fits at up to two CTAs an SM (the register split it
    was measured with), else not (measured on the H200: 1 to 4 % faster than 4 warps, docs/decode_tokens_m.md "The
    scores' and the output's warps apart"). With the warps apart, 2-bit content codes and two CTAs an SM (INT2/INT4's
    default), the scores' warps refill each stage before a tile's scores (SCORES_REFILL=2: 1.5 to 4 % faster on an H100;
    INT4/INT4 1 to 4.4 % slower, so there the output warps refill). 2-bit content codes take a copy a section a stage
    (one copy of the page measured 2 to 6 % slower with the warps apart); the other formats one bulk copy of a 64-token
    page (WHOLE_PAGE, the kernel's default: as fast or up to 2.9 % faster), docs/decode_tokens_m.md "Who refills the
    stages" and "A stage in one copy". `scale_vote`: each token's P also held under 65504 / its largest content scale
    (SCALE_VOTE), for content scales past TM_MAX_CONTENT_SCALE up to TM_VOTE_MAX_CONTENT_SCALE. `s8_scores` (INT4/INT4
    or INT2/INT4 with groups 128/64, the warps apart, a block a warp): the scores' products as 8-bit warpgroup MMAs on
    the query in two s8 terms (S8_QK); not the default (not yet measured on the H200, docs/kernels.md "What is
    next")."""
    why = tokens_m_reason(layout, rows)
    if why:
        return why
    if specialized is None:
        apart = not is_fp8(layout) and ctas_per_sm <= 2
        if s8_scores:  # only with the warps apart: asked for, never dropped
            return tokens_m_plan(layout, rows, out_dtype, ctas_per_sm, blocks_per_warp, True, True, scale_vote)
        plan = tokens_m_plan(layout, rows, out_dtype, ctas_per_sm, blocks_per_warp, True,
                             scale_vote=scale_vote) if apart else None
        return plan if isinstance(plan, DecodePlan) else tokens_m_plan(layout, rows, out_dtype, ctas_per_sm,
                                                                       blocks_per_warp, False, scale_vote=scale_vote)
    if blocks_per_warp is None:  # (with the warps apart one block a warp measured faster on the H200)
        blocks_per_warp = 1 if specialized else tokens_m_default_blocks(layout)
    if blocks_per_warp not in (1, 2):
        return f"{blocks_per_warp} token blocks a warp: the tokens-as-M kernel takes 1 or 2"
    if blocks_per_warp == 2 and is_fp8(layout):
        return "FP8 with two token blocks a warp: its stages leave no room for the partial scores' exchange"
    if specialized and is_fp8(layout):
        return "FP8 with the scores' and the output's warps apart: not built (its stages leave no room)"
    if s8_scores and scale_vote:
        return "the scores on 8-bit warpgroup MMAs with the scale vote: not built"
    if s8_scores:
        f = layout.token.fmt
        if not specialized or blocks_per_warp != 1:
            return ("the scores on 8-bit warpgroup MMAs: with the scores' and the output's warps apart, one token "
                    "block a warp")
        if (f.content.bits not in (2, 4) or f.rope.per_page
                or (f.rope.bits, f.content.group_size, f.rope.group_size) != (4, 128, 64)):
            return ("the scores on 8-bit warpgroup MMAs read INT4/INT4 or INT2/INT4 with groups 128/64, not "
                    f"{f.content.describe()} + {f.rope.describe()}")

    def fits(p_buffers: int, least: int) -> list[int]:
        return [s for s in range(TM_MAX_STAGES, least - 1, -1)
                if ctas_per_sm * (smem_bytes_tm(layout, s, p_buffers, blocks_per_warp, specialized) + SMEM_RESERVED)
                <= SMEM_PER_SM]

    # one barrier a tile (two P buffers, a stage refilled two tiles after its scores) where 3 stages fit, else
    # the vote and a barrier after P (one buffer, a stage refilled after the next tile's vote)
    p_buffers, stages = TM_P_BUFFERS, fits(TM_P_BUFFERS, TM_MIN_STAGES)
    if not stages and not specialized:
        p_buffers, stages = 1, fits(1, 2)
    if not stages:
        return f"the stages do not fit {ctas_per_sm} CTAs per SM in shared memory"
    tok, o = layout.token, layout.offsets
    fb = tok.field_bytes
    stages = stages[0]
    if specialized and tok.fmt.content.bits == 2 and ctas_per_sm == 2 and not s8_scores:  # as measured
        stages = min(stages, TM_WS_2BIT_STAGES)
    smem = smem_bytes_tm(layout, stages, p_buffers, blocks_per_warp, specialized)
    macros = dict(
        TM=1, D_C=tok.d_c, D_R=tok.d_r, PS=layout.page_size, PAGE_BYTES=layout.page_bytes,
        OFF_CC=o["content_codes"], OFF_RC=o["rope_codes"], OFF_CM=o["content_meta"],
        OFF_RM=o["rope_page_meta"] if tok.fmt.rope.per_page else o["rope_meta"],
        FB_CC=fb["content_codes"], FB_RC=fb["rope_codes"], FB_CM=fb["content_meta"], FB_RM=fb["rope_meta"],
        C_BITS=tok.fmt.content.bits, C_GS=tok.fmt.content.group_size, R_BITS=tok.fmt.rope.bits,
        R_GS=tok.fmt.rope.group_size, HALF=1, NW=TM_WARPS * (2 if specialized else 1), BN=TM_BLOCK_N, STAGES=stages,
        OUT_KIND=_OUT[out_dtype], SMEM_EXPECTED=smem, MIN_CTAS=ctas_per_sm, ONE_BARRIER=int(p_buffers == 2),
        **partial_macros(layout),
    )
    if blocks_per_warp != 1:
        macros["TPW"] = blocks_per_warp
    if specialized:  # two CTAs an SM: 128 registers a thread, the scores' warps take 152 of the output's
        macros.update(WS=1, **({"WS_REGS": TM_WS_SCORE_REGS} if ctas_per_sm == 2 else {}))
        if tok.fmt.content.bits == 2 and ctas_per_sm == 2 and not s8_scores:  # as measured (S8_QK: no registers
            macros["SCORES_REFILL"] = 2  # to spare): the scores' warps refill
    if tok.fmt.content.bits == 2:  # a copy a section (one copy of the page: 2-6 % slower with the warps apart; the
        macros["WHOLE_PAGE"] = 0   # other 2-bit plans not measured with one copy)
    if is_fp8(layout):
        macros["C_FP8"] = 1
    if tok.fmt.rope.per_page:  # absent otherwise: the per-token formats' builds stay as they are
        macros.update(R_PAGE=1, PMB_R=layout.rope_meta_set_bytes)
        if layout.rope_meta_block != layout.page_size:
            macros["R_BLK"] = layout.rope_meta_block
        if tok.fmt.rope.mode == "symmetric":
            macros["R_FLD"] = 1
    if s8_scores:
        macros["S8_QK"] = 1
    if scale_vote:
        macros["SCALE_VOTE"] = 1
    return DecodePlan(tuple(sorted(macros.items())), 16, stages, ctas_per_sm, smem)
