// Absorbed-MLA decode over a BF16, FP8 or integer-code paged cache with the query rows (heads x query tokens) as
// the MMA's M dimension, on Hopper's warpgroup MMAs (sm_90a): the many-heads kernel (64 rows a CTA, 128 heads in
// two CTAs).
//
// One CTA of two warpgroups takes 64 query rows of one work unit (sequence b, tokens [start, end)). The query
// block and each tile of BN = 64 tokens sit in shared memory as nine 64-channel chunks (eight of the latent, one
// of the RoPE key) in the 128-byte swizzle (wgmma.cuh), two stages. With TMA (the default) one thread copies a tile
// as nine bulk tensor copies (two tensor maps over the pages, built on the host: warpgroup.tensor_maps) that
// swizzle as they land and complete on the stage's mbarrier; with TMA=0 every thread copies its 16-byte pieces
// with cp.async. Per tile:
//
//   scores  S[row, token] = Q·Kᵀ over 576 channels: warpgroup g takes tokens 32g .. 32g + 31 (m64n32k16, both
//           operands from shared memory), in base-2 units (times qk_scale·log2 e).
//   softmax both warpgroups hold the same reference maximum a row, which moves only where a tile exceeds it by more
//           than 2^8 (MAX_SLACK). Each writes P of its tokens (below 2^8) against it to shared memory, in bf16, and
//           one CTA barrier votes whether a row moved; only then (rare after the first tiles) are the tile maxima
//           exchanged, the moved rows' P written again behind a second barrier, and the output rescaled (a warp
//           skips its rescale where none of its rows moved). Each keeps its share of the rows' sums.
//   output  O[row, channel] += P·V with V the tile's latent chunks read N-major (the same bytes the scores read
//           K-major): warpgroup g owns channels 256g .. 256g + 255 (m64n256k16 over the 64 tokens of P).
//
// Integer codes and FP8 (LOWBIT): thread 0 bulk-copies a tile's page sections (codes and metadata of both paths)
// into one of RAW_N raw stages (3; FP8: 1), and the threads build the one tile from them (wg_build.cuh): fp16
// operands where both paths' metadata is fp16 (HALF: the query block in fp16, each row scaled by a power of two
// undone in the scores; P in fp16), else bf16. Every thread builds tile 0; with SPLIT each warpgroup then builds the
// parts of the next tile it frees first (its tokens' RoPE rows under its output products, the latent chunks its
// output products read after them), and one CTA barrier a tile orders both halves before the scores.
//
// Tokens past the unit's end are zeroed in the stage (a page's stale bytes may be NaN: the bulk copies take the
// whole tile, and the threads zero those rows of the latent chunks; cp.async zero-fills them; the build writes
// zeros); tokens past a row's causal limit get P = 0. The epilogue writes the unit's output and log-sum-exp as the
// other CUDA decode kernels do (the sequence's own rows where it has one split, else the unit's partial rows for
// the combine kernel).
//
// Macros (quantmla.kernels.cuda.warpgroup): D_C D_R PS PAGE_BYTES OFF_CC OFF_RC FB_CC FB_RC OUT_KIND SMEM_EXPECTED
// TMA HALF (and WG, NW, BN: fixed here); LOWBIT SPLIT RAW_N OFF_CM OFF_RM FB_CM FB_RM and per path KIND_ BITS_ GS_
// MB_ (C, R), MAX_SLACK (below); timing experiments: S_CHAINS (the scores' products on 1 or 2 independent
// accumulator chains, summed after), SKIP_QK and SKIP_PV (ptx.cuh: a phase's products left out, results wrong),
// SKIP_BUILD, BUILD_BATCH and E4M3_EXPAND (wg_build.cuh); PV_STEPS (below: on by default)

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>  // std::integral_constant

#if HALF  // fp16 operands (low-bit plans with fp16 metadata): the query block scaled per row, P and the tile in fp16
typedef __half T;
typedef __half2 T2;
#define WG_AB "f16"
#else
typedef __nv_bfloat16 T;
typedef __nv_bfloat162 T2;
#define WG_AB "bf16"
#endif
#define MMA_TYPE WG_AB

#include "ptx.cuh"
#include "out_io.cuh"
#include "wgmma.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "the heads-as-M decode kernel runs on Hopper's warpgroup MMAs (sm_90a)"
#endif

#ifndef TMA
#define TMA 1
#endif
#ifndef LOWBIT
#define LOWBIT 0
#endif
#ifndef SPLIT
#define SPLIT 0  // LOWBIT: each warpgroup builds the next tile's chunks its own output products read, after them
#endif
#ifndef PV_STEPS
#define PV_STEPS 0  // SPLIT: the output products' k-steps committed apart, each 16 tokens of a warpgroup's chunks built
#endif              // as soon as its k-step is done (the plan's default)
static_assert(!PV_STEPS || (LOWBIT && SPLIT), "the k-steps' builds are the warpgroups' own (SPLIT)");
#ifndef S_CHAINS
#define S_CHAINS 1
#endif
#ifndef MAX_SLACK
#define MAX_SLACK 8  // base-2 units a tile's row maximum may exceed the row's reference before the output is rescaled
#endif               // (0: at every increase, as exact softmax bookkeeping does)
static_assert(S_CHAINS == 1 || S_CHAINS == 2, "one or two accumulator chains for the scores");
static_assert(NW == 8 && BN == 64 && (HALF == 0 || LOWBIT), "the plan of this kernel: two warpgroups, 64-token tiles, "
              "bf16 (fp16 operands for integer codes only)");
static_assert(D_C == 512 && D_R == 64, "DeepSeek's cache geometry: eight latent chunks and one RoPE chunk");
static_assert(LOWBIT || (FB_CC == 2 * D_C && FB_RC == 2 * D_R), "bf16 values stored as they are");
static_assert(PS % BN == 0, "a tile lies inside one page");

constexpr int BM = 64;                 // query rows per CTA (the MMA's M)
constexpr int NT = 32 * NW;            // 256 threads: two warpgroups
constexpr int D = D_C + D_R;
constexpr int NCH = D / 64;            // 64-channel chunks of a row (9)
constexpr int CCH = D_C / 64;          // of them the latent's (8)
constexpr int CHUNK = 64 * 128;        // a chunk of 64 rows, bytes
constexpr int TILE = NCH * CHUNK;      // the query block, or one stage
#if LOWBIT  // a raw stage: a tile's four page sections as they are stored (codes, then metadata, of both paths)
#include "page_sets.cuh"  // R_PAGE (the RoPE path's metadata is the page's sets), RM_BYTES, RM_PMT, rm_offset
constexpr int RAW_CC = 0, RAW_RC = RAW_CC + BN * FB_CC, RAW_CM = RAW_RC + BN * FB_RC, RAW_RM = RAW_CM + BN * FB_CM;
constexpr int RAW = RAW_RM + RM_BYTES;
constexpr int STAGES = RAW_N;          // raw stages (3; FP8: 1, its 656 bytes a token); one built tile
#else
constexpr int RAW = 0;
constexpr int STAGES = 2;              // tiles, as stored
#endif
constexpr int SM_Q = 0;
constexpr int SM_K = SM_Q + TILE;      // two stages (LOWBIT: the one built tile)
constexpr int SM_P = SM_K + (LOWBIT ? 1 : 2) * TILE;  // P [64 rows x 64 tokens] bf16, one chunk
constexpr int SM_MAX = SM_P + CHUNK;   // [2 tile parities][2 warpgroups][BM] fp32: the rows' tile maxima
constexpr int SM_L = SM_MAX + 4 * BM * 4;  // [2 warpgroups][BM] fp32: the rows' sums
constexpr int SM_QF = SM_L + 2 * BM * 4;  // HALF: [BM] fp32, the factor that undoes a query row's scale
constexpr int SM_RAW = SM_QF + (HALF ? BM * 4 : 0);  // LOWBIT: [STAGES] raw stages
constexpr int SM_BAR = SM_RAW + STAGES * RAW;  // [STAGES] mbarriers of the bulk copies
constexpr int SMEM = SM_BAR + (8 * STAGES + 15) / 16 * 16 + 1024;  // + the slack that aligns the chunks to 1024 bytes
static_assert(RAW % 16 == 0, "raw stages of 16-byte aligned sections");
static_assert(SMEM == SMEM_EXPECTED, "the plan's shared-memory size (warpgroup.py) disagrees with this map");

#include "query_pieces.cuh"  // MLA_DECODE_PARAMS
#include "wg_build.cuh"
#include "wg_copy.cuh"
#include "wg_epilogue.cuh"

// the kernel's arguments: the decode ABI, then (BF16) the tensor maps of the pages' latent and RoPE sections
// (dims: channels, tokens of a page, pages; boxes of 64 x 64 x 1 in the 128-byte swizzle)
#if LOWBIT
extern "C" __global__ void __launch_bounds__(NT, 1) mla_decode(MLA_DECODE_PARAMS) {
#else
extern "C" __global__ void __launch_bounds__(NT, 1) mla_decode(MLA_DECODE_PARAMS, const __grid_constant__ CUtensorMap map_c,
                                                               const __grid_constant__ CUtensorMap map_r) {
#endif
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint8_t* sQ = smem + SM_Q;
  uint8_t* sK = smem + SM_K;
  uint8_t* sP = smem + SM_P;
  float* sMax = reinterpret_cast<float*>(smem + SM_MAX);
  float* sL = reinterpret_cast<float*>(smem + SM_L);
  uint64_t* sBar = reinterpret_cast<uint64_t*>(smem + SM_BAR);

  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int row0 = blockIdx.x * BM, u = blockIdx.y;  // head blocks vary fastest: they share the unit's tiles in L2
  const int b = units[4 * u], start = units[4 * u + 1], end = units[4 * u + 2], nsplit = units[4 * u + 3];
  const int L = seq_lens[b];
  const int* bt_row = block_table + (int64_t)b * stride_bt;
  const int ntiles = end > start ? (end - start + BN - 1) / BN : 0;

  // the query block: rows past R read as zero
#if HALF  // in fp16, a warp a row at a time: the row times the power of two that brings its largest |q| below 2^13
  float* sQf = reinterpret_cast<float*>(smem + SM_QF);
  for (int r = tid >> 5; r < BM; r += NW) {
    const int gr = row0 + r;
    const int64_t qrow = (int64_t)b * R + (gr < R ? gr : 0);
    uint4 v[3];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const int pc = lane + 32 * k, c = pc >> 3, j = pc & 7;
      v[k] = make_uint4(0, 0, 0, 0);
      if (pc < NCH * 8 && gr < R)
        v[k] = __ldg(reinterpret_cast<const uint4*>(c < CCH ? qc + qrow * D_C + 64 * c + 8 * j : qr + qrow * D_R + 8 * j));
      m = max(m, piece_amax_bits(v[k]));
    }
    const float amax = __uint_as_float(__reduce_max_sync(0xffffffffu, m));
    const float scale = row_scale_below_2p13(amax);
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const int pc = lane + 32 * k;
      if (pc < NCH * 8) *reinterpret_cast<uint4*>(sQ + (pc >> 3) * CHUNK + swz(r, pc & 7)) = piece_to_half(v[k], scale);
    }
    if (lane == 0) sQf[r] = qk_scale_log2 / scale;
  }
#else
  load_query_block_bf16(sQ, qc, qr, b, R, row0, tid, NT);
#endif
  if ((TMA || LOWBIT) && tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(&sBar[s], 1);
    mbar_fence_init();
  }
  __syncthreads();
  // tile `it` into stage `st`: its latent chunks then its RoPE chunk (TMA: thread 0's bulk copies; else every
  // thread's cp.async, tokens past the unit's end zero-filled)
  auto issue = [&](int it, uint8_t* st) {
    const int n0 = start + it * BN, valid = min(BN, end - n0);
#if LOWBIT  // thread 0: the tile's page sections into raw stage it % STAGES, one bulk copy each
    if (tid == 0) {
      uint64_t* bar = &sBar[it % STAGES];
      uint8_t* raw = smem + SM_RAW + (it % STAGES) * RAW;
      const uint8_t* pg = pages + (int64_t)bt_row[n0 / PS] * PAGE_BYTES;
      const int t0 = n0 % PS;
      mbar_expect_tx(bar, RAW);
      bulk_g2s(raw + RAW_CC, pg + OFF_CC + t0 * FB_CC, BN * FB_CC, bar);
      bulk_g2s(raw + RAW_RC, pg + OFF_RC + t0 * FB_RC, BN * FB_RC, bar);
      bulk_g2s(raw + RAW_CM, pg + OFF_CM + t0 * FB_CM, BN * FB_CM, bar);
      if (RM_BYTES) bulk_g2s(raw + RAW_RM, pg + OFF_RM + rm_offset(t0), RM_BYTES, bar);  // (a BF16 RoPE key: none)
    }
    return;
#else
    if constexpr (TMA) {
      if (tid == 0) {
        uint64_t* bar = &sBar[it & 1];
        const int pg = bt_row[n0 / PS], t0 = n0 % PS;
        mbar_expect_tx(bar, TILE);
#pragma unroll
        for (int c = 0; c < CCH; ++c) tma_box(st + c * CHUNK, &map_c, 64 * c, t0, pg, bar);
        tma_box(st + CCH * CHUNK, &map_r, 0, t0, pg, bar);
      }
      return;
    }
    const uint8_t* pg = pages + (int64_t)bt_row[n0 / PS] * PAGE_BYTES;
    const uint8_t* cb = pg + OFF_CC + (int64_t)(n0 % PS) * FB_CC;
    const uint8_t* rb = pg + OFF_RC + (int64_t)(n0 % PS) * FB_RC;
#pragma unroll
    for (int n = 0; n < BN * 64 / NT; ++n) {
      const int i = tid + n * NT, t = i >> 6, p = i & 63;
      cp_async16_zfill(st + (p >> 3) * CHUNK + swz(t, p & 7), cb + t * FB_CC + 16 * p, t < valid);
    }
#pragma unroll
    for (int n = 0; n < BN * 8 / NT; ++n) {
      const int i = tid + n * NT, t = i >> 3, j = i & 7;
      cp_async16_zfill(st + CCH * CHUNK + swz(t, j), rb + t * FB_RC + 16 * j, t < valid);
    }
#endif
  };
  if (ntiles > 0) issue(0, sK);
  cp_async_commit();  // group 0: the query block and tile 0
  if (ntiles > 1 && (!LOWBIT || STAGES > 1)) issue(1, sK + TILE);
  cp_async_commit();
  if (LOWBIT && STAGES > 2 && ntiles > 2) issue(2, nullptr);

  // this thread's rows r0 and r0 + 8 of the block, its columns 8j + cq (+ 1) of every n8 block
  const int r0 = 16 * warp + (lane >> 2), cq = 2 * (lane & 3);
  int limit[2];
  float qf[2];  // a row's scores times this: base 2, the query row's scale undone (HALF)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    limit[h] = L - causal * (SQ - 1 - (row0 + r0 + 8 * h) / H);
#if HALF
    qf[h] = sQf[r0 + 8 * h];
#else
    qf[h] = qk_scale_log2;
#endif
  }
  float o[128], m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;

  const uint64_t dq = sw128_desc(sQ, 16, 1024);
  const uint64_t dp = sw128_desc(sP, 16, 1024);
  auto stage = [&](int it) { return sK + (LOWBIT ? 0 : (it & 1) * TILE); };

  // tile it in its stage, ready for the warpgroup MMAs (both warpgroups' products of the tile before it are done
  // where the stage is shared: LOWBIT)
  auto ready = [&](int it) {
    uint8_t* st = stage(it);
    const int valid = min(BN, end - (start + it * BN));
#if LOWBIT
    if (!SPLIT || it == 0) {  // raw stage it % 3 landed: build the tile
      mbar_wait(&sBar[it % STAGES], (it / STAGES) & 1);
      if (it == 0) cp_async_wait<0>();  // the query block
      const uint8_t* raw = smem + SM_RAW + (it % STAGES) * RAW;
      build_path_wg<KIND_C, BITS_C, GS_C, MB_C, D_C, FB_CC, FB_CM, 0>(raw + RAW_CC, raw + RAW_CM, st, valid, tid);
      build_path_wg<KIND_R, BITS_R, GS_R, MB_R, D_R, FB_RC, FB_RM, CCH, NT, 0, D_R * BITS_R / 64, 0,
                    (BITS_R < 8 ? 8 / BITS_R : 1), 0, BN, R_PAGE, RM_PMT, PMB_R>(raw + RAW_RC, raw + RAW_RM, st, valid,
                                                                                 tid);
      fence_proxy_async();  // the built tile, to the warpgroup MMAs; the raw stage, free for the copy engine
    }  // (SPLIT: the warpgroups built their parts after the last tile's output products, and fenced them)
    __syncthreads();
    if (it + STAGES < ntiles) issue(it + STAGES, nullptr);
#else
    if constexpr (TMA) {
      mbar_wait(&sBar[it & 1], (it >> 1) & 1);  // tile it landed
      if (it == 0) cp_async_wait<0>();         // the query block
      if (valid < BN) {  // the stale rows past the unit's end: zero in the latent chunks (P·V would take NaN · 0)
        for (int i = tid; i < (BN - valid) * CCH * 8; i += NT) {
          const int t = valid + i / (CCH * 8), c = (i >> 3) % CCH;
          *reinterpret_cast<uint4*>(st + c * CHUNK + swz(t, i & 7)) = make_uint4(0, 0, 0, 0);
        }
      }
      if (it == 0 || valid < BN) {  // plain stores, read by the warpgroup MMAs
        fence_proxy_async();
        __syncthreads();
      }
    } else {
      cp_async_wait<1>();  // tile it (and the query block) landed
      fence_proxy_async();
      __syncthreads();
    }
#endif
  };

  // the scores of this warpgroup's 32 tokens of tile it, issued (S_CHAINS = 2: the first four chunks and the rest on
  // their own accumulators)
  float s[16], s2[16];
  auto scores_issue = [&](int it) {
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.0f, s2[i] = 0.0f;
    const uint64_t dk = sw128_desc(stage(it) + wg * 32 * 128, 16, 1024);
    if constexpr (!SKIP_QK) {
      fence_regs(s);  // the zeroed accumulators before the fence (the compiler may not move them past it)
      fence_regs(s2);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < NCH * 4; ++kk) {
        const uint32_t off = ((kk >> 2) * CHUNK + (kk & 3) * 32) >> 4;
        if (S_CHAINS == 2 && kk >= 16) wgmma_m64n32_k(s2, dq + off, dk + off, 1);
        else wgmma_m64n32_k(s, dq + off, dk + off, 1);
      }
      wgmma_commit();
    }
  };
  auto scores_done = [&]() {  // every product issued is done
    if constexpr (!SKIP_QK) {
      wgmma_wait<0>();
      fence_regs(s);
      fence_regs(s2);
    }
    if constexpr (S_CHAINS == 2) {
#pragma unroll
      for (int i = 0; i < 16; ++i) s[i] += s2[i];
    }
  };

  // the softmax of tile it's scores: the rows' running maxima (alpha: the factor the output takes), sums, and P
  float alpha[2];
  auto softmax = [&](int it) {
    // the rows' tile maxima, base 2; tokens past the unit's end or a row's causal limit are -inf
    const int n0 = start + it * BN, par = it & 1;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int pos = n0 + wg * 32 + 8 * j + cq + e, i = 4 * j + 2 * h + e;
          s[i] = pos < end && pos < limit[h] ? s[i] * qf[h] : -INFINITY;
          mx[h] = fmaxf(mx[h], s[i]);
        }
    // P of row r0 + 8h relative to m_use into shared memory (this warpgroup's 32 tokens); returns their sum
    auto write_p = [&](int h, float m_use) {
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float p0 = fast_exp2(s[4 * j + 2 * h] - m_use), p1 = fast_exp2(s[4 * j + 2 * h + 1] - m_use);
        sum += p0 + p1;
        const int col = wg * 32 + 8 * j + cq;
#if HALF
        *reinterpret_cast<T2*>(sP + swz(r0 + 8 * h, col >> 3) + (col & 7) * 2) = __floats2half2_rn(p0, p1);
#else
        *reinterpret_cast<T2*>(sP + swz(r0 + 8 * h, col >> 3) + (col & 7) * 2) = __floats2bfloat162_rn(p0, p1);
#endif
      }
      return sum;
    };
    // a row's reference maximum moves only where the tile's exceeds it by more than MAX_SLACK (P stays below
    // 2^MAX_SLACK), so it moves where either warpgroup's share of the tile exceeds it: P is written against the
    // reference first, and one CTA barrier votes; only where some row moved (rare after the first tiles) are the
    // warpgroups' maxima exchanged and the moved rows' P written again, behind a second barrier
    bool exceeds = false;
    float sum[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      if ((lane & 3) == 0) sMax[(par * 2 + wg) * BM + r0 + 8 * h] = mx[h];
      exceeds |= mx[h] > m_run[h] + (float)MAX_SLACK;
      alpha[h] = 1.0f;
      sum[h] = write_p(h, m_run[h] == -INFINITY ? 0.0f : m_run[h]);
    }
    fence_proxy_async();
    if (__syncthreads_or(exceeds)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_tile = fmaxf(mx[h], sMax[(par * 2 + (wg ^ 1)) * BM + r0 + 8 * h]);
        if (m_tile > m_run[h] + (float)MAX_SLACK) {
          alpha[h] = fast_exp2(m_run[h] - m_tile);
          m_run[h] = m_tile;
          sum[h] = write_p(h, m_tile);
        }
      }
      fence_proxy_async();
      bar_sync(1, NT);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + sum[h];
  };

  // the output of this warpgroup's 256 channels: rescaled by alpha, then P·V of tile it issued
  auto output_issue = [&](int it) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {  // some row of the warp moved
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[4 * j] *= alpha[0], o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1], o[4 * j + 3] *= alpha[1];
      }
    }
    const uint64_t dv = sw128_desc(stage(it) + wg * 4 * CHUNK, CHUNK, 1024);
    if constexpr (!SKIP_PV) {
      fence_regs(o);  // the rescaled accumulators before the fence
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        wgmma_m64n256_n(o, dp + ((kk * 32) >> 4), dv + ((kk * 16 * 128) >> 4), 1);
        if constexpr (PV_STEPS) wgmma_commit();  // a group a k-step (16 tokens)
      }
      if constexpr (!PV_STEPS) wgmma_commit();
    }
  };

#if LOWBIT && SPLIT
  // warpgroup g's part of tile it: the RoPE rows of its tokens 32g .. 32g + 31 (the scores read them; free once both
  // warpgroups' scores of the tile before are done), or the latent chunks 4g .. 4g + 3 its output products read
  // (free once its own output products of the tile before are done): their planes, or with one plane (8-bit codes)
  // their byte columns
  // tokens [T0, T0 + TN) of warpgroup g's latent chunks of tile it
  auto build_chunks = [&](int it, const uint8_t* raw, uint8_t* st, int valid, int lt, auto t0, auto tn) {
    constexpr int T0 = decltype(t0)::value, TN = decltype(tn)::value;
    constexpr int KC = BITS_C < 8 ? 8 / BITS_C : 1, NBGC = D_C * BITS_C / 64;
    if constexpr (KC > 1) {  // warpgroup g: the planes of channels 256g .. 256g + 255
      if (wg == 0)
        build_path_wg<KIND_C, BITS_C, GS_C, MB_C, D_C, FB_CC, FB_CM, 0, 128, 0, NBGC, 0, KC / 2, T0, TN>(
            raw + RAW_CC, raw + RAW_CM, st, valid, lt);
      else
        build_path_wg<KIND_C, BITS_C, GS_C, MB_C, D_C, FB_CC, FB_CM, 0, 128, 0, NBGC, KC / 2, KC, T0, TN>(
            raw + RAW_CC, raw + RAW_CM, st, valid, lt);
    } else {  // one plane: warpgroup g's byte columns
      if (wg == 0)
        build_path_wg<KIND_C, BITS_C, GS_C, MB_C, D_C, FB_CC, FB_CM, 0, 128, 0, NBGC / 2, 0, 1, T0, TN>(
            raw + RAW_CC, raw + RAW_CM, st, valid, lt);
      else
        build_path_wg<KIND_C, BITS_C, GS_C, MB_C, D_C, FB_CC, FB_CM, 0, 128, NBGC / 2, NBGC / 2, 0, 1, T0, TN>(
            raw + RAW_CC, raw + RAW_CM, st, valid, lt);
    }
  };
  auto build_part = [&](int it, bool rope) {
    if (it == 0 || it >= ntiles) return;
    const uint8_t* raw = smem + SM_RAW + (it % STAGES) * RAW;
    const int valid = min(BN, end - (start + it * BN)), lt = tid & 127;
    uint8_t* st = stage(it);
    if (rope) {
      mbar_wait(&sBar[it % STAGES], (it / STAGES) & 1);
      constexpr int KR = BITS_R < 8 ? 8 / BITS_R : 1, NBGR = D_R * BITS_R / 64;
      if (wg == 0)
        build_path_wg<KIND_R, BITS_R, GS_R, MB_R, D_R, FB_RC, FB_RM, CCH, 128, 0, NBGR, 0, KR, 0, 32, R_PAGE, RM_PMT,
                      PMB_R>(
            raw + RAW_RC, raw + RAW_RM, st, valid, lt);
      else
        build_path_wg<KIND_R, BITS_R, GS_R, MB_R, D_R, FB_RC, FB_RM, CCH, 128, 0, NBGR, 0, KR, 32, 32, R_PAGE, RM_PMT,
                      PMB_R>(
            raw + RAW_RC, raw + RAW_RM, st, valid, lt);
    } else {
      build_chunks(it, raw, st, valid, lt, std::integral_constant<int, 0>(), std::integral_constant<int, BN>());
    }
  };
#endif

  for (int it = 0; it < ntiles; ++it) {
    ready(it);
    scores_issue(it);
    scores_done();
    softmax(it);
    output_issue(it);
#if LOWBIT && SPLIT
    build_part(it + 1, true);  // under this tile's output products
#endif
#if PV_STEPS
    if (it + 1 < ntiles) {  // 16 tokens of this warpgroup's chunks of the next tile as each k-step is done with them
      using std::integral_constant;
      const int nt = it + 1, valid = min(BN, end - (start + nt * BN)), lt = tid & 127;
      const uint8_t* raw = smem + SM_RAW + (nt % STAGES) * RAW;
      uint8_t* st = stage(nt);
      wgmma_wait<3>();
      build_chunks(nt, raw, st, valid, lt, integral_constant<int, 0>(), integral_constant<int, 16>());
      wgmma_wait<2>();
      build_chunks(nt, raw, st, valid, lt, integral_constant<int, 16>(), integral_constant<int, 16>());
      wgmma_wait<1>();
      build_chunks(nt, raw, st, valid, lt, integral_constant<int, 32>(), integral_constant<int, 16>());
      wgmma_wait<0>();
      fence_regs(o);
      build_chunks(nt, raw, st, valid, lt, integral_constant<int, 48>(), integral_constant<int, 16>());
    } else {
      wgmma_wait<0>();
      fence_regs(o);
    }
#else
    if constexpr (!SKIP_PV) {
      wgmma_wait<0>();
      fence_regs(o);
    }
#endif
#if LOWBIT && SPLIT
    if (!PV_STEPS) build_part(it + 1, false);
    fence_proxy_async();  // the parts built, to the next tile's products (after ready's barrier)
#else
    __syncthreads();  // the stage and P are read: refill the stage two tiles ahead (LOWBIT: rebuild the tile)
    if (!LOWBIT && it + 2 < ntiles) issue(it + 2, stage(it));
#endif
    cp_async_commit();
  }
  cp_async_wait<0>();

  static_assert(!EPI_SMEM || SM_P >= 64 * 520 * 4, "EPI_SMEM stages the rows over the query block and the tiles");
  wg_epilogue(o, l_run, [&](int h) { return m_run[h]; }, sL, wg, lane, r0, cq, row0, R, b, u, nsplit, out, lse, part_out,
              part_lse, smem);
}
