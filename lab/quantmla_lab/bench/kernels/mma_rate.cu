// Tensor-core issue rate at the decode kernel's occupancy: each warp runs ITERS rounds of CHAINS independent
// products (fp16 operands, fp32 accumulators) on register operands, so the time is the tensor pipe's, not memory's.
//   MODE 0: mma.sync m16n8k16 per warp;  MODE 1: wgmma m64n16k16 per warpgroup (A in registers, B in shared memory);
//   MODE 2: mma.sync m16n8k32 on e4m3 operands (fp32 accumulators);  MODE 3: mma.sync m16n8k32 on s8 operands (s32);
//   wgmma per warpgroup, A in registers, B in shared memory: MODE 4 m64n32k16 f16, MODE 5 m64n32k32 e4m3 (fp32),
//   MODE 6 m64n32k32 s8 (s32), MODE 7 m64n16k32 e4m3 (fp32), MODE 8 m64n48k32 e4m3 (fp32)
// Macros: MODE, CHAINS, ITERS. Blocks of 128 threads (one warpgroup); the sum of the accumulators goes to out[block] (so the
// products are not removed).
#include <cuda_fp16.h>
#pragma nv_diag_suppress 550  // sB is read by wgmma only (MODE 1)
#include <stdint.h>
#define MMA_TYPE "f16"
typedef __half T;
typedef __half2 T2;
#include "ptx.cuh"  // src/quantmla/kernels/cuda (on the include path): mma16816, smem_u32, fence_proxy_async
#include "mma8.cuh"  // mma16832_e4m3, mma16832_s8, WGMMA_N32

// ---------------------------------------------------------------------------------------------------
// Hopper warpgroup MMA (sm_90a): the 4 warps of a warpgroup issue one asynchronous product together; each
// warp's A operand is its 16 rows in registers (the m16n8k16 A layout), B is read from shared memory through a
// descriptor, and each warp's accumulators are its 16 rows as two m16n8 accumulators
// ---------------------------------------------------------------------------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// registers written before this are visible to the next wgmma (its A operand and accumulators)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// wait until at most N committed groups are in flight
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
#endif
// the compiler keeps reads of d after the wait before them (no code: an ordering point for each register)
__device__ __forceinline__ void fence_acc(float (&d)[2][4]) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[nb][e])::"memory");
}

// a shared-memory matrix descriptor without swizzle: 8 x 16-byte core matrices, `lbo` bytes apart along K and
// `sbo` bytes apart along M or N (both multiples of 16)
__device__ __forceinline__ uint64_t wgmma_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((smem_u32(p) & 0x3FFFFu) >> 4) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(sbo >> 4) << 32;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// d (+)= a·B, m64n16k16 over the warpgroup (fp16 operands, fp32 accumulators): this warp's 16 rows; acc = 0
// overwrites d
__device__ __forceinline__ void wgmma_m64n16k16(float (&d)[2][4], const uint32_t (&a)[4], uint64_t desc, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32." MMA_TYPE "." MMA_TYPE " "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}
WGMMA_N32(wgmma_m64n32k16_f16, "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16", "f", float, ", 1, 1, 0")
WGMMA_N32(wgmma_m64n32k32_e4m3, "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3", "f", float, ", 1, 1")
WGMMA_N32(wgmma_m64n32k32_s8, "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8", "r", int, "")
__device__ __forceinline__ void wgmma_m64n48k32_e4m3(float (&d)[24], const uint32_t (&a)[4], uint64_t desc, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n48k32.f32.e4m3.e4m3 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23}, {%24,%25,%26,%27}, %28, "
      "p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}
__device__ __forceinline__ void wgmma_m64n16k32_e4m3(float (&d)[2][4], const uint32_t (&a)[4], uint64_t desc, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}
#endif
// the compiler keeps reads of N accumulators (fp32 or s32) after the wait before them
template <int N>
__device__ __forceinline__ void fence_accn(float (&d)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) asm volatile("" : "+f"(d[e])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_accn(int (&d)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) asm volatile("" : "+r"(d[e])::"memory");
}
constexpr bool WIDE = MODE >= 4 && MODE <= 6;  // 16 accumulators a thread and chain (N = 32)


extern "C" __global__ void __launch_bounds__(128) mma_rate(float* out, uint32_t seed) {
  __shared__ __align__(128) T sB[CHAINS * 768];  // wgmma: a B block of up to 1.5 KB per chain, as core matrices
  for (int i = threadIdx.x; i < CHAINS * 768; i += blockDim.x) sB[i] = __float2half(1e-3f * (i % 7));
#if MODE == 1 || MODE >= 4
  fence_proxy_async();
#endif
  __syncthreads();
  uint32_t a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = (seed * (threadIdx.x + 1) * (i + 3)) & 0x03ff03ffu;  // small fp16 values
  float acc[CHAINS][2][4] = {};
  float accw[WIDE ? CHAINS : 1][16] = {};
  float acc48[MODE == 8 ? CHAINS : 1][24] = {};  // MODE 8: 24 accumulators a thread and chain (N = 48)
  int acci[MODE == 6 ? CHAINS : 1][16] = {};
#if MODE == 0 || MODE == 2 || MODE == 3
  const uint32_t b0 = a[0] ^ 0x1111u, b1 = a[1] ^ 0x2222u;
#else
  const uint64_t desc = wgmma_desc(sB, 128, 256);
#endif
  for (int it = 0; it < ITERS; ++it) {
#if MODE == 0
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
      mma16816(acc[c][0], a, b0, b1);
      mma16816(acc[c][1], a, b1, b0);
    }
#elif MODE == 2 || MODE == 3
    // operands that differ per chain and iteration (one XOR each): on sm_90 the e4m3 product is no tensor
    // instruction of its own but conversions and fp16 products, which the compiler would otherwise hoist out of
    // the loop and share between chains
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
      const uint32_t bc0 = b0 ^ (uint32_t)(it * CHAINS + c), bc1 = b1 ^ (uint32_t)(it + c);
      if constexpr (MODE == 2) {
        mma16832_e4m3(acc[c][0], a, bc0, bc1);
        mma16832_e4m3(acc[c][1], a, bc1, bc0);
      } else {
        mma16832_s8(acc[c][0], a, bc0, bc1);
        mma16832_s8(acc[c][1], a, bc1, bc0);
      }
    }
#else
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
      const uint64_t dc = desc + (uint64_t)(c * 96);
      if constexpr (MODE == 1) wgmma_m64n16k16(acc[c], a, dc, 1);
      else if constexpr (MODE == 4) wgmma_m64n32k16_f16(accw[c], a, dc, 1);
      else if constexpr (MODE == 5) wgmma_m64n32k32_e4m3(accw[c], a, dc, 1);
      else if constexpr (MODE == 6) wgmma_m64n32k32_s8(acci[c], a, dc, 1);
      else if constexpr (MODE == 8) wgmma_m64n48k32_e4m3(acc48[c], a, dc, 1);
      else wgmma_m64n16k32_e4m3(acc[c], a, dc, 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
      if constexpr (MODE == 6) fence_accn(acci[c]);
      else if constexpr (WIDE) fence_accn(accw[c]);
      else if constexpr (MODE == 8) fence_accn(acc48[c]);
      else fence_acc(acc[c]);
    }
#endif
  }
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) {
#pragma unroll
    for (int e = 0; e < 8; ++e) s += acc[c][e / 4][e % 4];
#pragma unroll
    for (int e = 0; e < 16; ++e) s += (MODE == 6 ? (float)acci[MODE == 6 ? c : 0][e] : accw[WIDE ? c : 0][e]);
#pragma unroll
    for (int e = 0; e < 24; ++e) s += acc48[MODE == 8 ? c : 0][e];
  }
  atomicAdd(out + blockIdx.x % 1024, s);
}
