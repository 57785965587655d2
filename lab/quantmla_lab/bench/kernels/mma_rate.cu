// Tensor-core issue rate at the decode kernel's occupancy: each warp runs ITERS rounds of CHAINS independent
// products (fp16 operands, fp32 accumulators) on register operands, so the time is the tensor pipe's, not memory's.
//   MODE 0: mma.sync m16n8k16 per warp;  MODE 1: wgmma m64n16k16 per warpgroup (A in registers, B in shared memory);
//   MODE 2: mma.sync m16n8k32 on e4m3 operands (fp32 accumulators);  MODE 3: mma.sync m16n8k32 on s8 operands (s32)
// Macros: MODE, CHAINS, ITERS. Blocks of 128 threads (one warpgroup); the sum of the accumulators goes to out[block] (so the
// products are not removed).
#include <cuda_fp16.h>
#pragma nv_diag_suppress 550  // sB is read by wgmma only (MODE 1)
#include <stdint.h>
#define MMA_TYPE "f16"
typedef __half T;
typedef __half2 T2;
#include "ptx.cuh"  // src/quantmla/kernels/cuda (on the include path): mma16816, smem_u32
#include "mma8.cuh"  // mma16832_e4m3, mma16832_s8

// ---------------------------------------------------------------------------------------------------
// Hopper warpgroup MMA (sm_90a): the 4 warps of a warpgroup issue one asynchronous product together; each
// warp's A operand is its 16 rows in registers (the m16n8k16 A layout), B is read from shared memory through a
// descriptor, and each warp's accumulators are its 16 rows as two m16n8 accumulators
// ---------------------------------------------------------------------------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// registers written before this are visible to the next wgmma (its A operand and accumulators)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// this thread's shared-memory writes, visible to the async proxy (wgmma's shared-memory operands) after a barrier
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
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
#endif


extern "C" __global__ void __launch_bounds__(128) mma_rate(float* out, uint32_t seed) {
  __shared__ __align__(128) T sB[CHAINS * 256];  // MODE 1: a 16 x 16 B block per chain, as core matrices
  for (int i = threadIdx.x; i < CHAINS * 256; i += blockDim.x) sB[i] = __float2half(1e-3f * (i % 7));
#if MODE == 1
  fence_proxy_async();
#endif
  __syncthreads();
  uint32_t a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = (seed * (threadIdx.x + 1) * (i + 3)) & 0x03ff03ffu;  // small fp16 values
  float acc[CHAINS][2][4] = {};
#if MODE != 1
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
    for (int c = 0; c < CHAINS; ++c) wgmma_m64n16k16(acc[c], a, desc + (uint64_t)(c * 32), 1);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) fence_acc(acc[c]);
#endif
  }
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c)
#pragma unroll
    for (int e = 0; e < 8; ++e) s += acc[c][e / 4][e % 4];
  atomicAdd(out + blockIdx.x % 1024, s);
}
