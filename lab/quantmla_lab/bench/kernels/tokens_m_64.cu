// The tokens-as-M tile loop at 64 query rows on warpgroup MMAs, timed alone (tokens_m_64.py): a design with no built
// tile, unlike the heads-as-M kernel (mla_decode_wg.cu, wg_build.cuh). The codes go straight into the register A
// operands of wgmma m64n64k16, and the shared-memory B operands are the query block (scores) and P (output). INT4/INT4,
// groups 128/64 (DeepSeek's), 64-token tiles, one CTA an SM of three warpgroups. Two ways to make the operands:
//
// DQA=1  a pair of codes dequantized in registers: (1024 + code) exact in fp16, less 1024, then code·scale + zero in
//        one fused multiply-add (the token's fp16 metadata), rounded once. All 36 scores' products on one set of
//        accumulators, P alone as the output's B, each row's Σ P kept by its threads; 5 stages.
// DQA=0  the codes masked in place (exact fp16 subnormals, code_planes.cuh), as the 16-row tokens-as-M kernel feeds
//        mma.sync; each group's products apart until its scale folds in, so the zero points take products of their
//        own (below); 3 stages. Per role:
//
//   warpgroup 0  scores  Sᵀ[64 tokens, 64 rows] = K·Qᵀ: 36 products (32 content k-steps, the two planes of a 64-byte
//                block on their own accumulators until the group's scale folds in per token; 4 of RoPE), then one
//                product that adds the zero points (A: a token's zeros, B: the query's group sums); a vote on the
//                rows' reference maxima, P = exp2(S - ref), P·scale of each content group and P itself (16-bit, the
//                output's B operands, 128-byte swizzle), and one product a k-step that sums P·zero and P over the
//                tile's tokens for every row (A: a token's zeros and a row of ones)
//   warpgroups 1, 2  output  Oᵀ[channels, 64 rows] += Cᵀ·(P·scale): 128 code bytes each (a group in each plane),
//                4 m-blocks of 64 channels x 4 k-steps of 16 tokens, the A operand two tokens' bytes of one channel
//                paired by one byte permute
//
// Thread 0 refills a stage with one bulk copy of a 64-token page (cycling over `pages`) once both roles are past it.
// The values are not checked (the query block, the group sums and the pages are whatever the buffers hold, zeros
// by default): the time is that of the instruction stream and the copies such a kernel runs. Macros: ITERS (tiles a
// CTA), REGS_S (setmaxnreg of the scores' warpgroup; the output's take (504 - REGS_S) / 2), NPAGES, ONE_ACC,
// OUT_WAIT, SG, SW, DQA, EXACT, CHECK, P_NATURAL, ZL, SKIP_COPY (below); SKIP_QK, SKIP_PV (ptx.cuh) leave the scores' or the output's code products out.
#include <cuda_fp16.h>
#include <stdint.h>
#define MMA_TYPE "f16"
#define WG_AB "f16"
typedef __half T;
typedef __half2 T2;
#include "ptx.cuh"
#include "code_planes.cuh"
#include "wgmma.cuh"
#include "tm64_ops.cuh"     // wgmma_m64n64_ra, the page sections, the DQA operands, over_tokens
#include "tm64_planes.cuh"  // the codes masked in place (DQA=0)

#ifndef ITERS
#define ITERS 1024
#endif
#define NPBUF 2                  // P buffers: the stage of tile i - 2 takes tile i + STAGES - 2 once both are past it
#define STAGES (DQA ? 5 : 3)     // beside two P buffers of 5 chunks the most that fit; of one chunk (DQA) 5
#ifndef SKIP_COPY
#define SKIP_COPY 0  // 1 (times only): no stage refilled after the first STAGES tiles, none waited for after them
#endif
#ifndef REGS_S
#define REGS_S 192
#endif
#ifndef NPAGES
#define NPAGES 64
#endif
#ifndef ONE_ACC
#define ONE_ACC 0  // 1: the scores' content products a plane at a time on one set of accumulators
#endif
#ifndef OUT_WAIT
#define OUT_WAIT 1  // the output's products in flight: the k-steps before the current one (wgmma.wait_group)
#endif
#ifndef SG
#define SG 1  // the scores' words (4 of a 16-byte load) whose products are committed as one group
#endif
#ifndef DQA
#define DQA 0  // 1: the codes dequantized into the A operands (code·scale + zero in fp16, one rounding): one accumulator,
#endif       // no folds, no zero-point products, one P a buffer, 5 stages (ZL and ONE_ACC do not apply)
#ifndef SW
#define SW 1  // DQA: the scores' product groups left in flight at each wait (their operand registers kept)
#endif
#ifndef CHECK
#define CHECK 0  // 1 (with DQA, ITERS 1): the query block read from after the pages, no reference moves, and every thread's
#endif           // scores or output accumulators written out: the layouts checked against an fp64 reference
#ifndef EXACT
#define EXACT 0  // 1 (DQA): each row's reference maximum moved to the tile's exact maximum over the 64 tokens (lanes, then
#endif           // the four warps), the output rescaled by 2^(old - new) a row, and the output divided by Σ P at the end
#ifndef P_NATURAL
#define P_NATURAL 0  // 1 (a negative control of CHECK): P's rows in token order, not the output's pairing
#endif
#ifndef ZL
#define ZL 1  // the product that sums P·zero and P over a tile's tokens (0: left out, its 32 accumulators too)
#endif
// a thread's registers at launch (65536 / 384, rounded down to 8): the CTA's pool holds 384 x 168, so what the
// scores' warpgroup gives back is all the output's two can take (setmaxnreg.inc waits for registers in the pool)
constexpr int NT = 384, REGS_BASE = 168, REGS_O = (3 * REGS_BASE - REGS_S) / 2 / 8 * 8;
static_assert(REGS_S % 8 == 0 && REGS_S >= 24 && REGS_S <= 256 && REGS_S + 2 * REGS_O <= 3 * REGS_BASE, "setmaxnreg");
static_assert(!CHECK || (DQA && (ITERS == 1 || EXACT)), "CHECK reads one tile of the DQA build, or with EXACT many");
static_assert(!EXACT || DQA, "EXACT with DQA");

// 64 tokens a tile; a page's sections (one copy) and CHUNK: tm64_ops.cuh
constexpr int SM_Q = 0;                          // 9 chunks: the query block, K-major (rows as N)
constexpr int SM_QS = SM_Q + 9 * CHUNK;          // 1 chunk: the query's group sums (k 0-9: 5 groups, hi and lo)
constexpr int PCH = DQA ? 1 : 5;                 // chunks a P buffer: P·scale of 4 groups and P (DQA: P)
constexpr int SM_P = SM_QS + CHUNK;              // NPBUF buffers x PCH chunks, N-major
constexpr int SM_RAW = SM_P + NPBUF * PCH * CHUNK; // STAGES raw pages
constexpr int SM_BAR = SM_RAW + STAGES * RAW_BYTES;
constexpr int SM_FLAG = SM_BAR + 8 * STAGES;
constexpr int SM_RED = SM_FLAG + 16;      // EXACT: [4 warps, 64 rows] fp32, the rows' maxima or sums a warp
constexpr int SM_ALPHA = SM_RED + 1024;   // [NPBUF, 64 rows] fp32: each row's rescale factor for a P buffer's tile
constexpr int SM_L = SM_ALPHA + 512;      // [64 rows] fp32: Σ P a row over the unit
enum { BAR_VOTE = 1, BAR_FULL = 2, BAR_EMPTY = 4, BAR_EPI = 6 };  // named barriers (FULL, EMPTY: one a P buffer)

template <int N, bool INC>
__device__ __forceinline__ void set_max_regs() {
  if constexpr (N == REGS_BASE) return;
  else if constexpr (INC) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

extern "C" __global__ void __launch_bounds__(NT, 1) tokens_m_64(const uint8_t* __restrict__ pages, float* out) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint64_t* sBar = reinterpret_cast<uint64_t*>(smem + SM_BAR);
  float* sFlag = reinterpret_cast<float*>(smem + SM_FLAG);
  const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  for (int i = tid; i < SM_RAW / 16; i += NT) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(sBar + s, 1);
    mbar_fence_init();
    sFlag[0] = sFlag[1] = 0.0f;
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_expect_tx(sBar + s, RAW_BYTES);
      bulk_g2s(smem + SM_RAW + s * RAW_BYTES, pages + (size_t)((blockIdx.x * 7 + s) % NPAGES) * RAW_BYTES, RAW_BYTES,
               sBar + s);
    }
  }
  if constexpr (CHECK) {  // the query block (9 chunks, as the products read it) from after the pages
    __syncthreads();
    const uint4* src = reinterpret_cast<const uint4*>(pages + (size_t)NPAGES * RAW_BYTES);
    for (int i = tid; i < 9 * CHUNK / 16; i += NT) reinterpret_cast<uint4*>(smem + SM_Q)[i] = src[i];
  }
  fence_proxy_async();  // the zeroed (or read) query block and P buffers, visible to the products
  __syncthreads();
  float sink = 0.0f;

  if (wg == 0) {
    set_max_regs<REGS_S, (REGS_S > REGS_BASE)>();
    const uint64_t dq = sw128_desc(smem + SM_Q, 16, 1024), dqs = sw128_desc(smem + SM_QS, 16, 1024);
    const int r_lo = 16 * w + g;  // the thread's tokens: r_lo and r_lo + 8
    float ref[16], zl[32], lsum[16];  // the reference maxima of its 16 rows; Σ P·zero (rows 0-3) and Σ P (row 4)
#pragma unroll
    for (int i = 0; i < 16; ++i) ref[i] = EXACT ? -INFINITY : 0.0f, lsum[i] = 0.0f;
    float* red = reinterpret_cast<float*>(smem + SM_RED);
    [[maybe_unused]] float al[16];  // EXACT: the thread's rows' rescale factors of this tile
#pragma unroll
    for (int i = 0; i < 32; ++i) zl[i] = 0.0f;
    for (int it = 0; it < ITERS; ++it) {
      const int buf = it % NPBUF;
      const uint8_t* st = smem + SM_RAW + (it % STAGES) * RAW_BYTES;
      if (!SKIP_COPY || it < STAGES) mbar_wait(sBar + it % STAGES, (it / STAGES) & 1);
      const uint8_t* ml = st + RAW_CM + r_lo * FB_CM;  // token r_lo's content metadata (r_lo + 8: 8 rows on)
      float sc[32];
      if constexpr (DQA) {  // every k-step's A operand the dequantized values; all 36 products on sc
        scores_dqa<SG, SW>(sc, st, dq, r_lo, t);
        if constexpr (CHECK) {
#pragma unroll
          for (int i = 0; i < 32; ++i) out[((size_t)blockIdx.x * NT + tid) * 128 + i] = sc[i];
        }
      } else {  // the codes masked in place: each group's products apart until its scale folds in; the zero points
        scores_planes<SG, ONE_ACC>(sc, st, dq, dqs, r_lo, t);
      }
      // ---- the vote: does any row's reference move (by more than 2^8)? ----
      bool up = false;
#pragma unroll
      for (int e = 0; e < 32; ++e) up |= sc[e] > ref[(e >> 2) * 2 + (e & 1)] + 8.0f;
      const bool moved = bar_or(BAR_VOTE, 128, up) && (EXACT || !CHECK);  // (CHECK alone: every reference stays 0)
      if (EXACT && moved) {  // each row's maximum over the tile's 64 tokens: its thread's two, the 8 lanes g, the 4 warps
        float mx[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) mx[i] = fmaxf(sc[4 * (i >> 1) + (i & 1)], sc[4 * (i >> 1) + 2 + (i & 1)]);
        over_tokens<true, BAR_VOTE>(mx, red, w, g, t);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const float nr = fmaxf(ref[i], mx[i]);
          al[i] = fast_exp2(ref[i] - nr);  // 0 the first time (ref -inf)
          lsum[i] *= al[i], ref[i] = nr;
        }
      } else if (moved) {  // the first tiles: every row's reference becomes its largest score (here: the thread's own)
#pragma unroll
        for (int e = 0; e < 32; ++e) ref[(e >> 2) * 2 + (e & 1)] = fmaxf(ref[(e >> 2) * 2 + (e & 1)], sc[e]);
      }
      // ---- P, P·scale of each content group (N-major, swizzled), once the output's warpgroups are past this buffer ----
      if (it >= NPBUF) bar_sync(BAR_EMPTY + buf, NT);
      if (tid == 0) sFlag[buf] = moved ? 1.0f : 0.0f;  // the output's warpgroups rescale where a reference moved
      if (EXACT && moved && w == 0 && g == 0) {  // this buffer's factors, once its last reader is done
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) reinterpret_cast<float*>(smem + SM_ALPHA)[buf * 64 + 8 * j + 2 * t + c] = al[2 * j + c];
      }
      if (!SKIP_COPY && tid == 0 && it >= NPBUF && it + STAGES - NPBUF < ITERS) {  // tile it - NPBUF's stage is free
        const int s = (it - NPBUF) % STAGES, nxt = it - NPBUF + STAGES;
        mbar_expect_tx(sBar + s, RAW_BYTES);
        bulk_g2s(smem + SM_RAW + s * RAW_BYTES, pages + (size_t)((blockIdx.x * 7 + nxt) % NPAGES) * RAW_BYTES,
                 RAW_BYTES, sBar + s);
      }
      uint8_t* pb = smem + SM_P + buf * PCH * CHUNK;
      if constexpr (DQA) {  // P (16-bit) into the buffer's one chunk; each row's Σ P kept by its threads
        write_p<P_NATURAL>(sc, ref, lsum, pb, w, g, t);
      } else {
        write_p_scaled(sc, ref, ml, pb, r_lo, t);
      }
      fence_proxy_async();  // P, visible to the products
      bar_sync(BAR_VOTE, 128);
      // ---- Σ P·zero of each group (rows 0-3) and Σ P (row 4) over the tile's tokens: A the zeros, B = P ----
      if constexpr (ZL && !DQA) zero_sums(zl, st, pb, w, g, t);  // Σ P·zero, Σ P over the tile's tokens
      bar_arrive(BAR_FULL + buf, NT);
      if constexpr (ZL && !DQA) {
        wgmma_wait<0>();
        fence_regs(zl);
      }
    }
    wgmma_wait<0>();
    fence_regs(zl);
#pragma unroll
    for (int i = 0; i < 32; ++i) sink += zl[i];
    if constexpr (EXACT) {  // each row's Σ P over the unit: its thread's, the 8 lanes g, the 4 warps
      over_tokens<false, BAR_VOTE>(lsum, red, w, g, t);
      if (w == 0 && g == 0) {
#pragma unroll
        for (int i = 0; i < 16; ++i) reinterpret_cast<float*>(smem + SM_L)[8 * (i >> 1) + 2 * t + (i & 1)] = lsum[i];
      }
      bar_arrive(BAR_EPI, NT);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) sink += ref[i] + lsum[i];
  } else {
    set_max_regs<REGS_O, (REGS_O > REGS_BASE)>();
    const int o = wg - 1;  // code bytes 128o .. 128o + 127: group o in plane 0, group o + 2 in plane 1
    float acc[4][32];
#pragma unroll
    for (int mb = 0; mb < 4; ++mb)
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[mb][i] = 0.0f;
    const int col = 128 * o + 32 * w + 4 * g;  // the thread's 4 bytes: byte pairs z = 0, 1 (channel rows g, g + 8)
    for (int it = 0; it < ITERS; ++it) {
      const int buf = it % NPBUF;
      const uint8_t* st = smem + SM_RAW + (it % STAGES) * RAW_BYTES;
      bar_sync(BAR_FULL + buf, NT);
      if (sFlag[buf] != 0.0f) {  // a row's reference moved: its accumulators rescaled (EXACT: by 2^(old - new) a row)
        if constexpr (EXACT) {
          scale_rows(acc, reinterpret_cast<const float*>(smem + SM_ALPHA) + buf * 64, t);
        } else {
#pragma unroll
          for (int mb = 0; mb < 4; ++mb)
#pragma unroll
            for (int i = 0; i < 32; ++i) acc[mb][i] *= 0.5f;
        }
      }
      const uint8_t* pb = smem + SM_P + buf * PCH * CHUNK;
      const uint64_t d0 = sw128_desc(pb + (DQA ? 0 : o) * CHUNK, CHUNK, 1024);
      const uint64_t d1 = sw128_desc(pb + (DQA ? 0 : o + 2) * CHUNK, CHUNK, 1024);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if constexpr (DQA) {
          output_dqa_kstep(acc, st, d0, kk, col, o, t);
        } else {
          output_planes_kstep(acc, st, d0, d1, kk, col, t);
        }
        wgmma_wait<OUT_WAIT>();  // the k-steps before are done: their operand registers are free
      }
      wgmma_wait<0>();
#pragma unroll
      for (int mb = 0; mb < 4; ++mb) fence_regs(acc[mb]);
      if (it + NPBUF < ITERS) bar_arrive(BAR_EMPTY + buf, NT);  // (the scores' warpgroup waits only for those)
    }
    if constexpr (EXACT) {  // O = acc / Σ P, each row (the scores' warpgroup has summed them)
      bar_sync(BAR_EPI, NT);
      const float* L = reinterpret_cast<const float*>(smem + SM_L);
#pragma unroll
      for (int mb = 0; mb < 4; ++mb)
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[mb][i] /= L[8 * (i >> 2) + 2 * t + (i & 1)];
    }
    if constexpr (CHECK) {
#pragma unroll
      for (int mb = 0; mb < 4; ++mb)
#pragma unroll
        for (int i = 0; i < 32; ++i) out[((size_t)blockIdx.x * NT + tid) * 128 + 32 * mb + i] = acc[mb][i];
    }
#pragma unroll
    for (int mb = 0; mb < 4; ++mb)
#pragma unroll
      for (int i = 0; i < 32; ++i) sink += acc[mb][i];
  }
  if constexpr (!CHECK) out[blockIdx.x * NT + tid] = sink;
}
