// Absorbed-MLA decode over the packed paged cache with tokens as the MMA's M dimension (sm_90: the stages are
// bulk copies). The 16-row plan for 2- or 4-bit codes with fp16 (scale, zero) metadata.
//
// One CTA of 4 warps handles one work unit (sequence b, tokens [start, end)) for 16 query rows. Per tile of
// BN = 64 tokens (one page section each, bulk-copied by one thread into STAGES stages):
//
//   scores  Sᵀ[token, row] = K·Qᵀ. With TPW = 1 warp w owns token block w (tokens 16w .. 16w + 15) over all 576
//           channels. With TPW = 2 warp w owns blocks 2·(w % 2) and 2·(w % 2) + 1 over half the channels (w / 2:
//           the first half of the content blocks, or the rest and the RoPE key), so each query fragment read
//           from shared memory serves 32 tokens; the two warps of a token group hand each other the partial
//           scores of the rows they do not finish (a barrier of the two), and each finishes 8 rows. The A operand
//           (16 tokens x 16 channels) is the stage's codes masked in place: a code at bit offset o of a
//           16-bit half is the exact fp16 subnormal code·2^(o-24), one AND a register. The B operand is the
//           query block, stored once per CTA in the codes' channel order. Each 64-channel block lies in one
//           metadata group, so a group's products sum on their own accumulators and the token's scale folds
//           in once per group, in fp32; the zero points act through the query's per-group sums.
//   softmax base 2, in registers: a row's reference maximum moves only when a tile exceeds it by more than
//           2^8 (one CTA vote a tile; only then are the rows' maxima exchanged). P·scale of each content
//           group (fp16) goes to shared memory; P·zero is summed per group in fp32.
//   output  Oᵀ[channel, row] = Cᵀ·(P·scale)ᵀ: warp w owns 128 channels (a quarter of every code plane's
//           bytes). The A operand pairs two tokens' codes of one channel with one byte permute; the B operand
//           is the group's P·scale. The zero points' sums and the codes' 2^(24-o) join in the epilogue.
//
// Per token the stage's codes are read twice from shared memory (once a product) and nothing is built. With
// ONE_BARRIER (the default) an iteration runs the scores of tile i, the vote (the one barrier), the output of
// tile i - 1 and P of tile i into the other of two P buffers; a stage is refilled two tiles after its scores.
// Without it, the output of tile i - 1 and the scores of tile i, the vote, P of tile i and a second barrier.
// With WS (the default for integer codes) the CTA has 8 warps: warps 0-3 run the scores, the vote and P of each tile,
// warps 4-7 (one warpgroup) its output products a tile behind, the same arithmetic in the same order. With S8_QK
// (INT4/INT4 or INT2/INT4 with WS; not a default) the scores' warps issue their products as 8-bit warpgroup MMAs on the query in
// two s8 terms (scores_s8.cuh, query_s8.cuh).
//
// Macros (quantmla.kernels.cuda): D_C D_R PS PAGE_BYTES OFF_CC OFF_RC OFF_CM OFF_RM FB_CC FB_RC FB_CM FB_RM
//   C_BITS C_GS R_BITS R_GS STAGES OUT_KIND SMEM_EXPECTED ONE_BARRIER MIN_CTAS TPW WS WS_REGS S8_QK NW (4, or 8 with WS)
//   SCORES_REFILL WHOLE_PAGE (who refills a stage with WS, and whether a 64-token page is one copy: below)
//   R_PAGE PMB_R R_BLK R_FLD (the RoPE path's metadata is the page's sets: page_sets.cuh, rope_page_tm.cuh)
//   (and TM, BN, HALF: fixed here)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef __half T;
typedef __half2 T2;
#define MMA_TYPE "f16"

#include "ptx.cuh"
#include "out_io.cuh"
#define WG_AB "f16"
#include "wgmma.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "the tokens-as-M decode kernel copies its stages with sm_90 bulk copies"
#endif

#ifndef MIN_CTAS
#define MIN_CTAS 2
#endif
// ONE_BARRIER (default): one CTA barrier a tile, P·scale double-buffered; 0: the vote and a barrier after P
#ifndef ONE_BARRIER
#define ONE_BARRIER 1
#endif
constexpr int NPBUF = ONE_BARRIER ? 2 : 1;  // P·scale buffers
static_assert(!ONE_BARRIER || STAGES >= 3, "a stage is refilled two tiles after its scores");
#include "timeline_tm.cuh"

// WS (warp specialization): 8 warps, the first NWR = 4 take the scores, the softmax and P of each tile, the other 4
// its output products, a tile behind; the P·scale buffers pass between them on named barriers (full, empty) and the
// output warps refill a stage once both have read it
#ifndef WS
#define WS 0
#endif
constexpr int NWR = WS ? NW / 2 : NW;  // warps of a role (with WS: scores, or output); without WS every warp has both
static_assert(NWR == 4 && BN == 64 && HALF == 1, "the plan of this kernel: 4 warps a role, 64-token tiles, fp16 operands");
constexpr int BM = 16;                 // query rows per CTA
constexpr int NT = 32 * NW;
constexpr int NTR = 32 * NWR;          // threads of a role
// named barriers: 0 the CTA's, 1 and 2 the two warps of a token group (TPW = 2); with WS the scores' warps' vote (3)
// and reference move (9), the output warps (4), a P buffer's full (5 + buffer: the scores' warps arrive) and empty
// (7 + buffer: the output warps arrive), and with WS_REGS the scores' warps' registers given back after the loop (10)
enum : int { BAR_SCORES = 3, BAR_OUTPUT = 4, BAR_FULL = 5, BAR_EMPTY = 7, BAR_MOVE = 9, BAR_REGS = 10 };
// WS_REGS (with WS at two CTAs an SM, 128 registers a thread): the scores' warps take WS_REGS registers for the tile
// loop and the output warps 256 - WS_REGS (setmaxnreg); 0: both keep 128
#ifndef WS_REGS
#define WS_REGS 0
#endif
// WS_KEEP (timing experiments only): with WS_REGS, each role keeps its budget through the epilogue (no registers handed
// back after the tile loop); the shared epilogue then compiles within the output warps' 256 - WS_REGS and spills
#ifndef WS_KEEP
#define WS_KEEP 0
#endif
static_assert(WS_REGS == 0 || (WS && WS_REGS % 8 == 0 && WS_REGS > 128 && WS_REGS <= 232), "setmaxnreg's steps");
template <int N, bool INC>
__device__ __forceinline__ void set_max_regs() {
  if constexpr (INC) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
// SCORES_REFILL (with WS): thread 0, of the scores' warps, refills a stage as soon as it has waited for the output warps
// to empty the P buffer of that stage's tile (every warp is then past the stage): after a tile's scores (1) or before
// them (2); 0: the output warps meet on a barrier after each tile and their first thread refills it
#ifndef SCORES_REFILL
#define SCORES_REFILL 0
#endif
static_assert(!SCORES_REFILL || WS, "the scores' warps refill the stages only where the warps are apart");
static_assert(!WS || ONE_BARRIER, "with WS, P·scale is double-buffered");
static_assert(!WS || !PHASES, "the phases are thread 0's, one warp of the scores");
#ifndef TPW
#define TPW 1
#endif
constexpr int NTB = BN / 16;           // the scores' token blocks of 16 (4)
constexpr int NGRP = NTB / TPW;        // token groups of TPW blocks: warp w takes blocks TPW·(w % NGRP) + i, i < TPW
constexpr int KS = NWR / NGRP;         // warps sharing a token group's scores, each over its share of the channels
constexpr int NB_OWN = 2 / KS;         // 8-row blocks whose softmax a warp finishes: nb0 = w / NGRP (KS = 2) ..
constexpr int RI = 2 * NB_OWN;         // .. a thread's own query rows ri: 8·(nb0 + (ri >> 1)) + 2t + (ri & 1)
static_assert((TPW == 1 || TPW == 2) && (KS == 1 || KS == 2), "a warp takes 1 or 2 token blocks, 1 or 2 warps a group");
constexpr int D = D_C + D_R;
#ifndef C_FP8
#define C_FP8 0  // fp8_ds_mla: e4m3 content (C_BITS 8) with an fp32 scale a group, the RoPE key in bf16 (R_BITS 16)
#endif
constexpr int NPC = C_FP8 ? 1 : 8 / C_BITS;  // planes of a content byte
constexpr int NPR = C_FP8 ? 1 : 8 / R_BITS;  // planes of a RoPE byte (FP8: one plane of bf16 values)
constexpr int CG = D_C / C_GS;         // content groups
#include "page_sets.cuh"  // R_PAGE (a set: an fp16 scale, R_FLD 1, or (scale, zero), R_FLD 2, per group of R_GS)
#ifndef R_FLD
#define R_FLD 2
#endif
constexpr int RG = C_FP8 || R_PAGE ? 0 : D_R / R_GS;  // per-token RoPE groups (FP8: none, the key is stored as it is)
constexpr int NG = CG + RG;
constexpr int CKS = D_C / 16;          // content k-steps of 16 channels
constexpr int RW = FB_RC / 16;         // RoPE words a thread reads per token
constexpr int LDQ = D + 8;             // query block row pitch (halves): 8 rows' ldmatrix pieces in distinct banks
constexpr int LDP = BN + 8;            // P·scale row pitch (halves)
constexpr int BW = FB_CC / NWR;        // output: content bytes a warp owns per token
constexpr int BT = BW / 8;             // output: content bytes a thread reads per token (8 at 4 bits, 4 at 2)
constexpr int OMB = NPC * BT / 2;      // output: m16 channel blocks a warp owns (8)
static_assert(D_C == 512 && D_R == 64, "DeepSeek's cache geometry");
static_assert(C_FP8 ? C_BITS == 8 && R_BITS == 16 : (C_BITS == 2 || C_BITS == 4) && (R_BITS == 2 || R_BITS == 4),
              "2- or 4-bit codes on both paths, or e4m3 content and a bf16 RoPE key");
static_assert(C_GS % (C_FP8 ? 128 : 64) == 0, "a 64-channel block of one content plane (a warp's output) lies in one group");
static_assert(C_FP8 || R_PAGE || (R_GS % FB_RC == 0 && D_R % R_GS == 0), "a RoPE plane lies in one group");
static_assert(!R_PAGE || (!C_FP8 && R_BLK % 16 == 0 && PMB_R == D_R / R_GS * R_FLD * 2 && PMB_R % 16 == 0),
              "a page's RoPE sets: fp16 metadata, a whole number of a tile's 16-token blocks a set, 16-byte sets");
static_assert(FB_CM == CG * 4 && FB_RM == RG * 4, "per group an fp16 (scale, zero), or an fp32 scale");
static_assert(!C_FP8 || TPW == 1, "FP8 stages leave no room for the partial scores' exchange");
static_assert(OMB == 8 && BT % 4 == 0, "a warp's output channels are 8 m16 blocks");
static_assert(BT == 16 || !C_FP8, "FP8: a thread reads 16 content bytes of a token for the output");
static_assert(KS == 1 || (FB_CC / 64) % 2 == 0, "two warps split a token block's content channels in 64-byte blocks");
static_assert(PS % BN == 0, "a tile lies inside one page");

__host__ __device__ constexpr int align16(int n) { return (n + 15) / 16 * 16; }
constexpr int RAW_CC = 0;
constexpr int RAW_RC = align16(RAW_CC + BN * FB_CC);
constexpr int RAW_CM = align16(RAW_RC + BN * FB_RC);
constexpr int RAW_RM = align16(RAW_CM + BN * FB_CM);
constexpr int TILE_BYTES = BN * (FB_CC + FB_RC + FB_CM) + RM_BYTES;
constexpr int RAW_BYTES = align16(RAW_RM + RM_BYTES);
// WHOLE_PAGE (default 1): where a tile is a whole page whose sections lie where the stage's do (pages of BN tokens),
// a stage is one bulk copy of the page's first PAGE_COPY bytes; 0, or any other page: four copies, one a section
#ifndef WHOLE_PAGE
#define WHOLE_PAGE 1
#endif
constexpr int PAGE_COPY = RM_BYTES > 0 ? RAW_RM + RM_BYTES : RAW_CM + BN * FB_CM;  // the stage's last section's end
constexpr bool PAGE_AS_STAGE = WHOLE_PAGE && PS == BN && OFF_CC == RAW_CC && OFF_RC == RAW_RC && OFF_CM == RAW_CM &&
                               (RM_BYTES == 0 || OFF_RM == RAW_RM) && PAGE_COPY % 16 == 0 && PAGE_COPY <= PAGE_BYTES;

// shared memory map (bytes)
constexpr int SM_Q = 0;                                  // [BM, LDQ] fp16, channels in the codes' order
constexpr int SM_QSUM = SM_Q + BM * LDQ * 2;             // [NG, BM] fp32: Σ_group q · qk_scale·log2 e
constexpr int SM_QF = SM_QSUM + NG * BM * 4;             // [BM] fp32: qk_scale·log2 e / the row's fp16 scaling
constexpr int P_ELEMS = CG * BM * LDP;
constexpr int SM_P = SM_QF + BM * 4;                     // [NPBUF][CG, BM, LDP] fp16: P·scale, tokens in the output's k order
constexpr int SM_RAW = align16(SM_P + NPBUF * P_ELEMS * 2);
constexpr int SM_RED = SM_RAW + STAGES * RAW_BYTES;      // [NTB, BM, 1 + CG] fp32: cross-warp reductions
constexpr int SM_X = SM_RED + NTB * BM * (1 + CG) * 4;   // TPW = 2: [NW, 32, TPW] float4, the partial scores handed over
// WS: [NPBUF][BM + 4] fp32, a P buffer's rows' rescale factors and then whether any row moved
constexpr int SM_A = SM_X + (KS == 2 ? NWR * 32 * TPW * 16 : 0);
constexpr int SM_BAR = SM_A + (WS ? NPBUF * (BM + 4) * 4 : 0);  // an mbarrier per stage
constexpr int SMEM_BYTES = SM_BAR + 8 * STAGES;
static_assert(SMEM_BYTES == SMEM_EXPECTED, "the host's shared-memory size agrees with this map");

#include "query_pieces.cuh"
#include "query_s8.cuh"
#include "query_tm.cuh"

// content code byte `col` of token row `row` of a stage
__device__ __forceinline__ const uint8_t* cc_at(const uint8_t* st, int row, int col) { return st + RAW_CC + row * FB_CC + col; }

// the stage of tile n0 (a multiple of BN, inside page `page`), completing on `bar`: one bulk copy where the page is the
// stage (PAGE_AS_STAGE), else four, one a section
__device__ __forceinline__ void issue_stage(uint8_t* stage, uint64_t* bar, const uint8_t* __restrict__ pages, int page,
                                            int n0) {
  const int tok0 = n0 % PS;
  const uint8_t* pg = pages + (int64_t)page * PAGE_BYTES;
#if BULK
  if constexpr (PAGE_AS_STAGE) {
    mbar_expect_tx(bar, PAGE_COPY);
    bulk_g2s(stage, pg, PAGE_COPY, bar);
  } else {
    mbar_expect_tx(bar, TILE_BYTES);
    bulk_g2s(stage + RAW_CC, pg + OFF_CC + tok0 * FB_CC, BN * FB_CC, bar);
    bulk_g2s(stage + RAW_RC, pg + OFF_RC + tok0 * FB_RC, BN * FB_RC, bar);
    bulk_g2s(stage + RAW_CM, pg + OFF_CM + tok0 * FB_CM, BN * FB_CM, bar);
    if constexpr (RM_BYTES > 0) bulk_g2s(stage + RAW_RM, pg + OFF_RM + rm_offset(tok0), RM_BYTES, bar);
  }
#endif
}

#include "scores_tm.cuh"
#include "scores_s8.cuh"
#include "softmax_tm.cuh"
#include "output_tm.cuh"

extern "C" __global__ void __launch_bounds__(NT, MIN_CTAS) mla_decode(MLA_DECODE_PARAMS) {
  extern __shared__ __align__(128) uint8_t smem[];
  T* sQ = reinterpret_cast<T*>(smem + SM_Q);
  float* sQsum = reinterpret_cast<float*>(smem + SM_QSUM);
  float* sQf = reinterpret_cast<float*>(smem + SM_QF);
  T* sP = reinterpret_cast<T*>(smem + SM_P);
  float* sRed = reinterpret_cast<float*>(smem + SM_RED);
  uint64_t* sBar = reinterpret_cast<uint64_t*>(smem + SM_BAR);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int u = blockIdx.x, row0 = blockIdx.y * BM;
  uint64_t tl[2 * NMARK] = {};  // TIMELINE: (globaltimer ns, clock64) at the marks
  mark(tl, 0);
  const int b = units[4 * u], start = units[4 * u + 1], end = units[4 * u + 2], nsplit = units[4 * u + 3];
  const int L = seq_lens[b];
  const int* bt_row = block_table + (int64_t)b * stride_bt;
  const int ntiles = (end - start + BN - 1) / BN;
  auto page_of = [&](int it) { return it < ntiles ? __ldg(bt_row + (start + it * BN) / PS) : 0; };

  // ---- the query pieces' loads; thread 0 then reads the first tiles' page numbers and issues their copies, and
  // each warp writes its rows of the query block on its own (no barrier until the block is whole) ---------------
  // (with WS the scores' warps write the block and thread 0 fills every stage; the output warps refill them, and
  // their first thread reads the page after those, or with SCORES_REFILL thread 0 goes on refilling them)
  const bool scoring = !WS || warp < NWR;
  uint4 qv[RPW][CPL], qrv;
  if (scoring) load_query_rows(qc, qr, qv, qrv, b, R, row0, warp, lane);
  mark(tl, 1);
  int pg_next = 0;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(sBar + s, 1);
    mbar_fence_init();
    pg_next = start_tiles<STAGES + WS>(ntiles, page_of, [&](int s, int pg) {
      issue_stage(smem + SM_RAW + s * RAW_BYTES, sBar + s, pages, pg, start + s * BN);
    });
  }
  if (WS && !SCORES_REFILL && tid == NTR) pg_next = page_of(STAGES);
  mark(tl, 2);
  if (scoring) write_query_rows(qv, qrv, sQ, sQsum, sQf, qk_scale_log2, warp, lane);
  if constexpr (S8_QK) fence_proxy_async();  // the s8 query block, visible to the warpgroup MMAs
  __syncthreads();  // the query block, its sums and factors are written (and the barriers initialised)
  mark(tl, 3);

  // ---- per thread: its own rows ri -> query row 8·(nb0 + (ri >> 1)) + 2t + (ri & 1) (the softmax's), and every
  // row's reference maximum ref[ri] (row 8·(ri >> 1) + 2t + (ri & 1): the output accumulators' columns) ----------
  const int tp = warp % NGRP, nb0 = warp / NGRP;  // the warp's token group, its first own 8-row block
  float qf[RI], qsum[NG][RI], ref[4], mref[RI], l_run[RI], zacc[CG][RI];
  int limit[RI];
#pragma unroll
  for (int ri = 0; ri < RI; ++ri) {
    const int row = 8 * (nb0 + (ri >> 1)) + 2 * t + (ri & 1);
    qf[ri] = sQf[row];
#pragma unroll
    for (int grp = 0; grp < NG; ++grp) qsum[grp][ri] = sQsum[grp * BM + row];
    l_run[ri] = 0.0f;
#pragma unroll
    for (int grp = 0; grp < CG; ++grp) zacc[grp][ri] = 0.0f;
    limit[ri] = L - causal * (SQ - 1 - (row0 + row) / H);
  }
#pragma unroll
  for (int ri = 0; ri < 4; ++ri) ref[ri] = -INFINITY;
  own_reference(ref, mref, nb0);
  float oacc[OMB][2][4];
  [[maybe_unused]] float alpha_unused[4];  // without WS move_reference rescales oacc itself
  zero_acc(oacc);
  // the query fragments: ldmatrix rows (8·(i >> 1) + lane % 8) and halves 8·(i & 1) of a k-step, i = lane / 8
  const T* qa = sQ + (8 * ((lane >> 3) >> 1) + (lane & 7)) * LDQ + 8 * ((lane >> 3) & 1);
  const int tok_lo = 16 * TPW * tp + g;  // the scores' rows: tokens tok_lo + 16i and tok_lo + 16i + 8 of the tile
  float4* sX = reinterpret_cast<float4*>(smem + SM_X);

  // the own rows' scores of a tile (stage st): with KS = 2 the warp's half of the channels, the other warp's half of
  // its own rows taken over through sX (a barrier of the two warps), then finished
  auto own_scores = [&](const uint8_t* st, float (&sc)[TPW][NB_OWN][4], int valid, int n0) {
#if S8_QK
    tile_scores_s8(st, smem + SM_Q, tok_lo, t, sc);
#else
    float part[TPW][2][4];
    if constexpr (KS == 1) {
      tile_scores<0>(st, qa, tok_lo, t, part);
#pragma unroll
      for (int i = 0; i < TPW; ++i)
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[i][nb][e] = part[i][nb][e];
    } else {
      if (nb0) tile_scores<1>(st, qa, tok_lo, t, part);
      else tile_scores<0>(st, qa, tok_lo, t, part);
      const int give = nb0 ? 0 : 1;  // the other warp's rows
#pragma unroll
      for (int i = 0; i < TPW; ++i)
        sX[(warp * 32 + lane) * TPW + i] = make_float4(give ? part[i][1][0] : part[i][0][0], give ? part[i][1][1] : part[i][0][1],
                                                       give ? part[i][1][2] : part[i][0][2], give ? part[i][1][3] : part[i][0][3]);
      bar_sync(1 + tp, 64);
#pragma unroll
      for (int i = 0; i < TPW; ++i) {
        const float4 y = sX[((warp ^ NGRP) * 32 + lane) * TPW + i];
        const float yv[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[i][0][e] = (nb0 ? part[i][1][e] : part[i][0][e]) + yv[e];
      }
    }
#endif
#pragma unroll
    for (int i = 0; i < TPW; ++i) finish_scores(st, sc[i], qf, qsum, limit, tok_lo + 16 * i, valid, n0);
  };

#if WS
  // The scores' warps: tile it's scores, their vote (BAR_SCORES), P of tile it into buffer it % 2 once the output
  // warps have emptied it, with the rows' rescale factors where a reference moved; then full. The output warps: tile
  // it's products once its buffer is full (its rows rescaled first where the buffer says so), empty, and thread NTR
  // refills the stage with tile it + STAGES once every output warp is past it (the scores' warps were, at full); with
  // SCORES_REFILL thread 0 refills it once the scores' warps have waited for that buffer to be empty.
  if (scoring) {
    if constexpr (WS_REGS) set_max_regs<WS_REGS, true>();
    for (int it = 0; it < ntiles; ++it) {
      const int n0 = start + it * BN, valid = min(BN, end - n0), buf = it & 1;
      uint8_t* st = smem + SM_RAW + (it % STAGES) * RAW_BYTES;
      float sc[TPW][NB_OWN][4], alpha[4];
      // the output warps are past tile it - NPBUF (its P buffer is empty): with SCORES_REFILL its stage takes the tile
      // STAGES on, waited for before this tile's scores (2) or after them (1)
      auto empty_and_refill = [&]() {
        if (it < NPBUF) return;
        bar_sync(BAR_EMPTY + buf, NT);
        if (SCORES_REFILL && tid == 0) {
          const int nxt = it - NPBUF + STAGES;
          if (nxt < ntiles) issue_stage(smem + SM_RAW + (nxt % STAGES) * RAW_BYTES, sBar + nxt % STAGES, pages, pg_next,
                                        start + nxt * BN);
          pg_next = page_of(nxt + 1);
        }
      };
      if (SCORES_REFILL == 2) empty_and_refill();
      mbar_wait(sBar + it % STAGES, (it / STAGES) & 1);
      if (it == 0) mark(tl, 4);
      if (valid < BN) zero_past_end(st, valid, tid);
      own_scores(st, sc, valid, n0);
      float lim[TPW][2];
      p_limits(st, tok_lo, lim);
      const bool moved = bar_or(BAR_SCORES, NTR, exceeds_reference(sc, mref, lim, true));
      if (moved) move_reference(sc, lim, ref, mref, l_run, zacc, oacc, alpha, sRed, tp, nb0, g, t);
      if (SCORES_REFILL != 2) empty_and_refill();
      float* sA = reinterpret_cast<float*>(smem + SM_A) + buf * (BM + 4);
      if (warp == 0 && g == 0 && moved) {
#pragma unroll
        for (int ri = 0; ri < 4; ++ri) sA[8 * (ri >> 1) + 2 * t + (ri & 1)] = alpha[ri];
      }
      if (tid == 0) sA[BM] = moved ? 1.0f : 0.0f;
#pragma unroll
      for (int i = 0; i < TPW; ++i)
        tile_probabilities(st, sP + buf * P_ELEMS, sc[i], mref, l_run, zacc, TPW * tp + i, nb0, g, t, tok_lo + 16 * i);
      bar_arrive(BAR_FULL + buf, NT);
    }
    if constexpr (WS_REGS && !WS_KEEP) {
      set_max_regs<128, false>();
      bar_arrive(BAR_REGS, NT);  // their registers are back in the CTA's pool
    }
  } else {
    if constexpr (WS_REGS) set_max_regs<256 - WS_REGS, false>();
    for (int it = 0; it < ntiles; ++it) {
      const int n0 = start + it * BN, buf = it & 1;
      bar_sync(BAR_FULL + buf, NT);
      const float* sA = reinterpret_cast<const float*>(smem + SM_A) + buf * (BM + 4);
      if (sA[BM] != 0.0f) {
#pragma unroll
        for (int ri = 0; ri < 4; ++ri) rescale_rows(oacc, ri, sA[8 * (ri >> 1) + 2 * t + (ri & 1)]);
      }
      if (!SKIP_PV)
        tile_output(smem + SM_RAW + (it % STAGES) * RAW_BYTES, sP + buf * P_ELEMS, oacc, warp - NWR, g, t, lane,
                    min(BN, end - n0));
      if (it + NPBUF < ntiles) bar_arrive(BAR_EMPTY + buf, NT);  // (the scores' warps wait only for those)
      if constexpr (SCORES_REFILL) continue;
      bar_sync(BAR_OUTPUT, NTR);
      if (tid == NTR) {
        const int nxt = it + STAGES;
        if (nxt < ntiles) issue_stage(smem + SM_RAW + (nxt % STAGES) * RAW_BYTES, sBar + nxt % STAGES, pages, pg_next,
                                      start + nxt * BN);
        pg_next = page_of(nxt + 1);
      }
    }
    // Back to 128 once the scores' warps have given theirs back: in a unit without tiles these warps would otherwise
    // take their registers back before the scores' warps had taken theirs, and those would wait for them for ever
    if constexpr (WS_REGS && !WS_KEEP) {
      bar_sync(BAR_REGS, NT);
      set_max_regs<128, true>();
    }
  }
#elif ONE_BARRIER
  // Tile it: its scores, one vote (a barrier: every warp has written P of tile it - 1 and read the stage of
  // tile it - 2 for the last time), the output products of tile it - 1, P of tile it into the other P buffer.
  uint64_t ph[NPHASE + 1] = {};  // PHASES: clocks a phase, and the last clock
  if constexpr (PHASES) ph[NPHASE] = (uint64_t)clock64();
  for (int it = 0; it <= ntiles; ++it) {
    const bool scores = it < ntiles;
    const int n0 = start + it * BN, valid = min(BN, end - n0);
    float sc[TPW][NB_OWN][4], lim[TPW][2];
    if (scores) {
      mbar_wait(sBar + it % STAGES, (it / STAGES) & 1);
      if (it == 0) mark(tl, 4);
      phase(ph, 0);
      if (valid < BN) zero_past_end(smem + SM_RAW + (it % STAGES) * RAW_BYTES, valid, tid);
      own_scores(smem + SM_RAW + (it % STAGES) * RAW_BYTES, sc, valid, n0);
      p_limits(smem + SM_RAW + (it % STAGES) * RAW_BYTES, tok_lo, lim);
      phase(ph, 1);
    }
    const bool moved = __syncthreads_or(exceeds_reference(sc, mref, lim, scores));
    phase(ph, 2);
    if (tid == 0 && it >= 1) {  // the stage of tile it - 2 is free (and, at it = 1, the one never used)
      const int nxt = it + STAGES - 2;
      if (nxt < ntiles) issue_stage(smem + SM_RAW + (nxt % STAGES) * RAW_BYTES, sBar + nxt % STAGES, pages, pg_next,
                                    start + nxt * BN);
      pg_next = page_of(nxt + 1);
    }
    if (it > 0 && !SKIP_PV)
      tile_output(smem + SM_RAW + ((it - 1) % STAGES) * RAW_BYTES, sP + ((it - 1) & 1) * P_ELEMS, oacc, warp, g, t, lane,
                  min(BN, end - (n0 - BN)));
    phase(ph, 3);
    if (!scores) break;
    if (moved) move_reference(sc, lim, ref, mref, l_run, zacc, oacc, alpha_unused, sRed, tp, nb0, g, t);
#pragma unroll
    for (int i = 0; i < TPW; ++i)
      tile_probabilities(smem + SM_RAW + (it % STAGES) * RAW_BYTES, sP + (it & 1) * P_ELEMS, sc[i], mref, l_run, zacc,
                         TPW * tp + i, nb0, g, t, tok_lo + 16 * i);
    phase(ph, 4);
  }
#else
  // Tile it: the output products of tile it - 1 and the scores of tile it in one block without a barrier (the
  // two are independent, so their instructions interleave); then one vote, P of tile it, and a barrier.
  // A stage is read by the scores of its tile and by the output one iteration later.
  for (int it = 0; it <= ntiles; ++it) {
    const bool scores = it < ntiles;
    const int n0 = start + it * BN, valid = min(BN, end - n0);
    float sc[TPW][NB_OWN][4], lim[TPW][2];
    if (it > 0 && !SKIP_PV)
      tile_output(smem + SM_RAW + ((it - 1) % STAGES) * RAW_BYTES, sP, oacc, warp, g, t, lane, min(BN, end - (n0 - BN)));
    if (scores) {
      mbar_wait(sBar + it % STAGES, (it / STAGES) & 1);
      if (it == 0) mark(tl, 4);
      if (valid < BN) zero_past_end(smem + SM_RAW + (it % STAGES) * RAW_BYTES, valid, tid);
      own_scores(smem + SM_RAW + (it % STAGES) * RAW_BYTES, sc, valid, n0);
      p_limits(smem + SM_RAW + (it % STAGES) * RAW_BYTES, tok_lo, lim);
    }
    // ---- one vote: does any row's reference maximum move? (every warp is past its output of tile it - 1) --
    const bool moved = __syncthreads_or(exceeds_reference(sc, mref, lim, scores));
    if (!scores) break;
    if (tid == 0) {  // the stage of tile it - 1 is free: tile it + STAGES - 1 goes into it
      const int nxt = it + STAGES - 1;
      if (nxt < ntiles) issue_stage(smem + SM_RAW + (nxt % STAGES) * RAW_BYTES, sBar + nxt % STAGES, pages, pg_next,
                                    start + nxt * BN);
      pg_next = page_of(nxt + 1);
    }
    if (moved) move_reference(sc, lim, ref, mref, l_run, zacc, oacc, alpha_unused, sRed, tp, nb0, g, t);
#pragma unroll
    for (int i = 0; i < TPW; ++i)
      tile_probabilities(smem + SM_RAW + (it % STAGES) * RAW_BYTES, sP, sc[i], mref, l_run, zacc, TPW * tp + i, nb0, g, t,
                         tok_lo + 16 * i);
    __syncthreads();  // P·scale of the whole tile is written
  }

#endif

  mark(tl, 5);
  // ---- epilogue: the own rows' sums and zero-point sums across lanes and token groups, then
  // O = (2^(24-o)·acc + Σ P·zero) / l for every row of the warp's channels
  __syncthreads();  // every warp is done with sRed's tile maxima
#pragma unroll
  for (int ri = 0; ri < (scoring ? RI : 0); ++ri) {
    const int row = 8 * (nb0 + (ri >> 1)) + 2 * t + (ri & 1);
    float v[1 + CG];
    v[0] = l_run[ri];
#pragma unroll
    for (int grp = 0; grp < CG; ++grp) v[1 + grp] = zacc[grp][ri];
#pragma unroll
    for (int k = 0; k < 1 + CG; ++k) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
      if (g == 0) sRed[(tp * BM + row) * (1 + CG) + k] = v[k];
    }
  }
  __syncthreads();
  float lsum[4];
#pragma unroll
  for (int ri = 0; ri < 4; ++ri) {
    const int row = 8 * (ri >> 1) + 2 * t + (ri & 1);
    lsum[ri] = 0.0f;
#pragma unroll
    for (int w = 0; w < NGRP; ++w) lsum[ri] += sRed[(w * BM + row) * (1 + CG)];
    const int r = row0 + row;
    if (warp == 0 && g == 0 && r < R) {
      const float lv = lsum[ri] > 0.0f ? (ref[ri] + log2f(lsum[ri])) * 0.6931471805599453f : -INFINITY;
      if (nsplit == 1) lse[(int64_t)b * R + r] = lv;
      else part_lse[(int64_t)u * R + r] = lv;
    }
  }
  // Σ P·zero of a row's group over the token groups (the group of a warp's channels depends on the warp: read in place)
  auto zsum = [&](int grp, int row) {
    float z = 0.0f;
#pragma unroll
    for (int w = 0; w < NGRP; ++w) z += sRed[(w * BM + row) * (1 + CG) + 1 + grp];
    return z;
  };
  const int ow = WS ? warp - NWR : warp;  // the warp's output channels (with WS, the output warps' only)
#pragma unroll
  for (int ri = 0; ri < 4; ++ri) {
    const int nb = ri >> 1, e = ri & 1, row = 8 * nb + 2 * t + e, r = row0 + row;
    if (r >= R || (WS && scoring)) continue;
    const float inv = lsum[ri] > 0.0f ? 1.0f / lsum[ri] : 0.0f;
    const int64_t orow = nsplit == 1 ? (int64_t)b * R + r : (int64_t)u * R + r;
#pragma unroll
    for (int mb = 0; mb < OMB; ++mb) {
      const int p = mb / (BT / 2), z = mb % (BT / 2);
      const int c = p * FB_CC + BW * ow + BT * g + 2 * z;  // channels c (row g) and c + 1 (row g + 8)
      const int grp = (p * FB_CC + BW * ow) / C_GS;
      const float f = code_weight<C_BITS>(p);
      const float zs = zsum(grp, row);
      const float o0 = (oacc[mb][nb][e] * f + zs) * inv;
      const float o1 = (oacc[mb][nb][e + 2] * f + zs) * inv;
      if (nsplit != 1) store_pair<1>(part_out + orow * D_C + c, o0 * PART_SCALE, o1 * PART_SCALE);
      else store_pair<1>(reinterpret_cast<OutT*>(out) + orow * D_C + c, o0, o1);
    }
  }
  if constexpr (TIMELINE) {
    __syncthreads();  // every warp's epilogue done (with WS the output warps store after the scores' warps finish)
    mark(tl, NMARK - 1);
#if ONE_BARRIER && !WS
    if (tid == 0) write_timeline(tl, ph, reinterpret_cast<uint64_t*>(part_out + (int64_t)u * R * D_C), ntiles);
#else
    if (tid == 0) write_timeline(tl, nullptr, reinterpret_cast<uint64_t*>(part_out + (int64_t)u * R * D_C), ntiles);
#endif
  }
}
