// Absorbed-MLA decode over an integer-code paged cache, 64 query rows (heads x query tokens) a CTA of two warpgroups,
// with the codes expanded straight into the warpgroup MMAs' register A operand: the tokens (and the output's
// channels) are the M, the rows the N, and no 16-bit tile is built in shared memory.
//
// Per 64-token tile, its page sections bulk-copied into one of RAW_N raw stages (as mla_decode_wg.cu's LOWBIT plans):
//
//   scores  Sᵀ[token, row] = K·Qᵀ: warpgroup g takes the 18 k-steps (16 channels each) 18g .. 18g + 17 of the 576
//           channels over all 64 tokens (m64n64k16; A: warp w's tokens 16w .. 16w + 15 expanded from their codes, one
//           HFMA2 a pair as in the built tile, so the values are the same fp16 values; B: the query block). The query
//           block stores each 16-channel block in the order the codes' bytes give the A operand: positions 2q, 2q + 1
//           hold channels 4q, 4q + 1 and positions 2q + 8, 2q + 9 channels 4q + 2, 4q + 3 (sigma below). The two
//           partial sums meet through shared memory: warpgroup g finishes rows 32g .. 32g + 31 of every token.
//   softmax base 2, a lazy reference maximum a row (moved only where a tile exceeds it by more than 2^MAX_SLACK); P
//           [row][token] in fp16 to shared memory, one CTA barrier a tile votes whether a row moved.
//   output  Oᵀ[channel, row] += Vᵀ·Pᵀ: warpgroup g owns 256 channels as four 64-channel M blocks (A: two tokens' codes
//           of one channel a register, a byte permute and one HFMA2; B: P).
//
// Channels of the output: thread (warp w, lane l) of warpgroup g reads the code word wi = 8w + l / 4 of the
// warpgroup's 128 bytes (4-bit content: bytes 128g .., both planes; 2-bit: bytes 0 .., planes 2g and 2g + 1); M block
// mb's rows 16w + l / 4 (+ 8) are that word's byte 2·(mb % 2) (+ 1) in plane mb / 2.
//
// Macros: those of a heads-as-M LOWBIT plan with HALF (fp16 metadata on both paths), 2- or 4-bit content codes,
// 2-, 4- or 8-bit RoPE codes; WGR=1 selects this source (build.py). SB: score k-steps a commit group (3); timing experiments: SKIP_QK, SKIP_PV (a
// phase's products left out, its operands still expanded: results wrong)

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>  // code_expand.cuh
#include <stdint.h>

typedef __half T;
typedef __half2 T2;
#define WG_AB "f16"
#define MMA_TYPE WG_AB

#include "ptx.cuh"
#include "out_io.cuh"
#include "wgmma.cuh"
#include "code_expand.cuh"  // expand_pair, group_meta

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "the codes-in-registers decode kernel runs on Hopper's warpgroup MMAs (sm_90a)"
#endif
#ifndef MAX_SLACK
#define MAX_SLACK 8
#endif
#ifndef SB
#define SB 3
#endif

static_assert(LOWBIT && HALF && NW == 8 && BN == 64, "integer codes with fp16 metadata, two warpgroups, 64-token tiles");
static_assert(D_C == 512 && D_R == 64, "DeepSeek's cache geometry");
static_assert((BITS_C == 2 || BITS_C == 4) && KIND_C != 0 && KIND_C != 3 && MB_C == 2, "2- or 4-bit content codes");
static_assert(BITS_R <= 8 && KIND_R != 0 && KIND_R != 3 && MB_R == 2 && D_R * BITS_R / 8 >= 16, "RoPE codes");
static_assert(GS_C % 16 == 0 && GS_R % 16 == 0, "a k-step's 16 channels in one group");
static_assert(PS % BN == 0, "a tile lies inside one page");

constexpr int BM = 64, NT = 256, D = D_C + D_R;
constexpr int CHUNK = 64 * 128;                     // 64 rows x 64 fp16 channels, 128-byte swizzle
constexpr int NCH = D / 64;                         // 9 chunks of the query block
constexpr int KSTEPS = D / 16, KS_WG = KSTEPS / 2;  // 36 k-steps of 16 channels, 18 a warpgroup
constexpr int NB_C = D_C * BITS_C / 8, NB_R = D_R * BITS_R / 8;  // code bytes a token
constexpr int KC = 8 / BITS_C;                      // content planes
constexpr int F_C = KIND_C == 1 ? 2 : 1, F_R = KIND_R == 1 ? 2 : 1;  // metadata fields a group
// a stage: the content codes as bulk tensor copies in the 128-byte swizzle (CC: boxes of 64 tokens x 128 bytes, 16-byte
// unit j of token t's row at unit j ^ (t % 8), so that the 8 tokens a warp reads at one offset fall in 8 distinct bank
// groups), and the rest of the tile's page sections (RoPE codes, both paths' metadata) as plain bulk copies
constexpr int CC_BOXES = FB_CC / 128, CC = BN * FB_CC;
constexpr int RAW_RC = 0, RAW_CM = RAW_RC + BN * FB_RC, RAW_RM = RAW_CM + BN * FB_CM;
constexpr int RAW = RAW_RM + BN * FB_RM;
constexpr int STAGES = RAW_N;
constexpr int SM_CC = 0;                            // [STAGES] content codes, 1024-byte aligned
constexpr int SM_Q = SM_CC + STAGES * CC;           // the query block: nine chunks
constexpr int SM_P = SM_Q + NCH * CHUNK;            // P [64 rows][64 tokens] fp16, one chunk
constexpr int SM_X = SM_P + CHUNK;                  // the partial scores each warpgroup hands the other: [2][4][128] float4
constexpr int SM_MAX = SM_X + 2 * 4 * 128 * 16;     // [2 warpgroups][4 warps][32 rows] fp32: a rare tile's maxima
constexpr int SM_AL = SM_MAX + 8 * 32 * 4;          // [64 rows] fp32: the rows' output factors (a rare tile)
constexpr int SM_L = SM_AL + BM * 4;                // [2][4][32] fp32: the rows' partial sums
constexpr int SM_QF = SM_L + 8 * 32 * 4;            // [64] fp32: a query row's scale undone, times qk_scale·log2 e
constexpr int SM_RAW = SM_QF + BM * 4;              // [STAGES] the other sections
constexpr int SM_BAR = SM_RAW + STAGES * RAW;
constexpr int SMEM = SM_BAR + (8 * STAGES + 15) / 16 * 16 + 1024;
static_assert(FB_CC % 128 == 0 && CC % 1024 == 0, "whole 128-byte boxes of content codes");
static_assert(RAW % 16 == 0 && SM_RAW % 16 == 0, "16-byte aligned raw stages");
static_assert(SMEM <= SMEM_EXPECTED, "the plan's shared memory (warpgroup.py) is too small for this map");

#include "query_pieces.cuh"  // MLA_DECODE_PARAMS, piece_amax_bits, row_scale_below_2p13, piece_to_half

// d[32] (+)= A·B over k16: m64n64k16, A fp16 from registers (this thread's fragment of its warp's 16 rows, the
// m16n8k16 A layout), B fp16 K-major from shared memory (descriptor), fp32 accumulators (rows 16·warp + lane / 4
// (+ 8), columns 8j + 2·(lane % 4) (+ 1) at d[4j ..])
__device__ __forceinline__ void wgmma_m64n64_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
// SKIP_QK / SKIP_PV: an operand the left-out product would have read, kept alive
__device__ __forceinline__ void sink(const uint32_t (&a)[4]) {
  asm volatile("" ::"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]));
}

// one group's scale and zero point of two tokens' metadata words (scale, zero adjacent; zero 0 where F = 1): the
// first token's in the low halves
template <int F>
__device__ __forceinline__ void two_tokens_meta(uint32_t m0, uint32_t m1, T2& s2, T2& z2) {
  s2 = as_t2(__byte_perm(m0, m1, 0x5410));
  z2 = as_t2(F == 2 ? __byte_perm(m0, m1, 0x7632) : 0u);
}
template <int F, int MS = 2>
__device__ __forceinline__ uint32_t meta_word(const uint8_t* p) {
  return F == 2 ? *reinterpret_cast<const uint32_t*>(p) : (uint32_t)*reinterpret_cast<const uint16_t*>(p);
}

// the 32-bit word at byte `byte` (a multiple of 4) of token t's content codes in a stage's swizzled boxes
__device__ __forceinline__ const uint32_t* cc_word(const uint8_t* cc, int t, int byte) {
  return reinterpret_cast<const uint32_t*>(cc + (byte >> 7) * (BN * 128) + t * 128 + ((((byte >> 4) & 7) ^ (t & 7)) << 4) +
                                           (byte & 15));
}

// the A operand of score k-step s (channels 16s .. 16s + 15 of the 576: the latent's for s < 32, else the RoPE key's)
// for tokens ta and ta + 8: this thread's code word (bytes 4q .. 4q + 3 of the 16-channel block's bytes, one plane)
// expanded, one HFMA2 a pair. Called in unrolled loops: s is a constant there, and the path's branch folds.
template <bool ROPE>
__device__ __forceinline__ void scores_a_path(const uint8_t* cc, const uint8_t* raw, int s, int ta, int q, uint32_t (&a)[4],
                                              T2 (&s2)[2], T2 (&z2)[2], bool reload) {
  constexpr int BITS = ROPE ? BITS_R : BITS_C, KIND = ROPE ? KIND_R : KIND_C;
  constexpr int NB = ROPE ? NB_R : NB_C, FBM = ROPE ? FB_RM : FB_CM;
  constexpr int GS = ROPE ? GS_R : GS_C, F = ROPE ? F_R : F_C;
  const int c0 = 16 * (ROPE ? s - D_C / 16 : s), plane = c0 / NB, byte = c0 % NB + 4 * q, g = c0 / GS;
  const uint8_t* meta = raw + (ROPE ? RAW_RM : RAW_CM);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = ta + 8 * h;
    const uint32_t w = ROPE ? *reinterpret_cast<const uint32_t*>(raw + RAW_RC + t * FB_RC + byte) : *cc_word(cc, t, byte);
    if (reload) group_meta<F, 2, FBM % 4 == 0>(meta + t * FBM + g * F * 2, s2[h], z2[h]);
    a[h] = expand_pair<BITS, KIND>(__byte_perm(w, 0, 0x4140), plane * BITS, s2[h], z2[h]);      // channels 4q, 4q + 1
    a[2 + h] = expand_pair<BITS, KIND>(__byte_perm(w, 0, 0x4342), plane * BITS, s2[h], z2[h]);  // channels 4q + 2, 4q + 3
  }
}

// the scores of this warpgroup's k-steps S0 .. S0 + KS_WG - 1 into sa: SB k-steps a commit group, a group's operands
// expanded while the group before it runs (its buffer's last products, two groups back, waited for first); a token's
// scale and zero point loaded where a k-step starts a metadata group
template <int S0>
__device__ __forceinline__ void scores_tile(const uint8_t* cc, const uint8_t* raw, int ta, int q, uint64_t dq, float (&sa)[32]) {
  uint32_t a[2][SB][4];
  T2 s2[2], z2[2];
#pragma unroll
  for (int g = 0; g < KS_WG / SB; ++g) {
    if (g >= 2) wgmma_wait<1>();
#pragma unroll
    for (int k = 0; k < SB; ++k) {
      const int s = S0 + g * SB + k;
      if (s < D_C / 16) scores_a_path<false>(cc, raw, s, ta, q, a[g & 1][k], s2, z2, s == S0 || (16 * s) % GS_C == 0);
      else scores_a_path<true>(cc, raw, s, ta, q, a[g & 1][k], s2, z2, s == D_C / 16 || s == S0 || (16 * (s - D_C / 16)) % GS_R == 0);
    }
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < SB; ++k) {
      const int s = S0 + g * SB + k;
      if constexpr (SKIP_QK) sink(a[g & 1][k]);
      else wgmma_m64n64_rs(sa, a[g & 1][k], dq + (((s >> 2) * CHUNK + (s & 3) * 32) >> 4));
    }
    wgmma_commit();
  }
  wgmma_wait<0>();
  fence_regs(sa);
}

// the A operands of output k-step kk (tokens 16kk + 2q, + 1, + 8, + 9) for the four M blocks of this thread's code word
// (byte offset `byte` of a token's content codes, planes P0 and P0 + 1); tokens at or past `valid` expand to zeros
__device__ __forceinline__ void output_a(const uint8_t* cc, const uint8_t* raw, int kk, int q, int byte, int p0, int valid,
                                         uint32_t (&a)[4][4]) {
  const int t0 = 16 * kk + 2 * q;
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = *cc_word(cc, t0 + (i & 1) + 8 * (i >> 1), byte);
#pragma unroll
  for (int k = 0; k < 2; ++k) {  // plane p0 + k: M blocks 2k, 2k + 1
    const int plane = p0 + k, g = (plane * NB_C + byte) / GS_C;
    uint32_t m[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = t0 + (i & 1) + 8 * (i >> 1);
      m[i] = t < valid ? meta_word<F_C>(raw + RAW_CM + t * FB_CM + g * F_C * 2) : 0u;
    }
    T2 s01, z01, s23, z23;
    two_tokens_meta<F_C>(m[0], m[1], s01, z01);
    two_tokens_meta<F_C>(m[2], m[3], s23, z23);
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // byte e of the word: M block 2k + e / 2, row + 8 where e is odd
      const uint32_t sel = e | (e << 4) | ((4 + e) << 8) | ((4 + e) << 12);
      a[2 * k + e / 2][e & 1] = expand_pair<BITS_C, KIND_C>(__byte_perm(w[0], w[1], sel), plane * BITS_C, s01, z01);
      a[2 * k + e / 2][2 + (e & 1)] = expand_pair<BITS_C, KIND_C>(__byte_perm(w[2], w[3], sel), plane * BITS_C, s23, z23);
    }
  }
}

// one bulk tensor copy of a [64 tokens x 128 bytes] box at (byte column x0 / 2 in 16-bit elements, token t0, page pg)
__device__ __forceinline__ void tma_box(void* dst, const CUtensorMap* map, int c0, int t0, int pg, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(t0), "r"(pg), "r"(smem_u32(bar))
      : "memory");
}

// the arguments: the decode ABI, then the tensor map of the pages' content codes (dims: 16-bit elements of a token's
// codes, tokens of a page, pages; boxes of 64 x 64 x 1 in the 128-byte swizzle: warpgroup.code_tensor_map)
extern "C" __global__ void __launch_bounds__(NT, 1) mla_decode(MLA_DECODE_PARAMS, const __grid_constant__ CUtensorMap map_cc) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint8_t* sQ = smem + SM_Q;
  uint8_t* sP = smem + SM_P;
  float4* sX = reinterpret_cast<float4*>(smem + SM_X);
  float* sMax = reinterpret_cast<float*>(smem + SM_MAX);
  float* sAl = reinterpret_cast<float*>(smem + SM_AL);
  float* sL = reinterpret_cast<float*>(smem + SM_L);
  float* sQf = reinterpret_cast<float*>(smem + SM_QF);
  uint64_t* sBar = reinterpret_cast<uint64_t*>(smem + SM_BAR);

  const int tid = threadIdx.x, wg = tid >> 7, lt = tid & 127, warp = (tid >> 5) & 3, lane = tid & 31, q = lane & 3;
  const int row0 = blockIdx.x * BM, u = blockIdx.y;
  const int b = units[4 * u], start = units[4 * u + 1], end = units[4 * u + 2], nsplit = units[4 * u + 3];
  const int L = seq_lens[b];
  const int* bt_row = block_table + (int64_t)b * stride_bt;
  const int ntiles = end > start ? (end - start + BN - 1) / BN : 0;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(&sBar[s], 1);
    mbar_fence_init();
  }
  __syncthreads();
  auto issue = [&](int it) {  // thread 0: tile it's page sections into stage it % STAGES
    const int n0 = start + it * BN, pgn = bt_row[n0 / PS], t0 = n0 % PS;
    uint64_t* bar = &sBar[it % STAGES];
    uint8_t* raw = smem + SM_RAW + (it % STAGES) * RAW;
    const uint8_t* pg = pages + (int64_t)pgn * PAGE_BYTES;
    mbar_expect_tx(bar, CC + RAW);
#pragma unroll
    for (int x = 0; x < CC_BOXES; ++x) tma_box(smem + SM_CC + (it % STAGES) * CC + x * BN * 128, &map_cc, 64 * x, t0, pgn, bar);
    bulk_g2s(raw + RAW_RC, pg + OFF_RC + t0 * FB_RC, BN * FB_RC, bar);
    bulk_g2s(raw + RAW_CM, pg + OFF_CM + t0 * FB_CM, BN * FB_CM, bar);
    bulk_g2s(raw + RAW_RM, pg + OFF_RM + t0 * FB_RM, BN * FB_RM, bar);
  };
  if (tid == 0)
    for (int s = 0; s < STAGES && s < ntiles; ++s) issue(s);

  // the query block in fp16, a warp a row at a time (the row times the power of two that brings its largest |q| below
  // 2^13), each 16-channel block in the order sigma: the even piece's lane stores positions 0-7, the odd one's 8-15
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
        v[k] = __ldg(reinterpret_cast<const uint4*>(c < D_C / 64 ? qc + qrow * D_C + 64 * c + 8 * j : qr + qrow * D_R + 8 * j));
      m = max(m, piece_amax_bits(v[k]));
    }
    const float scale = row_scale_below_2p13(__uint_as_float(__reduce_max_sync(0xffffffffu, m)));
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const int pc = lane + 32 * k;
      const uint4 h = piece_to_half(v[k], scale);
      uint4 o;  // the partner's piece (lanes 2i, 2i + 1 hold a 16-channel block's two pieces)
      o.x = __shfl_xor_sync(0xffffffffu, h.x, 1), o.y = __shfl_xor_sync(0xffffffffu, h.y, 1);
      o.z = __shfl_xor_sync(0xffffffffu, h.z, 1), o.w = __shfl_xor_sync(0xffffffffu, h.w, 1);
      const uint4 lo = lane & 1 ? o : h, hi = lane & 1 ? h : o;  // channels 0-7 and 8-15 of the block
      const uint4 st = lane & 1 ? make_uint4(lo.y, lo.w, hi.y, hi.w) : make_uint4(lo.x, lo.z, hi.x, hi.z);
      if (pc < NCH * 8) *reinterpret_cast<uint4*>(sQ + (pc >> 3) * CHUNK + swz(r, pc & 7)) = st;
    }
    if (lane == 0) sQf[r] = qk_scale_log2 / scale;
  }
  fence_proxy_async();  // the query block, to the warpgroup MMAs
  __syncthreads();

  // this thread's rows (heads) once the partial scores met: 32wg + 8j + 2q + e, hh = 2j + e
  float qf[8], m_run[8], l_run[8];
  int lim[8];  // tokens of the unit a row sees: min(end, its causal limit)
#pragma unroll
  for (int hh = 0; hh < 8; ++hh) {
    const int r = 32 * wg + 8 * (hh >> 1) + 2 * q + (hh & 1);
    qf[hh] = sQf[r];
    lim[hh] = min(end, L - causal * (SQ - 1 - (row0 + r) / H));
    m_run[hh] = -INFINITY, l_run[hh] = 0.0f;
  }
  float o[4][32];
#pragma unroll
  for (int mb = 0; mb < 4; ++mb)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[mb][i] = 0.0f;
  const uint64_t dq = sw128_desc(sQ, 16, 1024), dp = sw128_desc(sP, 16, 1024);
  const int ta = 16 * warp + (lane >> 2);                           // this thread's tokens ta, ta + 8 (scores)
  const int wi = 8 * warp + (lane >> 2);                            // its code word (output)
  const int obyte = (KC == 2 ? 128 * wg : 0) + 4 * wi, op0 = KC == 2 ? 0 : 2 * wg;

  for (int it = 0; it < ntiles; ++it) {
    const int n0 = start + it * BN, valid = min(BN, end - n0);
    const uint8_t* raw = smem + SM_RAW + (it % STAGES) * RAW;
    mbar_wait(&sBar[it % STAGES], (it / STAGES) & 1);

    const uint8_t* cc = smem + SM_CC + (it % STAGES) * CC;
    float sa[32];  // scores: this warpgroup's 18 k-steps
#pragma unroll
    for (int i = 0; i < 32; ++i) sa[i] = 0.0f;
    fence_regs(sa);
    if (wg == 0) scores_tile<0>(cc, raw, ta, q, dq, sa);
    else scores_tile<KS_WG>(cc, raw, ta, q, dq, sa);

    // the partial sums meet: warpgroup g hands the other the columns (rows of the block) 32(1 - g) .. of its
    // accumulators and keeps its own, whose partner values sit at the same thread index of the other warpgroup
    float s[16];
    const bool w0 = wg == 0;  // (selects between constant indices: the accumulators stay in registers)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      sX[(wg * 4 + i) * 128 + lt] = make_float4(w0 ? sa[16 + 4 * i] : sa[4 * i], w0 ? sa[17 + 4 * i] : sa[4 * i + 1],
                                               w0 ? sa[18 + 4 * i] : sa[4 * i + 2], w0 ? sa[19 + 4 * i] : sa[4 * i + 3]);
    bar_sync(1, NT);
    if (tid == 0 && it >= 1 && it - 1 + STAGES < ntiles) issue(it - 1 + STAGES);  // every thread has read that stage
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 x = sX[((wg ^ 1) * 4 + i) * 128 + lt];
      s[4 * i] = (w0 ? sa[4 * i] : sa[16 + 4 * i]) + x.x, s[4 * i + 1] = (w0 ? sa[4 * i + 1] : sa[17 + 4 * i]) + x.y;
      s[4 * i + 2] = (w0 ? sa[4 * i + 2] : sa[18 + 4 * i]) + x.z, s[4 * i + 3] = (w0 ? sa[4 * i + 3] : sa[19 + 4 * i]) + x.w;
    }

    // softmax: s[4j + 2h + e] is token ta + 8h, row 32wg + 8j + 2q + e (hh = 2j + e)
    bool exceeds = false;
    float sum[8];
    auto write_p = [&](int hh, float m_use) {
      const int r = 32 * wg + 8 * (hh >> 1) + 2 * q + (hh & 1);
      float acc = 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = ta + 8 * h;
        const float p = fast_exp2(s[4 * (hh >> 1) + 2 * h + (hh & 1)] - m_use);
        acc += p;
        *reinterpret_cast<__half*>(sP + swz(r, t >> 3) + (t & 7) * 2) = __float2half_rn(p);
      }
      return acc;
    };
#pragma unroll
    for (int hh = 0; hh < 8; ++hh) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float& v = s[4 * (hh >> 1) + 2 * h + (hh & 1)];
        v = n0 + ta + 8 * h < lim[hh] ? v * qf[hh] : -INFINITY;
        exceeds |= v > m_run[hh] + (float)MAX_SLACK;
      }
      sum[hh] = write_p(hh, m_run[hh] == -INFINITY ? 0.0f : m_run[hh]);
    }
    fence_proxy_async();
    float al[16];  // the output factors of the 16 rows of this thread's accumulator columns (8j + 2q + e, j < 8)
    bool rescale = false;
#pragma unroll
    for (int i = 0; i < 16; ++i) al[i] = 1.0f;
    if (__syncthreads_or(exceeds)) {  // rare after the first tiles: the rows' tile maxima, over the warpgroup
#pragma unroll
      for (int hh = 0; hh < 8; ++hh) {
        float mx = fmaxf(s[4 * (hh >> 1) + (hh & 1)], s[4 * (hh >> 1) + 2 + (hh & 1)]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        if (lane < 4) sMax[(wg * 4 + warp) * 32 + 8 * (hh >> 1) + 2 * q + (hh & 1)] = mx;
      }
      bar_sync(2 + wg, 128);
#pragma unroll
      for (int hh = 0; hh < 8; ++hh) {
        const int rl = 8 * (hh >> 1) + 2 * q + (hh & 1);
        float mt = sMax[(wg * 4) * 32 + rl];
#pragma unroll
        for (int w2 = 1; w2 < 4; ++w2) mt = fmaxf(mt, sMax[(wg * 4 + w2) * 32 + rl]);
        float alpha = 1.0f;
        if (mt > m_run[hh] + (float)MAX_SLACK) {
          alpha = fast_exp2(m_run[hh] - mt);
          m_run[hh] = mt;
          sum[hh] = write_p(hh, mt);
        }
        l_run[hh] *= alpha;
        if (warp == 0 && lane < 4) sAl[32 * wg + rl] = alpha;
      }
      fence_proxy_async();
      bar_sync(1, NT);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) al[2 * j + e] = sAl[8 * j + 2 * q + e];
#pragma unroll
      for (int i = 0; i < 16; ++i) rescale |= al[i] != 1.0f;
    }
#pragma unroll
    for (int hh = 0; hh < 8; ++hh) l_run[hh] += sum[hh];
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int mb = 0; mb < 4; ++mb)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          o[mb][4 * j] *= al[2 * j], o[mb][4 * j + 1] *= al[2 * j + 1];
          o[mb][4 * j + 2] *= al[2 * j], o[mb][4 * j + 3] *= al[2 * j + 1];
        }
    }

    // output: four k-steps of 16 tokens, the four M blocks' operands of the next expanded under the last
    uint32_t a[2][4][4];
#pragma unroll
    for (int mb = 0; mb < 4; ++mb) fence_regs(o[mb]);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      if (kk >= 2) wgmma_wait<1>();  // the products that read this buffer, two k-steps back
      output_a(cc, raw, kk, q, obyte, op0, valid, a[kk & 1]);
      wgmma_fence();
#pragma unroll
      for (int mb = 0; mb < 4; ++mb) {
        if constexpr (SKIP_PV) sink(a[kk & 1][mb]);
        else wgmma_m64n64_rs(o[mb], a[kk & 1][mb], dp + ((kk * 32) >> 4));
      }
      wgmma_commit();
    }
    wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < 4; ++mb) fence_regs(o[mb]);
    fence_proxy_async();  // this thread's reads of the stage, before the copy engine refills it
  }

  // the rows' sums: over the lanes that share a row, then the warpgroup's four warps
#pragma unroll
  for (int hh = 0; hh < 8; ++hh) {
    float l = l_run[hh];
    l += __shfl_xor_sync(0xffffffffu, l, 4);
    l += __shfl_xor_sync(0xffffffffu, l, 8);
    l += __shfl_xor_sync(0xffffffffu, l, 16);
    if (lane < 4) sL[(wg * 4 + warp) * 32 + 8 * (hh >> 1) + 2 * q + (hh & 1)] = l;
  }
  __syncthreads();
  float inv[16];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 8 * j + 2 * q + e, g = r >> 5;
      float l = 0.0f;
#pragma unroll
      for (int w2 = 0; w2 < 4; ++w2) l += sL[(g * 4 + w2) * 32 + (r & 31)];
      inv[2 * j + e] = l > 0.0f ? 1.0f / l : 0.0f;
      if (g == wg && warp == 0 && lane < 4 && row0 + r < R) {  // this warpgroup's rows: their log-sum-exp
        const float m = m_run[2 * (j & 3) + e];
        const float lv = l > 0.0f ? (m + log2f(l)) * 0.6931471805599453f : -INFINITY;
        if (nsplit == 1) lse[(int64_t)b * R + row0 + r] = lv;
        else part_lse[(int64_t)u * R + row0 + r] = lv;
      }
    }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = row0 + 8 * j + 2 * q + e;
      if (r >= R) continue;
      const int64_t orow = nsplit == 1 ? (int64_t)b * R + r : (int64_t)u * R + r;
#pragma unroll
      for (int mb = 0; mb < 4; ++mb)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = (op0 + (mb >> 1)) * NB_C + obyte + 2 * (mb & 1) + h;
          const float v = o[mb][4 * j + 2 * h + e] * inv[2 * j + e];
          if (nsplit != 1) part_out[orow * D_C + c] = v;
          else reinterpret_cast<OutT*>(out)[orow * D_C + c] = OutT(v);
        }
    }
}
