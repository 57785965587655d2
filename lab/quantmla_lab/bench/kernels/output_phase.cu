// The tokens-as-M decode kernel's output phase alone, Oᵀ[channel, row] = Cᵀ·(P·scale)ᵀ over one 64-token tile of
// INT4 content codes (512 channels in two 4-bit planes of 256 bytes, groups of 128 channels, 16 query rows), repeated
// ITERS times on the same shared-memory tile by every CTA of 4 warps (one warpgroup, the output warps of the kernel
// with its warps apart). The question: do the output products on 8-bit warpgroup MMAs take a tile in less time than
// on mma.sync, once the codes' transposes and the per-tile fold are paid?
//
//   MODE 0  today's loop (output_tm.cuh's tile_output at 4 bits, the kernel's own code): per 16 tokens a byte permute pairs two tokens' codes of one
//           channel, a mask gives the fp16 A operand, P·scale (fp16, ldmatrix) the B operand; mma.sync m16n8k16 into
//           64 fp32 accumulators a thread that last the whole run.
//   MODE 1  wgmma m64n32k32 e4m3: M 64 channels of one plane, K 32 tokens, N the 16 rows' two terms of P·scale
//           (hi, lo as e4m3). A is 4 tokens of one channel a register: each thread loads one 32-bit word (4 channel
//           bytes) of 4 tokens and transposes them with 8 byte permutes; plane 0 is the low nibble (the e4m3 pattern
//           of c·2^-9), plane 1 the high nibble shifted down. An M block's two k-steps go to fresh accumulators
//           (INFLIGHT of them at once), folded into the fp32 output: hi + lo.
//   MODE 2  the same on u8·u8 -> s32: plane 1 is the high nibble in place (16c), the terms are 256·hi + lo,
//           converted to fp32 once per tile.
//   PRET=1  (MODES 1, 2) the tile stored as a token-interleaved layout would store it, already transposed: 16 bytes
//           a (word, token quad), [64 words][16 quads][4 byte columns 4·word + b][4 tokens 4·quad + i], the quad at
//           slot quad ^ 4·(word & 1) (a quarter warp's 16-byte loads then hit 8 distinct bank groups). A thread's
//           transposed words are one 16-byte load: no byte permutes. This bounds what a cache layout that interleaves
//           tokens would give the output products; the scores would then need the transposes instead.
//
// An M block (p, h, e) of MODES 1, 2: plane p, byte half h, byte pair e; its row 16w + g (+ 8) is byte
// 4·(8w + g + 32h) + 2e (+ 1) of the plane; its group 2p + h. Thread (w, g, q) reads the 4-byte word 8w + g + 32h of
// tokens 32s + 16u + 4q + i (k-step s, K half u, i < 4): register u of k-step s, byte pair e, row g (+ 8).
//
// Macros: MODE, ITERS, MINB (CTAs an SM the registers are capped for: 4 gives 128 a thread), INFLIGHT, PRET. Output: each
// CTA writes O [512 channels][16 rows] fp32 to out + 8192·block, channels in their natural order (MODE 0: times
// 2^(24 - 4p) as the kernel's epilogue would apply; MODE 1: times 2^9; MODE 2: times 1/(16^p · 256)), summed over the
// ITERS tiles, so every mode gives ITERS·Σ_token code·(P·scale).
#include <cuda_fp16.h>
#include <stdint.h>
#include <type_traits>
typedef __half T;
typedef __half2 T2;
#define MMA_TYPE "f16"
#include "ptx.cuh"   // src/quantmla/kernels/cuda: smem_u32, ldsm_x4, mma16816
#include "mma8.cuh"  // WGMMA_N32

#ifndef MODE
#define MODE 0
#endif
#ifndef ITERS
#define ITERS 1
#endif
#ifndef MINB
#define MINB 4
#endif
#ifndef PRET
#define PRET 0
#endif
#if PRET && MODE == 0
#error "PRET is for the 8-bit modes (1, 2)"
#endif
#ifndef INFLIGHT
#define INFLIGHT 1  // MODES 1, 2: M blocks whose products are in flight at once (1, 2 or 4; 0: 1, and the next A
                    // operand built only after they finish)
#endif

constexpr int BN = 64, BM = 16, FB_CC = 256, CG = 4, LDP = BN + 8;
// MODE 0 runs the kernel's own output products (output_tm.cuh) at INT4/INT4's constants, the warps apart: 4 output warps
#pragma nv_diag_suppress 177  // MODE 0's constants, unused by MODES 1, 2
constexpr int C_BITS = 4, C_GS = 128, C_FP8 = 0, NPC = 8 / C_BITS;
constexpr int NW = 4, BW = FB_CC / NW, BT = BW / 8, OMB = NPC * BT / 2;  // 64 bytes a warp, 8 a thread, 8 m16 blocks
__device__ __forceinline__ const uint8_t* cc_at(const uint8_t* st, int row, int col) { return st + row * FB_CC + col; }
#include "code_planes.cuh"  // plane, e4m3x2_f16x2
#include "output_tm.cuh"    // tile_output

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// K-major B without swizzle: 8 x 16-byte core matrices, 512 bytes apart along K, 128 along N (query_s8.cuh's q8_at)
__device__ __forceinline__ uint64_t b_desc(const void* p) {
  return (uint64_t)((smem_u32(p) & 0x3FFFFu) >> 4) | (uint64_t)(512 >> 4) << 16 | (uint64_t)(128 >> 4) << 32;
}
WGMMA_N32(wg_e4m3, "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3", "f", float, ", 1, 1")
WGMMA_N32(wg_u8, "wgmma.mma_async.sync.aligned.m64n32k32.s32.u8.u8", "r", int32_t, "")
#endif
template <int N, typename TY>
__device__ __forceinline__ void fence_regs(TY (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if constexpr (std::is_integral<TY>::value) asm volatile("" : "+r"(d[i])::"memory");
    else asm volatile("" : "+f"(d[i])::"memory");
  }
}

// 4 tokens' words (4 channel bytes each) -> 4 words of one channel byte each (tokens in order)
__device__ __forceinline__ void transpose4(const uint32_t (&w)[4], uint32_t (&r)[4]) {
  const uint32_t t0 = __byte_perm(w[0], w[1], 0x5140u), t1 = __byte_perm(w[2], w[3], 0x5140u);
  const uint32_t t2 = __byte_perm(w[0], w[1], 0x7362u), t3 = __byte_perm(w[2], w[3], 0x7362u);
  r[0] = __byte_perm(t0, t1, 0x5410u), r[1] = __byte_perm(t0, t1, 0x7632u);
  r[2] = __byte_perm(t2, t3, 0x5410u), r[3] = __byte_perm(t2, t3, 0x7632u);
}

template <int P>
__device__ __forceinline__ uint32_t plane8(uint32_t x) {
  if constexpr (MODE == 1) return P == 0 ? x & 0x0F0F0F0Fu : (x >> 4) & 0x0F0F0F0Fu;  // e4m3 c·2^-9
  else return x & ((0xFu << (4 * P)) * 0x01010101u);                                  // u8 c·16^P
}

#if MODE != 0
using Acc = typename std::conditional<MODE == 1, float, int32_t>::type;
// the A operands of M block (p, e) for both k-steps from the transposed words r[k-step][K half][byte]
__device__ __forceinline__ void build_a(const uint32_t (&r)[2][2][4], int p, int e, uint32_t (&a)[2][4]) {
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const uint32_t x[4] = {r[s][0][2 * e], r[s][0][2 * e + 1], r[s][1][2 * e], r[s][1][2 * e + 1]};
#pragma unroll
    for (int i = 0; i < 4; ++i) a[s][i] = p ? plane8<1>(x[i]) : plane8<0>(x[i]);
  }
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// an M block's two k-steps into fresh accumulators: B of its group at b (two 1 KB k-steps)
__device__ __forceinline__ void issue(Acc (&acc)[16], const uint32_t (&a)[2][4], const uint8_t* b) {
#pragma unroll
  for (int s = 0; s < 2; ++s) {
#if MODE == 1
    wg_e4m3(acc, a[s], b_desc(b + s * 1024), s);
#else
    wg_u8(acc, a[s], b_desc(b + s * 1024), s);
#endif
  }
}
#endif
// o[x] += the block's hi + lo terms of query row 8j + 2q (+ 1), channel row g (+ 8): x = 4j + e, hi at acc[4j + e],
// lo at acc[4(j + 2) + e]; u8: 256·hi + lo over 256·16^p
__device__ __forceinline__ void fold(float (&o)[8], const Acc (&acc)[16], int p) {
#pragma unroll
  for (int x = 0; x < 8; ++x) {
    const int j = x >> 2, ee = x & 3;
    if constexpr (MODE == 1) o[x] += acc[4 * j + ee] + acc[4 * (j + 2) + ee];
    else o[x] += (float)(acc[4 * j + ee] * 256 + acc[4 * (j + 2) + ee]) * (p ? 1.0f / 4096.0f : 1.0f / 256.0f);
  }
}
#endif

// codes [64 tokens][256 bytes]; p16 [4 groups][16 rows][64 tokens] fp16 (MODE 0); b8 [4 groups][2 k-steps][1024] in
// q8_at order, rows n < 16 the hi term of query row n, 16 + n the lo term (MODES 1, 2)
extern "C" __global__ void __launch_bounds__(128, MINB)
output_phase(const uint8_t* __restrict__ codes, const __half* __restrict__ p16, const uint8_t* __restrict__ b8,
             float* __restrict__ out) {
  __shared__ __align__(1024) uint8_t sC[BN * FB_CC];
  __shared__ __align__(1024) uint8_t sB[MODE == 0 ? CG * BM * LDP * 2 : CG * 2 * 1024];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  for (int i = tid; i < BN * FB_CC / 16; i += 128) reinterpret_cast<uint4*>(sC)[i] = reinterpret_cast<const uint4*>(codes)[i];
  if constexpr (MODE == 0) {
    __half* sP = reinterpret_cast<__half*>(sB);
    for (int i = tid; i < CG * BM * BN; i += 128) sP[(i / BN) * LDP + i % BN] = p16[i];
  } else {
    for (int i = tid; i < CG * 2 * 1024 / 16; i += 128) reinterpret_cast<uint4*>(sB)[i] = reinterpret_cast<const uint4*>(b8)[i];
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();
  float* o = out + (size_t)blockIdx.x * 512 * BM;

#if MODE == 0
  float oacc[8][2][4] = {};
  const T* sP = reinterpret_cast<const T*>(sB);
  for (int it = 0; it < ITERS; ++it) {
    tile_output(sC, sP, oacc, warp, g, q, lane, BN);
  }
  // block mb = (p, z): row g (+ 8) is byte BW·warp + BT·g + 2z (+ 1) of plane p; column 8nb + 2q (+ 1)
#pragma unroll
  for (int mb = 0; mb < 8; ++mb) {
    const int p = mb / (BT / 2), z = mb % (BT / 2);
    const float f = (float)(1 << (24 - 4 * p));
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ch = 256 * p + BW * warp + BT * g + 2 * z + (e >> 1), n = 8 * nb + 2 * q + (e & 1);
        o[ch * BM + n] = oacc[mb][nb][e] * f;
      }
  }
#else
  float oacc[8][8] = {};  // [M block (p, h, e)][row g / g + 8 x query rows 2q, 2q + 1, 8 + 2q, 9 + 2q]
  for (int it = 0; it < ITERS; ++it) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int word = 8 * warp + g + 32 * h;
      uint32_t r[2][2][4];  // [k-step][K half][byte of the word]
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
#if PRET
          const uint4 v = reinterpret_cast<const uint4*>(sC)[16 * word + ((8 * s + 4 * u + q) ^ (4 * (word & 1)))];
          r[s][u][0] = v.x, r[s][u][1] = v.y, r[s][u][2] = v.z, r[s][u][3] = v.w;
#else
          uint32_t w[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) w[i] = reinterpret_cast<const uint32_t*>(sC + (32 * s + 16 * u + 4 * q + i) * FB_CC)[word];
          transpose4(w, r[s][u]);
#endif
        }
#if INFLIGHT == 4
      Acc acc[4][16] = {};  // every (p, e) of this half on accumulators of its own, one wait
      uint32_t a[4][2][4];
#pragma unroll
      for (int pe = 0; pe < 4; ++pe) {
        build_a(r, pe >> 1, pe & 1, a[pe]);
        fence_regs(acc[pe]);
        wg_fence();
        issue(acc[pe], a[pe], sB + (2 * (pe >> 1) + h) * 2 * 1024);
        wg_commit();
      }
      wg_wait<0>();
#pragma unroll
      for (int pe = 0; pe < 4; ++pe) {
        fence_regs(acc[pe]);
        fold(oacc[(2 * (pe >> 1) + h) * 2 + (pe & 1)], acc[pe], pe >> 1);
      }
#elif INFLIGHT == 2
      Acc acc[2][16] = {};
      uint32_t a[2][2][4];
#pragma unroll
      for (int pe = 0; pe < 4; ++pe) {  // (p, e); the products of (p, e) run while those before are folded
        const int p = pe >> 1, e = pe & 1, grp = 2 * p + h, par = pe & 1;
        build_a(r, p, e, a[par]);
        fence_regs(acc[par]);
        wg_fence();
        issue(acc[par], a[par], sB + grp * 2 * 1024);
        wg_commit();
        if (pe > 0) {
          wg_wait<1>();
          fence_regs(acc[par ^ 1]);
          fold(oacc[(2 * ((pe - 1) >> 1) + h) * 2 + ((pe - 1) & 1)], acc[par ^ 1], (pe - 1) >> 1);
        }
      }
      wg_wait<0>();
      fence_regs(acc[1]);
      fold(oacc[(2 + h) * 2 + 1], acc[1], 1);
#else
      Acc acc[16] = {};
      uint32_t a[2][2][4];
#pragma unroll
      for (int pe = 0; pe < 4; ++pe) {  // (p, e); the A operand of (p, e) is built while the products before run
        const int p = pe >> 1, e = pe & 1, grp = 2 * p + h, par = pe & 1;
        if constexpr (INFLIGHT == 0) wg_wait<0>();  // no A operand built while a product is in flight
        build_a(r, p, e, a[par]);
        if (pe > 0) {
          wg_wait<0>();
          fence_regs(acc);
          fold(oacc[(2 * ((pe - 1) >> 1) + h) * 2 + ((pe - 1) & 1)], acc, (pe - 1) >> 1);
        }
        fence_regs(acc);
        wg_fence();
        issue(acc, a[par], sB + grp * 2 * 1024);
        wg_commit();
      }
      wg_wait<0>();
      fence_regs(acc);
      fold(oacc[(2 + h) * 2 + 1], acc, 1);
#endif
    }
  }
#pragma unroll
  for (int mb = 0; mb < 8; ++mb) {
    const int p = mb >> 2, h = (mb >> 1) & 1, e = mb & 1;
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      const int j = x >> 2, ee = x & 3;
      const int ch = 256 * p + 4 * (8 * warp + g + 32 * h) + 2 * e + (ee >> 1), n = 8 * j + 2 * q + (ee & 1);
      o[ch * BM + n] = oacc[mb][x] * (MODE == 1 ? 512.0f : 1.0f);  // e4m3 codes are c·2^-9
    }
  }
#endif
}
