// Absorbed-MLA decode over the packed paged cache: CUDA C++ for sm_80 and later (built for the device's
// own architecture; the H200 is sm_90).
//
// One CTA handles one work unit (sequence b, tokens [start, end), from kernels.schedule.get_mla_metadata)
// for one block of BM = 16·RM query rows (r = i·H + h). Per tile of BN tokens (inside one page):
//
//   A  copy   the tile's four page sections (codes, metadata) into a shared-memory stage, STAGES tiles
//             ahead (a tile's rows of one section are contiguous in the page). On sm_90 one thread issues
//             a bulk copy per section that completes on the stage's mbarrier (a BF16 tile: one warp, two
//             copies a row); before sm_90 every thread issues 16-byte cp.async copies
//   B  build  the tile once in shared memory as 16-bit values x = code·scale + zero, [BN, d_c + d_r]
//             (a BF16 cache is copied straight into that layout and needs no build); a tile whose tokens
//             are all in the sequence is built without row checks
//   C  QK     S = q_latent·cᵀ + q_rope·k_Rᵀ on the tensor cores (mma.sync m16n8k16, fp32 accumulate),
//             KSPLIT warps sharing a score tile's channels (their query fragments in registers when a
//             share is at most 9 steps of 16), partial scores summed in the softmax
//   D  soft   online softmax (base 2), two rows a pass on 16 lanes each where a warp owns an even number
//             of rows; a row's reference maximum moves only by more than 2^8, so most tiles rescale
//             nothing, and one warp vote tells when: only then are the rows' maxima reduced. Each lane keeps
//             its share of a row's sum to the end. P written to shared memory as 16-bit
//   E  PV     acc += P·c, each warp owning d_c / NWC output channels of every row
//
// WS (warp specialization): the CTA's first NW/2 warps compute (C, D, E) and the others copy and build
// (A, B) into two tiles in turn, so building tile i + 1 overlaps the products of tile i; named barriers
// hand each tile over (built: 3 + buf, read: 5 + buf). Without WS every warp does every phase in turn.
//
// Both products read the one built tile: the latent is the key's first d_c channels and the value.
// 16-bit type T: fp16 when every quantized path stores fp16 metadata and no path is raw BF16 (codes
// become exact fp16 values with one lop3: (code | 0x6400) = 1024 + code, then one subtract and one
// fma per pair), bf16 otherwise. In fp16 each query row is scaled by a power of two so that its
// largest entry is below 2^13 (exact; undone on the scores), so no query overflows fp16.
//
// Everything about the layout comes in as macros from quantmla.kernels.cuda (one build per layout):
//   D_C D_R PS PAGE_BYTES OFF_CC OFF_RC OFF_CM OFF_RM FB_CC FB_RC FB_CM FB_RM
//   C_KIND C_BITS C_GS C_MB  R_KIND R_BITS R_GS R_MB   (KIND 0 raw bf16, 1 affine, 2 symmetric, 3 e4m3;
//                                                       MB: metadata bytes 2 fp16 / 3 bf16 / 4 fp32)
//   HALF RM NW BN KSPLIT STAGES MIN_CTAS WS OUT_KIND (0 bf16, 1 fp16, 2 fp32) SMEM_EXPECTED
//   R_PAGE PMB_R   (the RoPE path's metadata is the page's: sets of PMB_R bytes at OFF_RM, one per R_BLK tokens,
//   R_BLK          the page size unless given; a tile's stage holds the sets its tokens read)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

// SKIP_BUILD (timing experiments only: the result is wrong): leave the tile build out (SKIP_QK, SKIP_PV: ptx.cuh)
#ifndef SKIP_BUILD
#define SKIP_BUILD 0
#endif
#ifndef QK_UNROLL
#define QK_UNROLL 18
#endif
#define PRAGMA_(x) _Pragma(#x)
#define UNROLL(n) PRAGMA_(unroll n)

#if HALF
typedef __half T;
typedef __half2 T2;
#define MMA_TYPE "f16"
#else
typedef __nv_bfloat16 T;
typedef __nv_bfloat162 T2;
#define MMA_TYPE "bf16"
#endif

constexpr int D = D_C + D_R;           // key width
constexpr int LDK = D + 8;             // row pitch (elements) of the built tile and the query block
constexpr int BM = 16 * RM;            // query rows per CTA
constexpr int NT = 32 * NW;            // threads
#ifndef WS
#define WS 0
#endif
constexpr int NWC = WS ? NW / 2 : NW;  // warps that compute (QK, softmax, PV); with WS the others copy and build
constexpr int NTB = WS ? NT - 32 * NWC : NT;  // threads that copy and build
constexpr int NBUF = WS ? 2 : 1;       // built tiles (WS: one built while the other is read)
constexpr int LDS = BN + 8;            // fp32 score row pitch (8 rows' float2 fragment stores hit distinct banks)
constexpr int LDP = BN + 8;            // 16-bit probability row pitch
constexpr bool DIRECT = (C_KIND == 0) && (R_KIND == 0);  // BF16 cache: copied straight into the tile
#include "page_sets.cuh"  // R_PAGE, R_BLK, RM_SETS, RM_BYTES, rm_offset

// the stage of one tile: its four sections, each 16-byte aligned
__host__ __device__ constexpr int align16(int n) { return (n + 15) / 16 * 16; }
constexpr int RAW_CC = 0;
constexpr int RAW_RC = align16(RAW_CC + BN * FB_CC);
constexpr int RAW_CM = align16(RAW_RC + BN * FB_RC);
constexpr int RAW_RM = align16(RAW_CM + BN * FB_CM);
constexpr int RAW_BYTES = DIRECT ? BN * LDK * 2 : align16(RAW_RM + RM_BYTES);

// shared memory map (bytes)
constexpr int SM_Q = 0;
constexpr int SM_KV = SM_Q + BM * LDK * 2;
constexpr int SM_RAW = SM_KV + (DIRECT ? 0 : NBUF * BN * LDK * 2);
constexpr int SM_S = SM_RAW + STAGES * RAW_BYTES;
constexpr int SM_P = SM_S + KSPLIT * BM * LDS * 4;
constexpr int SM_ROW = SM_P + BM * LDP * 2;  // alpha, l, query scale: 3 x BM floats
constexpr int SM_FLAG = SM_ROW + 3 * BM * 4; // per tile parity: whether any row's reference maximum moved
constexpr int SM_BAR = SM_FLAG + 16;          // per stage: the mbarrier its bulk copies complete on (sm_90)
constexpr int SMEM_BYTES = SM_BAR + 8 * STAGES;
static_assert(SMEM_BYTES == SMEM_EXPECTED, "the host's shared-memory size agrees with this map");
static_assert(!(HALF && (C_KIND == 0 || R_KIND == 0)), "raw BF16 paths need the bf16 tile");

static_assert(PAGE_BYTES % 16 == 0 && OFF_CC % 16 == 0 && OFF_RC % 16 == 0 && OFF_CM % 16 == 0 && OFF_RM % 16 == 0,
              "pages and their sections start on 16-byte boundaries (the copies move 16-byte pieces)");
static_assert(D % (16 * KSPLIT) == 0, "key width must split into 16-channel steps");
static_assert(BN % 16 == 0 && PS % BN == 0, "a tile is 16k tokens inside one page");
static_assert(!(WS && DIRECT), "a BF16 tile is copied, not built: no builder warps");
static_assert(BM % NWC == 0, "rows split evenly over the warps in the softmax");
static_assert(D_C % (16 * NWC) == 0, "output channels split over the warps in 16s");
static_assert((RM * (BN / 8) * KSPLIT) % NWC == 0, "score tiles split evenly over the warps");
constexpr int TPW = RM * (BN / 8) * KSPLIT / NWC;  // score tiles per warp, adjacent in one row block
constexpr int KSTEPS = D / 16 / KSPLIT;           // 16-channel steps per warp
static_assert((BN / 8) % TPW == 0, "a warp's score tiles lie in one row block");
#ifndef QREG_MAX
#define QREG_MAX 9  // the most 16-channel steps whose query fragments a warp keeps in registers
#endif
constexpr bool QREG = KSTEPS <= QREG_MAX;         // the query fragments stay in registers (36 of them)
constexpr int CPW = D_C / NWC;                    // E: output channels a warp owns
constexpr int NT8 = CPW / 8;                      // E: its m16n8 output tiles
static_assert((BN * FB_CC) % 16 == 0 && (BN * FB_RC) % 16 == 0 && (BN * FB_CM) % 16 == 0 && RM_BYTES % 16 == 0,
              "each section of a tile is whole 16-byte chunks");

#include "ptx.cuh"
#include "tile_build.cuh"
#include "tile_copy.cuh"
#include "query_io.cuh"
// bulk copies on sm_90 for tiles that are built (a BF16 tile's rows land in the padded tile itself, where
// 64 small row copies a tile ran slower on the H200 than every thread's 16-byte cp.async copies)
constexpr bool BULK_TILES = BULK && !DIRECT;

// B: build tile `tile` from `stage` (FULL: all BN tokens are in the sequence; no row is checked)
template <bool FULL>
__device__ __forceinline__ void build_tile(const uint8_t* stage, T* tile, int valid, int id) {
  build_path<C_KIND, C_BITS, C_GS, C_MB, D_C, FB_CC, FB_CM, 0, false, FULL>(stage + RAW_CC, stage + RAW_CM, tile, valid, id);
  build_path<R_KIND, R_BITS, R_GS, R_MB, D_R, FB_RC, FB_RM, D_C, R_PAGE, FULL, RM_PMT, PMB_R>(
      stage + RAW_RC, stage + RAW_RM, tile, valid, id);
}
__device__ __forceinline__ void build_tile_any(const uint8_t* stage, T* tile, int valid, int id) {
  if (valid == BN) build_tile<true>(stage, tile, valid, id);
  else build_tile<false>(stage, tile, valid, id);
}

extern "C" __global__ void __launch_bounds__(NT, MIN_CTAS) mla_decode(MLA_DECODE_PARAMS) {
  extern __shared__ __align__(16) uint8_t smem[];
  T* sQ = reinterpret_cast<T*>(smem + SM_Q);
  float* sS = reinterpret_cast<float*>(smem + SM_S);
  T* sP = reinterpret_cast<T*>(smem + SM_P);
  float* sAlpha = reinterpret_cast<float*>(smem + SM_ROW);
  float* sL = sAlpha + BM;
  float* sQs = sL + BM;  // per row: the factor that undoes the query's power-of-two scaling
  int* sMoved = reinterpret_cast<int*>(smem + SM_FLAG);
  uint64_t* sBar = reinterpret_cast<uint64_t*>(smem + SM_BAR);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid < 2) sMoved[tid] = 0;
  if (tid < BM) sAlpha[tid] = 0.0f;  // the query block's largest |q| per row starts at 0
  const int u = blockIdx.x;
  const int hb = blockIdx.y;
  const int b = units[4 * u], start = units[4 * u + 1], end = units[4 * u + 2], nsplit = units[4 * u + 3];
  const int L = seq_lens[b];
  const int* bt_row = block_table + (int64_t)b * stride_bt;
  const int row0 = hb * BM;

  // ---- roles: with WS, warps [0, NWC) compute and the others copy and build; else every warp does both --
  const bool builds = !WS || warp >= NWC;  // with WS the others compute
  const int btid = WS ? tid - 32 * NWC : tid;  // thread index among the builders
  const int ntiles = (end - start + BN - 1) / BN;
  // bar ids: 1 builders, 2 computers, 3 + buf tile built, 5 + buf tile read (WS only)
  auto sync_computers = [&]() { if constexpr (WS) bar_sync(2, 32 * NWC); else __syncthreads(); };
  auto page_of = [&](int it) { return it < ntiles ? __ldg(bt_row + (start + it * BN) / PS) : 0; };  // tile it's page

  // ---- A, prologue: STAGES - 1 tiles start copying before the query block is read (their page numbers
  //      read at once), so the two latencies overlap --------------------------------------------------------
  // BULK_TILES: one warp (the first that builds) issues every copy; it holds the page of the next tile
  const bool issuer = BULK_TILES && warp == (WS ? NWC : 0);
  int pg_next = 0;
  if (issuer) {
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < STAGES; ++s) mbar_init(sBar + s, 1);
      mbar_fence_init();
    }
    __syncwarp();
    pg_next = start_tiles<STAGES>(ntiles, page_of, [&](int s, int pg) {
      issue_tile_bulk(smem + SM_RAW + s * RAW_BYTES, sBar + s, pages, pg, start + s * BN, lane);
    });
  } else if (!BULK_TILES && builds) {
    int pg[STAGES - 1];
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) pg[s] = page_of(s);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < ntiles) issue_tile(smem + SM_RAW + s * RAW_BYTES, pages, pg[s], start + s * BN, btid);
      cp_async_commit();
    }
  }
  // BULK_TILES: the issuer starts tile it + STAGES - 1 once every reader is done with the stage it goes into
  auto issue_next = [&](int it) {
    const int nxt = it + STAGES - 1;
    if (nxt < ntiles) issue_tile_bulk(smem + SM_RAW + (nxt % STAGES) * RAW_BYTES, sBar + nxt % STAGES, pages, pg_next,
                                      start + nxt * BN, lane);
    pg_next = page_of(nxt + 1);  // read now, used one tile later
  };

  // ---- the query block, as T (query_io.cuh) ----------------------------------------------------------
  load_query_block(qc, qr, sQ, sAlpha, sQs, b, R, row0, tid);
  __syncthreads();  // the query block is written

  if constexpr (WS) {
    if (builds) {
      for (int it = 0; it < ntiles; ++it) {
        const int buf = it & 1, valid = min(BN, end - start - it * BN);
        uint8_t* stage = smem + SM_RAW + (it % STAGES) * RAW_BYTES;
        if constexpr (BULK_TILES) mbar_wait(sBar + it % STAGES, (it / STAGES) & 1);
        else cp_async_wait<STAGES - 2>();
        bar_sync(1, NTB);                            // the stage has landed for every builder
        if (issuer) issue_next(it);                  // into the stage tile it - 1 was built from
        if (it >= 2) bar_sync(5 + buf, NT);          // the computers are done with this buffer
        T* tile = reinterpret_cast<T*>(smem + SM_KV) + buf * BN * LDK;
        build_tile_any(stage, tile, valid, btid);
        if constexpr (!BULK_TILES) {
          const int nxt = it + STAGES - 1;           // into the stage tile it - 1 was built from
          if (nxt < ntiles) issue_tile(smem + SM_RAW + (nxt % STAGES) * RAW_BYTES, pages, page_of(nxt), start + nxt * BN, btid);
          cp_async_commit();
        }
        bar_arrive(3 + buf, NT);                     // the tile is built
      }
      if constexpr (!BULK_TILES) cp_async_wait<0>();
      return;
    }
  }

  // ---- the query fragments of this warp's row block and channel share, in registers when they fit ------
  const int ks = warp % KSPLIT, ot0 = (warp / KSPLIT) * TPW;
  const int qmi = ot0 / (BN / 8), nj0 = ot0 % (BN / 8);
  const T* qa = sQ + (qmi * 16 + (lane & 15)) * LDK + (lane >> 4) * 8 + ks * KSTEPS * 16;
  uint32_t qf[QREG ? KSTEPS : 1][4];
  if constexpr (QREG) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) ldsm_x4(qf[kk], qa + kk * 16);
  }

  // ---- running softmax state: warp w owns rows w·RPW .. w·RPW + RPW - 1, RP at a time, LPR lanes a row;
  //      a lane holds the state of row w·RPW + RP·i + lane / LPR -------------------------------------------
  constexpr int RPW = BM / NWC;
  constexpr int RP = RPW % 2 == 0 ? 2 : 1;  // rows a pass: two rows share one shuffle per reduction step
  constexpr int LPR = 32 / RP;              // lanes a row
  constexpr int TPL = BN / LPR;             // consecutive tokens a lane
  static_assert(TPL == 1 || TPL == 2 || TPL == 4, "a lane's scores are one vector load");
  const int lrow = lane / LPR, lcol = lane % LPR;
  float m_run[RPW / RP], l_run[RPW / RP];
  int limit[RPW / RP];  // tokens a row may see (causal multi-query)
#pragma unroll
  for (int i = 0; i < RPW / RP; ++i) {
    m_run[i] = -INFINITY;
    l_run[i] = 0.0f;
    limit[i] = L - causal * (SQ - 1 - (row0 + warp * RPW + RP * i + lrow) / H);
  }

  // ---- PV accumulators: warp w owns channels [w·CPW, (w+1)·CPW) of every row ----------------------------
  float acc[RM][NT8][4];
#pragma unroll
  for (int mi = 0; mi < RM; ++mi)
#pragma unroll
    for (int nj = 0; nj < NT8; ++nj)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][nj][e] = 0.0f;

  for (int it = 0; it < ntiles; ++it) {
    const int n0 = start + it * BN;
    const int valid = min(BN, end - n0);
    T* tile = nullptr;
    if constexpr (WS) {
      tile = reinterpret_cast<T*>(smem + SM_KV) + (it & 1) * BN * LDK;
      bar_sync(3 + (it & 1), NT);  // the builders have built it
    } else {
      uint8_t* stage = smem + SM_RAW + (it % STAGES) * RAW_BYTES;
      if constexpr (BULK_TILES) mbar_wait(sBar + it % STAGES, (it / STAGES) & 1);
      else cp_async_wait<STAGES - 2>();
      __syncthreads();  // the stage has landed for every thread; the last tile's PV is done with the tile
      if (issuer) issue_next(it);  // into the stage of tile it - 1 (built, or for BF16 read, by every thread)
      if constexpr (DIRECT) {
        tile = reinterpret_cast<T*>(stage);
        if (valid < BN) {  // rows past the sequence hold whatever the page held: zero them
          for (int i = tid; i < (BN - valid) * (D / 8); i += NT) {
            const int t = valid + i / (D / 8), j = i % (D / 8);
            *reinterpret_cast<uint4*>(tile + t * LDK + 8 * j) = make_uint4(0, 0, 0, 0);
          }
        }
      } else {
        tile = reinterpret_cast<T*>(smem + SM_KV);
        if constexpr (!SKIP_BUILD) build_tile_any(stage, tile, valid, tid);
      }
      if constexpr (!BULK_TILES) {
        const int nxt = it + STAGES - 1;  // the next tile into the stage the previous iteration consumed
        if (nxt < ntiles) issue_tile(smem + SM_RAW + (nxt % STAGES) * RAW_BYTES, pages, page_of(nxt), start + nxt * BN, tid);
        cp_async_commit();
      }
      __syncthreads();  // the tile is built
    }
    // ---- C: scores. Warp group g = warp / KSPLIT owns TPW adjacent m16 x n8 score tiles of one row block,
    //      warp g·KSPLIT + ks their channel share ks; the query fragments are read once for all TPW tiles
    //      (once per kernel where they stay in registers) --------------------------------------------------
    {
      constexpr int H2 = TPW == 1 ? 2 : 1;  // two accumulator chains per tile when a warp has one tile
      float sacc[TPW][H2][4];
#pragma unroll
      for (int j = 0; j < TPW; ++j)
#pragma unroll
        for (int h = 0; h < H2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) sacc[j][h][e] = 0.0f;
      const T* kb = tile + (nj0 * 8 + (lane & 7)) * LDK + (lane >> 3) * 8 + ks * KSTEPS * 16;
      UNROLL(QK_UNROLL)
      for (int kk = 0; kk < (SKIP_QK ? 0 : KSTEPS); kk += 2) {
        uint32_t a0[4], a1[4];
        if constexpr (QREG) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            a0[e] = qf[kk][e];
            a1[e] = qf[kk + 1 < KSTEPS ? kk + 1 : kk][e];
          }
        } else {
          ldsm_x4(a0, qa + kk * 16);
          if (kk + 1 < KSTEPS) ldsm_x4(a1, qa + kk * 16 + 16);
        }
#pragma unroll
        for (int j = 0; j < TPW; ++j) {
          uint32_t bb[4];
          ldsm_x4(bb, kb + j * 8 * LDK + kk * 16);  // two 16-channel steps of 8 tokens
          mma16816(sacc[j][0], a0, bb[0], bb[1]);
          if (kk + 1 < KSTEPS) mma16816(sacc[j][H2 - 1], a1, bb[2], bb[3]);
        }
      }
#pragma unroll
      for (int j = 0; j < TPW; ++j) {
        float* dst = sS + (ks * BM + qmi * 16 + (lane >> 2)) * LDS + (nj0 + j) * 8 + (lane & 3) * 2;
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = H2 == 2 ? sacc[j][0][e] + sacc[j][H2 - 1][e] : sacc[j][0][e];
        *reinterpret_cast<float2*>(dst) = make_float2(v[0], v[1]);
        *reinterpret_cast<float2*>(dst + 8 * LDS) = make_float2(v[2], v[3]);
      }
    }
    sync_computers();

    // ---- D: online softmax (base 2), LPR lanes per row. A row's reference maximum moves only when the
    //      tile's maximum exceeds it by more than 8 (P stays below 2^8), so most tiles rescale nothing ----
    if (tid == 0) sMoved[(it + 1) & 1] = 0;  // the next tile's flag (the last tile that read it is done)
#pragma unroll
    for (int i = 0; i < RPW / RP; ++i) {
      const int rr = warp * RPW + RP * i + lrow, t0 = lcol * TPL;
      const float qs = sQs[rr] * qk_scale_log2;
      float s[TPL];
#pragma unroll
      for (int e = 0; e < TPL; ++e) s[e] = 0.0f;
#pragma unroll
      for (int k2 = 0; k2 < KSPLIT; ++k2) {
        const float* src = sS + (k2 * BM + rr) * LDS + t0;
        if constexpr (TPL == 4) {
          const float4 v = *reinterpret_cast<const float4*>(src);
          s[0] += v.x, s[1] += v.y, s[2] += v.z, s[3] += v.w;
        } else if constexpr (TPL == 2) {
          const float2 v = *reinterpret_cast<const float2*>(src);
          s[0] += v.x, s[1] += v.y;
        } else {
          s[0] += src[0];
        }
      }
      float mt = -INFINITY;
#pragma unroll
      for (int e = 0; e < TPL; ++e) {
        const int t = t0 + e;
        s[e] = t < valid && n0 + t < limit[i] ? s[e] * qs : -INFINITY;
        mt = fmaxf(mt, s[e]);
      }
      // one vote first: the rows' maxima are reduced only where some lane's exceeds its reference by 8
      // (false while the row has seen nothing: both -inf); a warp's rows take the same branch
      const bool any = __any_sync(0xffffffffu, mt > m_run[i] + 8.0f);
      if (any) {
#pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
      }
      const bool moves = any && mt > m_run[i] + 8.0f;
      const float m_use = moves ? mt : m_run[i];
      const float m_safe = m_use == -INFINITY ? 0.0f : m_use;
      const float alpha = moves ? fast_exp2(m_run[i] - m_safe) : 1.0f;
      float ps = 0.0f, p[TPL];
#pragma unroll
      for (int e = 0; e < TPL; ++e) {
        p[e] = s[e] == -INFINITY ? 0.0f : fast_exp2(s[e] - m_safe);
        ps += p[e];
      }
      T* dst = sP + rr * LDP + t0;
      if constexpr (TPL == 1) {
        *dst = T(p[0]);
      } else {
        uint32_t pk[TPL / 2 > 0 ? TPL / 2 : 1];  // pairs of 16-bit probabilities
#pragma unroll
        for (int e = 0; e < TPL / 2; ++e) {
#if HALF
          pk[e] = as_u32(__floats2half2_rn(p[2 * e], p[2 * e + 1]));
#else
          pk[e] = as_u32(__floats2bfloat162_rn(p[2 * e], p[2 * e + 1]));
#endif
        }
        if constexpr (TPL == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(pk[0], pk[1]);
        else *reinterpret_cast<uint32_t*>(dst) = pk[0];
      }
      l_run[i] = l_run[i] * alpha + ps;  // this lane's share of the row's sum (reduced in the epilogue)
      m_run[i] = m_use;
      if (lcol == 0) {
        sAlpha[rr] = alpha;
        if (moves) sMoved[it & 1] = 1;
      }
    }
    sync_computers();

    // ---- E: acc = acc·alpha + P·c over this warp's channels --------------------------------------------
    if (sMoved[it & 1]) {  // some row's reference maximum moved: rescale the accumulators
#pragma unroll
      for (int mi = 0; mi < RM; ++mi) {
        const float a_lo = sAlpha[mi * 16 + (lane >> 2)], a_hi = sAlpha[mi * 16 + (lane >> 2) + 8];
#pragma unroll
        for (int nj = 0; nj < NT8; ++nj) {
          acc[mi][nj][0] *= a_lo;
          acc[mi][nj][1] *= a_lo;
          acc[mi][nj][2] *= a_hi;
          acc[mi][nj][3] *= a_hi;
        }
      }
    }
#pragma unroll
    for (int k0 = 0; k0 < (SKIP_PV ? 0 : BN); k0 += 16) {
      uint32_t pa[RM][4];
#pragma unroll
      for (int mi = 0; mi < RM; ++mi) ldsm_x4(pa[mi], sP + (mi * 16 + (lane & 15)) * LDP + k0 + (lane >> 4) * 8);
#pragma unroll
      for (int nj = 0; nj < NT8; nj += 2) {
        uint32_t vb[4];  // tokens k0..k0+15 x channels (two n8 tiles), transposed on the way in
        ldsm_x4_t(vb, tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDK + warp * CPW + nj * 8 + (lane >> 4) * 8);
#pragma unroll
        for (int mi = 0; mi < RM; ++mi) {
          mma16816(acc[mi][nj], pa[mi], vb[0], vb[1]);
          mma16816(acc[mi][nj + 1], pa[mi], vb[2], vb[3]);
        }
      }
    }
    if constexpr (WS) {
      if (it + 2 < ntiles) bar_arrive(5 + (it & 1), NT);  // the builders may build tile it + 2 here
    }
  }
  if constexpr (!WS && !BULK_TILES) cp_async_wait<0>();

  // ---- epilogue: normalise, write the output (or the split's partial) and the log-sum-exp --------------
#pragma unroll
  for (int i = 0; i < RPW / RP; ++i) {
    const int rr = warp * RPW + RP * i + lrow;
#pragma unroll
    for (int o = LPR / 2; o > 0; o >>= 1) l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], o);
    if (lcol == 0) {
      sL[rr] = l_run[i];
      const int r = row0 + rr;
      if (r < R) {
        const float lv = l_run[i] > 0.0f ? (m_run[i] + log2f(l_run[i])) * 0.6931471805599453f : -INFINITY;
        if (nsplit == 1) lse[(int64_t)b * R + r] = lv;
        else part_lse[(int64_t)u * R + r] = lv;
      }
    }
  }
  sync_computers();
#pragma unroll
  for (int mi = 0; mi < RM; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rr = mi * 16 + (lane >> 2) + 8 * h;
      const int r = row0 + rr;
      if (r >= R) continue;
      const float l = sL[rr];
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      const int64_t orow = nsplit == 1 ? (int64_t)b * R + r : (int64_t)u * R + r;
#pragma unroll
      for (int nj = 0; nj < NT8; ++nj) {
        const int c = warp * CPW + nj * 8 + (lane & 3) * 2;
        constexpr int CS = 1;
        const float o0 = acc[mi][nj][2 * h] * inv, o1 = acc[mi][nj][2 * h + 1] * inv;
        if (nsplit != 1) store_pair<CS>(part_out + orow * D_C + c, o0 * PART_SCALE, o1 * PART_SCALE);
        else store_pair<CS>(reinterpret_cast<OutT*>(out) + orow * D_C + c, o0, o1);
      }
    }
  }
}
