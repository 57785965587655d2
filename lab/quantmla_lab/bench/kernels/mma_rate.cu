// Tensor-core issue rate at the decode kernel's occupancy: each warp runs ITERS rounds of CHAINS independent
// products (fp16 operands, fp32 accumulators) on register operands, so the time is the tensor pipe's, not memory's.
//   MODE 0: mma.sync m16n8k16 per warp;  MODE 1: wgmma m64n16k16 per warpgroup (A in registers, B in shared memory)
// Macros: MODE, CHAINS, ITERS. One block of NT threads; the sum of the accumulators goes to out[block] (so the
// products are not removed).
#include <cuda_fp16.h>
#include <stdint.h>
#define MMA_TYPE "f16"
typedef __half T;
typedef __half2 T2;
#include "ptx.cuh"  // src/quantmla/kernels/cuda (on the include path)

extern "C" __global__ void __launch_bounds__(128) mma_rate(float* out, uint32_t seed) {
  __shared__ __align__(128) T sB[CHAINS * 256];  // MODE 1: a 16 x 16 B block per chain, as core matrices
  (void)sB;
  for (int i = threadIdx.x; i < CHAINS * 256; i += blockDim.x) sB[i] = __float2half(1e-3f * (i % 7));
#if MODE == 1
  fence_proxy_async();
#endif
  __syncthreads();
  uint32_t a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = (seed * (threadIdx.x + 1) * (i + 3)) & 0x03ff03ffu;  // small fp16 values
  float acc[CHAINS][2][4] = {};
#if MODE == 0
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
