// Absorbed-MLA decode over an INT4/INT4 paged cache (affine, groups 128/64, fp16 metadata: DeepSeek's geometry) with
// the tokens as the M of Hopper's warpgroup MMAs and 64 query rows (heads x query tokens) as their N (sm_90a): the
// many-heads kernel that builds no tile. The heads-as-M kernel (mla_decode_wg.cu) dequantizes each tile into shared
// memory before its products read it; here the codes go straight into the register A operands of wgmma m64n64k16,
// dequantized there, and only the query block and P sit in shared memory as B operands.
//
// One CTA of three warpgroups takes 64 query rows of one work unit (sequence b, tokens [start, end)), one CTA an SM.
// Thread 0 bulk-copies each 64-token tile's four page sections (codes and metadata of both paths) into one of
// STAGES raw stages. Per tile:
//
//   warpgroup 0  scores  Sᵀ[64 tokens, 64 rows] = K·Qᵀ over 576 channels: 36 products whose A operands are the
//                tokens' codes dequantized in registers (code·scale + zero, one fp16 rounding: tm64_ops.cuh), B the
//                query block (fp16, each row scaled by a power of two undone here, its channels in the order the A
//                operands take them: query_channel). Then the softmax: a row's reference maximum moves only where
//                some score exceeds it by more than MAX_SLACK in base 2 (P above 2^MAX_SLACK; one vote of the
//                warpgroup), and then to the tile's
//                exact row maxima (over the 64 tokens); P = 2^(S - ref) in fp16 into one of two P buffers, its rows
//                in the order the output's A operands pair the tokens; each row's Σ P kept by its threads.
//   warpgroups 1, 2  output  Oᵀ[channels, 64 rows] += V·Pᵀ: warpgroup 1 + o takes the code bytes 128o .. 128o + 127
//                (channels 128o .., plane 0, and 256 + 128o .., plane 1): 4 m-blocks of 64 channels x 4 k-steps of
//                16 tokens, the A operand two tokens' values of one channel (one byte permute, then deq_pair). Where
//                a reference moved, the accumulators are first rescaled by 2^(old - new) a row.
//
// Tokens past the unit's end: their metadata is zeroed in the stage (a page's stale bytes may be NaN as fp16; zero
// scale and zero make their values 0) and their scores -inf, as are tokens past a row's causal limit. The epilogue
// writes the unit's output and log-sum-exp as the other CUDA decode kernels do (the sequence's own rows where it has
// one split, else the unit's partial rows for the combine kernel).
//
// Macros (quantmla.kernels.cuda.tokens_m64): TM64 HALF NW BN (fixed: the plan's), PS PAGE_BYTES OFF_CC OFF_RC OFF_CM
// OFF_RM OUT_KIND SMEM_EXPECTED, the partials' PART_KIND and PART_SHIFT; STAGES, REGS_S (the scores' warpgroup's
// registers: setmaxnreg), MAX_SLACK (below); SKIP_QK, SKIP_PV (ptx.cuh: a phase's products left out, times only).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
typedef __half T;
typedef __half2 T2;
#define WG_AB "f16"
#define MMA_TYPE "f16"
#include "ptx.cuh"
#include "out_io.cuh"
#include "wgmma.cuh"
#include "tm64_ops.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "the tokens-as-M decode kernel at 64 rows runs on Hopper's warpgroup MMAs (sm_90a)"
#endif
#ifndef STAGES
#define STAGES 5
#endif
#ifndef REGS_S
#define REGS_S 152
#endif
#ifndef MAX_SLACK
#define MAX_SLACK 8  // base-2 units a score may exceed its row's reference before the reference moves
#endif

constexpr int D_C = 512, D_R = 64, D = D_C + D_R;  // DeepSeek's latent and RoPE key
constexpr int BM = 64, NT = 384, NPBUF = 2;  // query rows, threads, P buffers (BN: 64 tokens a tile)
static_assert(BN == 64 && NW == 12 && HALF, "the plan of this kernel: 64-token tiles, three warpgroups, fp16 operands");
static_assert(PS % BN == 0, "a tile lies inside one page");
static_assert(PAGE_BYTES == PS * (FB_CC + FB_RC + FB_CM + FB_RM) && OFF_RC == PS * FB_CC && OFF_CM == OFF_RC + PS * FB_RC &&
              OFF_RM == OFF_CM + PS * FB_CM, "the page's sections are tm64_ops.cuh's: INT4/INT4, groups 128/64, fp16 metadata");
static_assert(STAGES > NPBUF, "a stage is refilled once the tile NPBUF before is done: more stages than P buffers");
// the threads' registers at launch (65536 / 384, rounded down to 8): what the scores' warpgroup gives back is all the
// output's two take (setmaxnreg.inc waits for registers in the CTA's pool of 384 x 168)
constexpr int REGS_BASE = 168, REGS_O = (3 * REGS_BASE - REGS_S) / 2 / 8 * 8;
static_assert(REGS_S % 8 == 0 && REGS_S >= 24 && REGS_S <= REGS_BASE && REGS_O <= 256, "setmaxnreg");

constexpr int SM_Q = 0;                          // 9 chunks: the query block, K-major (rows as N)
constexpr int SM_P = SM_Q + 9 * CHUNK;           // NPBUF chunks: P [64 tokens x 64 rows], N-major
constexpr int SM_RAW = SM_P + NPBUF * CHUNK;     // STAGES raw stages
constexpr int SM_BAR = SM_RAW + STAGES * RAW_BYTES;    // their mbarriers
constexpr int SM_FLAG = SM_BAR + 8 * STAGES;     // [NPBUF]: whether a P buffer's tile moved a reference
constexpr int SM_RED = SM_FLAG + 16;             // [4 warps, 64 rows] fp32: over_tokens
constexpr int SM_ALPHA = SM_RED + 1024;          // [NPBUF, 64 rows] fp32: each row's rescale factor a P buffer
constexpr int SM_L = SM_ALPHA + NPBUF * BM * 4;  // [64 rows] fp32: Σ P a row over the unit
constexpr int SM_QF = SM_L + BM * 4;             // [64 rows] fp32: the factor that takes a row's scores to base 2
constexpr int SM_LIM = SM_QF + BM * 4;           // [64 rows] int: the end of a row's tokens in the unit (causal)
constexpr int SMEM = SM_LIM + BM * 4 + 1024;     // + the slack that aligns the chunks to 1024 bytes
static_assert(SMEM == SMEM_EXPECTED, "the plan's shared-memory size (tokens_m64.py) disagrees with this map");
enum { BAR_VOTE = 1, BAR_FULL = 2, BAR_EMPTY = 4, BAR_EPI = 6 };  // named barriers (FULL, EMPTY: one a P buffer)

#include "query_pieces.cuh"  // MLA_DECODE_PARAMS, the rows' power-of-two scales

template <int N, bool INC>
__device__ __forceinline__ void set_max_regs() {
  if constexpr (N == REGS_BASE) return;
  else if constexpr (INC) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

extern "C" __global__ void __launch_bounds__(NT, 1) mla_decode(MLA_DECODE_PARAMS) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint64_t* sBar = reinterpret_cast<uint64_t*>(smem + SM_BAR);
  float* sFlag = reinterpret_cast<float*>(smem + SM_FLAG);
  float* sQf = reinterpret_cast<float*>(smem + SM_QF);
  const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * BM, u = blockIdx.y;  // row blocks vary fastest: they share the unit's tiles in L2
  const int b = units[4 * u], start = units[4 * u + 1], end = units[4 * u + 2], nsplit = units[4 * u + 3];
  const int L = seq_lens[b];
  const int* bt_row = block_table + (int64_t)b * stride_bt;
  const int ntiles = end > start ? (end - start + BN - 1) / BN : 0;

  // tile `it`'s four page sections into raw stage s (thread 0), a bulk copy each (units start on whole tiles:
  // get_mla_metadata cuts them so, and PS % BN == 0 keeps a tile inside its page). (One copy of a whole 64-token
  // page instead costs the scores' warpgroup 40 bytes of spill in its tile loop.)
  auto issue = [&](int it, int s) {
    const int n0 = start + it * BN, t0 = n0 % PS;
    const uint8_t* pg = pages + (int64_t)bt_row[n0 / PS] * PAGE_BYTES;
    uint8_t* raw = smem + SM_RAW + s * RAW_BYTES;
    mbar_expect_tx(sBar + s, RAW_BYTES);
    bulk_g2s(raw + RAW_CC, pg + OFF_CC + t0 * FB_CC, BN * FB_CC, sBar + s);
    bulk_g2s(raw + RAW_RC, pg + OFF_RC + t0 * FB_RC, BN * FB_RC, sBar + s);
    bulk_g2s(raw + RAW_CM, pg + OFF_CM + t0 * FB_CM, BN * FB_CM, sBar + s);
    bulk_g2s(raw + RAW_RM, pg + OFF_RM + t0 * FB_RM, BN * FB_RM, sBar + s);
  };
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(sBar + s, 1);
    mbar_fence_init();
    sFlag[0] = sFlag[1] = 0.0f;
    for (int s = 0; s < STAGES && s < ntiles; ++s) issue(s, s);
  }

  // the query block: a warp a row (rows warp, warp + 12, ..), its 72 pieces of 8 channels read coalesced (every row's
  // loads issued before the first is used); the power of two that brings the row's largest |q| below 2^13 (fp16's
  // range with room for the sums), then each channel times it, in fp16, at its position query_position(c); rows past
  // R are zero
  constexpr int QROWS = (BM + NT / 32 - 1) / (NT / 32);  // rows a warp (6, the last only for some warps)
  uint4 qv[QROWS][3];
#pragma unroll
  for (int i = 0; i < QROWS; ++i) {
    const int r = (tid >> 5) + i * (NT / 32), gr = row0 + r;
    const int64_t qrow = (int64_t)b * R + (gr < R ? gr : 0);
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const int pc = lane + 32 * k, c = pc >> 3, j = pc & 7;
      qv[i][k] = make_uint4(0, 0, 0, 0);
      if (r < BM && gr < R && pc < D / 8)
        qv[i][k] = __ldg(reinterpret_cast<const uint4*>(c < 8 ? qc + qrow * D_C + 64 * c + 8 * j : qr + qrow * D_R + 8 * j));
    }
  }
#pragma unroll
  for (int i = 0; i < QROWS; ++i) {
    const int r = (tid >> 5) + i * (NT / 32), gr = row0 + r;
    if (r >= BM) break;  // (warp-uniform)
    const uint32_t m = max(max(piece_amax_bits(qv[i][0]), piece_amax_bits(qv[i][1])), piece_amax_bits(qv[i][2]));
    const float scale = row_scale_below_2p13(__uint_as_float(__reduce_max_sync(0xffffffffu, m)));
    if (lane == 0) {
      sQf[r] = qk_scale_log2 / scale;
      reinterpret_cast<int*>(smem + SM_LIM)[r] = min(end, L - causal * (SQ - 1 - gr / H));
    }
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const int pc = lane + 32 * k;
      if (pc >= D / 8) continue;
      const uint4 h = piece_to_half(qv[i][k], scale);
      const uint16_t* hv = reinterpret_cast<const uint16_t*>(&h);
#pragma unroll
      for (int x = 0; x < 8; ++x) {
        const int P = query_position(8 * pc + x);
        *reinterpret_cast<uint16_t*>(smem + SM_Q + (P >> 6) * CHUNK + swz(r, (P & 63) >> 3) + 2 * (P & 7)) = hv[x];
      }
    }
  }
  fence_proxy_async();  // the query block, visible to the products
  __syncthreads();

  if (wg == 0) {
    // ---------------- scores and softmax: warpgroup 0 ----------------
    set_max_regs<REGS_S, false>();
    const uint64_t dq = sw128_desc(smem + SM_Q, 16, 1024);
    const int r_lo = 16 * w + g;  // the thread's tokens of a tile: r_lo and r_lo + 8
    float* red = reinterpret_cast<float*>(smem + SM_RED);
    const int* sLim = reinterpret_cast<const int*>(smem + SM_LIM);
    const int full_to = min(end, L - causal * (SQ - 1));  // tokens before this are every row's
    float ref[16], lsum[16];  // the reference maxima and Σ P of its rows 8(i / 2) + 2t + i % 2
#pragma unroll
    for (int i = 0; i < 16; ++i) ref[i] = -INFINITY, lsum[i] = 0.0f;
    for (int it = 0; it < ntiles; ++it) {
      const int buf = it % NPBUF, n0 = start + it * BN, valid = min(BN, end - n0);
      uint8_t* st = smem + SM_RAW + (it % STAGES) * RAW_BYTES;
      mbar_wait(sBar + it % STAGES, (it / STAGES) & 1);
      if (valid < BN) {  // the stale tokens' metadata zeroed (their values 0, not NaN), for both roles
        for (int n = valid + tid; n < BN; n += 128) {
          *reinterpret_cast<uint4*>(st + RAW_CM + n * FB_CM) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint32_t*>(st + RAW_RM + n * FB_RM) = 0u;
        }
        fence_proxy_async();  // (before the copy engine refills the stage)
        bar_sync(BAR_VOTE, 128);
      }
      // the scores: every k-step's A operand its dequantized values, all 36 products on sc
      float sc[32];
      scores_dqa<2, 1>(sc, st, dq, r_lo, t);
      // base 2 (each row's query scale undone); tokens past the unit's end or a row's causal limit -inf
      const bool edge = n0 + BN > full_to;
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const int n = 8 * (e >> 2) + 2 * t + (e & 1);
        sc[e] *= sQf[n];
        if (edge && n0 + r_lo + (e & 2) * 4 >= sLim[n]) sc[e] = -INFINITY;
      }
      // the vote: does any score exceed its row's reference by more than the slack? Then every row's reference moves
      // to the tile's exact maximum (where larger), the sums and (through the flag) the output rescaled
      bool up = false;
#pragma unroll
      for (int e = 0; e < 32; ++e) up |= sc[e] > ref[(e >> 2) * 2 + (e & 1)] + (float)MAX_SLACK;
      const bool moved = bar_or(BAR_VOTE, 128, up);
      float al[16];
      if (moved) {
#pragma unroll
        for (int i = 0; i < 16; ++i) al[i] = fmaxf(sc[4 * (i >> 1) + (i & 1)], sc[4 * (i >> 1) + 2 + (i & 1)]);
        over_tokens<true, BAR_VOTE>(al, red, w, g, t);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const float nr = fmaxf(ref[i], al[i]);
          al[i] = nr == -INFINITY ? 1.0f : fast_exp2(ref[i] - nr);  // 0 where the row had no token before
          lsum[i] *= al[i], ref[i] = nr;
        }
      }
      if (it >= NPBUF) bar_sync(BAR_EMPTY + buf, NT);  // the output's products of tile it - NPBUF are done
      if (tid == 0) sFlag[buf] = moved ? 1.0f : 0.0f;
      if (moved && w == 0 && g == 0) {
#pragma unroll
        for (int i = 0; i < 16; ++i) reinterpret_cast<float*>(smem + SM_ALPHA)[buf * BM + 8 * (i >> 1) + 2 * t + (i & 1)] = al[i];
      }
      if (tid == 0 && it >= NPBUF && it - NPBUF + STAGES < ntiles) issue(it - NPBUF + STAGES, (it - NPBUF) % STAGES);
      write_p<false>(sc, ref, lsum, smem + SM_P + buf * CHUNK, w, g, t);  // P, Σ P
      fence_proxy_async();  // P, visible to the products
      bar_arrive(BAR_FULL + buf, NT);
    }
    // each row's Σ P over the unit; the log-sum-exp of the warpgroup's rows (its w 0, g 0 threads: all 64)
    over_tokens<false, BAR_VOTE>(lsum, red, w, g, t);
    if (w == 0 && g == 0) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int n = 8 * (i >> 1) + 2 * t + (i & 1), r = row0 + n;
        reinterpret_cast<float*>(smem + SM_L)[n] = lsum[i];
        if (r < R) {
          const float lv = lsum[i] > 0.0f ? (ref[i] + log2f(lsum[i])) * 0.6931471805599453f : -INFINITY;
          if (nsplit == 1) lse[(int64_t)b * R + r] = lv;
          else part_lse[(int64_t)u * R + r] = lv;
        }
      }
    }
    bar_arrive(BAR_EPI, NT);
  } else {
    // ---------------- output: warpgroups 1 and 2 ----------------
    set_max_regs<REGS_O, true>();
    const int o = wg - 1;  // code bytes 128o .. 128o + 127: group o in plane 0, group o + 2 in plane 1
    float acc[4][32];
#pragma unroll
    for (int mb = 0; mb < 4; ++mb)
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[mb][i] = 0.0f;
    const int col = 128 * o + 32 * w + 4 * g;  // the thread's 4 bytes: byte pairs z = 0, 1 (channel rows g, g + 8)
    for (int it = 0; it < ntiles; ++it) {
      const int buf = it % NPBUF;
      const uint8_t* st = smem + SM_RAW + (it % STAGES) * RAW_BYTES;
      bar_sync(BAR_FULL + buf, NT);
      if (sFlag[buf] != 0.0f)  // a reference moved: the accumulators rescaled by 2^(old - new) a row
        scale_rows(acc, reinterpret_cast<const float*>(smem + SM_ALPHA) + buf * BM, t);
      const uint64_t dp = sw128_desc(smem + SM_P + buf * CHUNK, CHUNK, 1024);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        output_dqa_kstep(acc, st, dp, kk, col, o, t);
        wgmma_wait<0>();  // the operand registers are free
      }
#pragma unroll
      for (int mb = 0; mb < 4; ++mb) fence_regs(acc[mb]);
      if (it + NPBUF < ntiles) bar_arrive(BAR_EMPTY + buf, NT);  // (the scores' warpgroup waits only for those)
    }
    // O = acc / Σ P a row; row 8j + 2t + e % 2, channel 256p + 128o + 32w + 4g + 2z + e / 2 of m-block 2p + z
    bar_sync(BAR_EPI, NT);
    const float* Ls = reinterpret_cast<const float*>(smem + SM_L);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int n = 8 * j + 2 * t + x, r = row0 + n;
        if (r >= R) continue;
        const float l = Ls[n], inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int64_t orow = nsplit == 1 ? (int64_t)b * R + r : (int64_t)u * R + r;
#pragma unroll
        for (int mb = 0; mb < 4; ++mb) {
          const int c = 256 * (mb >> 1) + 128 * o + 32 * w + 4 * g + 2 * (mb & 1);
          const float o0 = acc[mb][4 * j + x] * inv, o1 = acc[mb][4 * j + 2 + x] * inv;
          if (nsplit != 1) store_pair<1>(part_out + orow * D_C + c, o0 * PART_SCALE, o1 * PART_SCALE);
          else store_pair<1>(reinterpret_cast<OutT*>(out) + orow * D_C + c, o0, o1);
        }
      }
  }
}
