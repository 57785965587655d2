// Absorbed-MLA decode over a BF16 paged cache with the query rows (heads x query tokens) as the M of Hopper's
// warpgroup MMAs, the two warpgroups out of phase (sm_90a): the heads-as-M kernel's launch shape and arguments
// (mla_decode_wg.cu: 64 rows a CTA, 128 heads in two CTAs, tensor maps over the pages), another tile loop.
//
// The tiles go in pairs, tile a = 2i in stage 0 and tile b = 2i + 1 in stage 1. Warpgroup 0 takes the scores of
// tile a, warpgroup 1 those of tile b, each all 64 tokens (m64n64k16, the query block read once a tile); the output
// stays split by channels (warpgroup g owns 256g .. 256g + 255), so each warpgroup multiplies its own P from its
// registers and the other's P from shared memory:
//
//   warpgroup 0                                     warpgroup 1
//   softmax of a: m0 = max(m, a's), P_a, rescale    .
//   O_L += P_a·V_aL (P from registers)              softmax of b: m1 = max(m0, b's), P_b, rescale by both
//   P_a·(m0 → m1) to shared memory                  O_R += P_b·V_bR (registers); P_b to shared memory
//   O_L ·= (m0 → m1); O_L += P_b·V_bL               O_R += P_a·V_aR
//   scores of a + 2                                 scores of b + 2
//
// so that one warpgroup's softmax runs under the other's products. The running maxima pass through shared memory
// (exact bookkeeping: every increase rescales), each warpgroup keeps the sums of the P it made. A stage is nine
// chunks with a barrier each, refilled chunk by chunk as soon as its last reader is done: chunks 0-3 (V_L) after
// warpgroup 0's output products, 4-7 (V_R) after warpgroup 1's, and the RoPE chunk 8, which only the scores read,
// holds the tile's P in bf16 for the other warpgroup once its scores are done (no room for separate P buffers
// beside the query block and two stages).
//
// Macros: as mla_decode_wg.cu's BF16 plan (D_C D_R PS PAGE_BYTES OFF_CC OFF_RC FB_CC FB_RC OUT_KIND SMEM_EXPECTED
// WG NW BN TMA HALF), SEESAW (1: this source).

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef __nv_bfloat16 T;
typedef __nv_bfloat162 T2;
#define WG_AB "bf16"
#define MMA_TYPE WG_AB

#include "ptx.cuh"
#include "out_io.cuh"
#include "wgmma.cuh"
#include "query_pieces.cuh"  // MLA_DECODE_PARAMS
#include "wg_copy.cuh"
#include "wg_epilogue.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "the heads-as-M decode kernel runs on Hopper's warpgroup MMAs (sm_90a)"
#endif
static_assert(NW == 8 && BN == 64 && TMA == 1 && HALF == 0, "two warpgroups, 64-token tiles, bf16 through tensor maps");
static_assert(D_C == 512 && D_R == 64, "DeepSeek's cache geometry: eight latent chunks and one RoPE chunk");
static_assert(PS % BN == 0, "a tile lies inside one page");

constexpr int BM = 64;              // query rows per CTA (the MMA's M)
constexpr int NT = 256;             // two warpgroups
constexpr int NCH = 9, CCH = 8;     // 64-channel chunks of a row, of them the latent's
constexpr int CHUNK = 64 * 128;     // a chunk of 64 rows, bytes
constexpr int TILE = NCH * CHUNK;   // the query block, or one stage
constexpr int SM_Q = 0, SM_K = TILE;                  // the query block; stages 0 and 1
constexpr int SM_M = SM_K + 2 * TILE;                 // [BM] fp32: the rows' running maxima, base 2
constexpr int SM_SC = SM_M + BM * 4;                  // [2][BM] fp32: the pair's rescale factors (m → m0, m0 → m1)
constexpr int SM_L = SM_SC + 2 * BM * 4;              // [2 warpgroups][BM] fp32: the rows' sums
constexpr int SM_BAR = SM_L + 2 * BM * 4;             // [2 stages][9 chunks] mbarriers
constexpr int SMEM = SM_BAR + 2 * NCH * 8 + 1024;     // + the slack that aligns the chunks to 1024 bytes
static_assert(SMEM <= SMEM_EXPECTED, "the heads-as-M plan's shared memory holds this map");

enum { BAR_SCALE0 = 1, BAR_SCALE1, BAR_P0, BAR_P1, BAR_WG0 };  // named barriers of the 256 threads (0: __syncthreads),
                                                          // then one of each warpgroup's 128 (BAR_WG0 + wg)

extern "C" __global__ void __launch_bounds__(NT, 1) mla_decode(MLA_DECODE_PARAMS, const __grid_constant__ CUtensorMap map_c,
                                                               const __grid_constant__ CUtensorMap map_r) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint8_t* sQ = smem + SM_Q;
  float* sM = reinterpret_cast<float*>(smem + SM_M);
  float* sSc = reinterpret_cast<float*>(smem + SM_SC);
  float* sL = reinterpret_cast<float*>(smem + SM_L);
  uint64_t* sBar = reinterpret_cast<uint64_t*>(smem + SM_BAR);

  const int tid = threadIdx.x, wg = tid >> 7, lt = tid & 127, warp = lt >> 5, lane = tid & 31;
  const int row0 = blockIdx.x * BM, u = blockIdx.y;  // head blocks vary fastest: they share the unit's tiles in L2
  const int b = units[4 * u], start = units[4 * u + 1], end = units[4 * u + 2], nsplit = units[4 * u + 3];
  const int L = seq_lens[b];
  const int* bt_row = block_table + (int64_t)b * stride_bt;
  const int ntiles = end > start ? (end - start + BN - 1) / BN : 0;
  auto stage = [&](int s) { return smem + SM_K + s * TILE; };

  // the query block (rows past R read as zero), the barriers, the rows' maxima
  load_query_block_bf16(sQ, qc, qr, b, R, row0, tid, NT);
  cp_async_commit();
  if (tid < BM) sM[tid] = -INFINITY;
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 2 * NCH; ++i) mbar_init(&sBar[i], 1);
    mbar_fence_init();
  }
  __syncthreads();
  // chunks [c0, c1) of tile it into stage it & 1, each on its own barrier
  auto load = [&](int it, int c0, int c1) {
    const int n0 = start + it * BN, pg = bt_row[n0 / PS], t0 = n0 % PS, s = it & 1;
    for (int c = c0; c < c1; ++c) {
      uint64_t* bar = &sBar[s * NCH + c];
      mbar_expect_tx(bar, CHUNK);
      if (c < CCH) tma_box(stage(s) + c * CHUNK, &map_c, 64 * c, t0, pg, bar);
      else tma_box(stage(s) + c * CHUNK, &map_r, 0, t0, pg, bar);
    }
  };
  if (tid == 0) {
    if (ntiles > 0) load(0, 0, NCH);
    if (ntiles > 1) load(1, 0, NCH);
  }
  cp_async_wait<0>();
  fence_proxy_async();  // the query block, to the warpgroup MMAs
  __syncthreads();

  // this thread's rows r0 and r0 + 8 of the block, its columns 8j + cq (+ 1) of every n8 block
  const int r0 = 16 * warp + (lane >> 2), cq = 2 * (lane & 3);
  int limit[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) limit[h] = L - causal * (SQ - 1 - (row0 + r0 + 8 * h) / H);
  float o[128], s[32], l_run[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  const uint64_t dq = sw128_desc(sQ, 16, 1024);

  // the scores of tile it (stage it & 1, its barriers' phase `par`): s = Q·Kᵀ over the nine chunks, each issued as
  // soon as it lands; waits for them
  auto scores = [&](int it, int par) {
    uint8_t* st = stage(it & 1);
    const uint64_t dk = sw128_desc(st, 16, 1024);
#pragma unroll
    for (int c = 0; c < NCH; ++c) {
      mbar_wait(&sBar[(it & 1) * NCH + c], par);
      wgmma_fence();  // after the wait's branch: the compiler would otherwise fence every product
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t off = (c * CHUNK + k * 32) >> 4;
        if constexpr (!SKIP_QK) wgmma_m64n64_k(s, dq + off, dk + off, c | k);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
  };
  // the softmax of tile it's scores against the row maxima m_in (read from sM): m_out = max(m_in, the tile's), s
  // becomes P = 2^(s·qk_scale_log2 - m_out) (0 past the unit's end or a row's causal limit; `none`: no tile); returns
  // the rows' factors 2^(m_in - m_out) and adds P's sums to l_run after rescaling it by them and by `extra`
  auto softmax = [&](int it, bool none, const float* extra, float (&alpha)[2]) {
    const int n0 = start + it * BN;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int pos = n0 + 8 * j + cq + e, i = 4 * j + 2 * h + e;
          s[i] = !none && pos < end && pos < limit[h] ? s[i] * qk_scale_log2 : -INFINITY;
          mx[h] = fmaxf(mx[h], s[i]);
        }
    float m_out[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float m_in = sM[r0 + 8 * h];
      m_out[h] = fmaxf(m_in, mx[h]);
      alpha[h] = m_out[h] == -INFINITY ? 1.0f : fast_exp2(m_in - m_out[h]);
      const float ref = m_out[h] == -INFINITY ? 0.0f : m_out[h];
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * h + e];
          x = fast_exp2(x - ref);
          sum += x;
        }
      l_run[h] = l_run[h] * alpha[h] * (extra ? extra[r0 + 8 * h] : 1.0f) + sum;
    }
    __syncwarp();  // the row's four lanes read sM before it moves
    if ((lane & 3) == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) sM[r0 + 8 * h] = m_out[h];
    }
  };
  // o ·= f (rows r0, r0 + 8), skipped where no row of the warp changes
  auto rescale = [&](const float (&f)[2]) {
    if (__any_sync(0xffffffffu, f[0] != 1.0f || f[1] != 1.0f)) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[4 * j] *= f[0], o[4 * j + 1] *= f[0];
        o[4 * j + 2] *= f[1], o[4 * j + 3] *= f[1];
      }
    }
  };
  // P (s, times f a row) in bf16 into the RoPE chunk of stage st: the A operand of the other warpgroup's products
  auto store_p = [&](uint8_t* st, const float (&f)[2]) {
    uint8_t* sp = st + CCH * CHUNK;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<T2*>(sp + swz(r0 + 8 * h, j) + 2 * cq) =
            __floats2bfloat162_rn(s[4 * j + 2 * h] * f[h], s[4 * j + 2 * h + 1] * f[h]);
  };
  // the stale latent rows past the unit's end in a partial tile: zero (P·V would take NaN · 0), by one warpgroup,
  // whose four warps then meet (each warp's products read every row of V, which all four zero)
  auto zero_tail = [&](int it) {
    const int valid = min(BN, end - (start + it * BN));
    if (valid == BN) return;
    uint8_t* st = stage(it & 1);
    for (int i = lt; i < (BN - valid) * CCH * 8; i += 128) {
      const int t = valid + i / (CCH * 8), c = (i >> 3) % CCH;
      *reinterpret_cast<uint4*>(st + c * CHUNK + swz(t, i & 7)) = make_uint4(0, 0, 0, 0);
    }
    fence_proxy_async();
    bar_sync(BAR_WG0 + wg, 128);
  };
  // o += P·V of this warpgroup's 256 channels of stage st: P from registers (s, as bf16 A fragments) or from the
  // stage `pst`'s RoPE chunk
  auto output_regs = [&](uint8_t* st) {
    const uint64_t dv = sw128_desc(st + wg * 4 * CHUNK, CHUNK, 1024);
    uint32_t a[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const T2 v = __floats2bfloat162_rn(s[8 * kk + 2 * q], s[8 * kk + 2 * q + 1]);
        a[kk][q] = *reinterpret_cast<const uint32_t*>(&v);
      }
    fence_regs(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      if constexpr (!SKIP_PV) wgmma_m64n256_rn(o, a[kk], dv + ((kk * 16 * 128) >> 4));
    wgmma_commit();
  };
  auto output_smem = [&](uint8_t* st, uint8_t* pst) {
    const uint64_t dv = sw128_desc(st + wg * 4 * CHUNK, CHUNK, 1024);
    const uint64_t dp = sw128_desc(pst + CCH * CHUNK, 16, 1024);
    fence_regs(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      if constexpr (!SKIP_PV) wgmma_m64n256_n(o, dp + ((kk * 32) >> 4), dv + ((kk * 16 * 128) >> 4), 1);
    wgmma_commit();
  };

  const int npairs = (ntiles + 1) / 2;
  if (wg == 0 && ntiles > 0) scores(0, 0);
  if (wg == 1 && ntiles > 1) scores(1, 0);
  for (int i = 0; i < npairs; ++i) {
    const int ta = 2 * i, tb = ta + 1, par = i & 1;
    const bool has_b = tb < ntiles, next_a = ta + 2 < ntiles, next_b = tb + 2 < ntiles;
    uint8_t* sa = stage(0);
    uint8_t* sb = stage(1);
    float alpha[2];
    if (wg == 0) {
      softmax(ta, false, nullptr, alpha);  // m → m0
      if ((lane & 3) == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) sSc[r0 + 8 * h] = alpha[h];
      }
      bar_arrive(BAR_SCALE0, NT);
      rescale(alpha);
      zero_tail(ta);
      output_regs(sa);  // O_L += P_a·V_aL
      wgmma_wait<0>();
      fence_regs(o);
      bar_sync(BAR_SCALE1, NT);  // m1 and its factors are out
      if (lt == 0 && next_a) load(ta + 2, 0, 4);  // V_aL read: refill it
      float f[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) f[h] = sSc[BM + r0 + 8 * h];  // m0 → m1
      store_p(sa, f);  // P_a against m1, for warpgroup 1
      fence_proxy_async();
      bar_arrive(BAR_P0, NT);
      if (has_b) {
        rescale(f);
#pragma unroll
        for (int h = 0; h < 2; ++h) l_run[h] *= f[h];
        bar_sync(BAR_P1, NT);  // P_b is out, V_b's tail zeroed
        output_smem(sb, sb);   // O_L += P_b·V_bL
        wgmma_wait<0>();
        fence_regs(o);
        if (lt == 0 && next_b) {  // V_bL and P_b read: refill them (and the RoPE chunk)
          load(tb + 2, 0, 4);
          load(tb + 2, CCH, NCH);
        }
      }
      if (next_a) scores(ta + 2, par ^ 1);
    } else {
      bar_sync(BAR_SCALE0, NT);  // m0 and its factors are out
      softmax(tb, !has_b, sSc, alpha);  // m0 → m1
      if ((lane & 3) == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) sSc[BM + r0 + 8 * h] = alpha[h];
      }
      float f[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) f[h] = alpha[h] * sSc[r0 + 8 * h];  // m → m1
      bar_arrive(BAR_SCALE1, NT);
      rescale(f);
      if (has_b) {
        zero_tail(tb);
        const float one[2] = {1.0f, 1.0f};
        store_p(sb, one);
        fence_proxy_async();
        bar_arrive(BAR_P1, NT);
        output_regs(sb);  // O_R += P_b·V_bR
      }
      bar_sync(BAR_P0, NT);  // P_a is out, V_a's tail zeroed
      output_smem(sa, sa);   // O_R += P_a·V_aR
      if (has_b) {
        wgmma_wait<1>();
        if (lt == 0 && next_b) load(tb + 2, 4, CCH);  // V_bR read: refill it
      }
      wgmma_wait<0>();
      fence_regs(o);
      if (lt == 0 && next_a) load(ta + 2, 4, NCH);  // V_aR and P_a read: refill them (and the RoPE chunk)
      if (next_b) scores(tb + 2, par ^ 1);
    }
  }

  // the maxima as the last pair left them
  static_assert(!EPI_SMEM || SM_M >= 64 * 520 * 4, "EPI_SMEM stages the rows over the query block and the stages");
  wg_epilogue(o, l_run, [&](int h) { return sM[r0 + 8 * h]; }, sL, wg, lane, r0, cq, row0, R, b, u, nsplit, out, lse,
              part_out, part_lse, smem);
}
