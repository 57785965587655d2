// The pieces of the tokens-as-M kernel at 64 query rows (mla_decode_tm64.cu; the lab's timing model tokens_m_64.cu
// includes them too): the warpgroup MMA with its A operand in registers, codes dequantized into that operand, and a
// row's maximum or sum over a tile's 64 tokens. Included after ptx.cuh and wgmma.cuh, with fp16 operands.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

// d[32] (+)= A·B over k16: m64n64k16, A (fp16) in registers (the m16n8k16 A layout, a warp's 16 rows), B (fp16)
// through a descriptor, K-major (TB 0) or N-major (TB 1); fp32 accumulators: thread t of the warpgroup holds rows
// 16·(t / 32) + (t % 32) / 4 (+ 8), columns 8j + 2·(t % 4) (+ 1) at d[4j ..]; scale_d = 0 overwrites d
template <int TB>
__device__ __forceinline__ void wgmma_m64n64_ra(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}

// two 4-bit codes (nibble pl of bytes 0 and 2 of x) dequantized: (1024 + code) exact in fp16, less 1024, times the
// pair's scales plus their zeros (half2 each) in one fused multiply-add, rounded once
__device__ __forceinline__ uint32_t deq_pair(uint32_t x, int pl, uint32_t s2, uint32_t z2) {
  const uint32_t m = ((x >> (4 * pl)) & 0x000F000Fu) | 0x64006400u;
  const __half2 c = __hsub2(*reinterpret_cast<const __half2*>(&m), __half2(__half(1024.0f), __half(1024.0f)));
  const __half2 v = __hfma2(c, *reinterpret_cast<const __half2*>(&s2), *reinterpret_cast<const __half2*>(&z2));
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float2 h2f(uint32_t u) { return __half22float2(*reinterpret_cast<const __half2*>(&u)); }
__device__ __forceinline__ uint32_t f2h(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// v[i] (the thread's row 8(i / 2) + 2t + i % 2 of the 64, i < 16) combined over a tile's 64 tokens: over the 8 lanes
// g of its warp, then over the warpgroup's 4 warps w through red[4 warps][64 rows] (named barrier BAR of its 128
// threads, twice: red is free after)
template <bool MAX, int BAR>
__device__ __forceinline__ void over_tokens(float (&v)[16], float* red, int w, int g, int t) {
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      const float x = __shfl_xor_sync(0xffffffffu, v[i], o);
      v[i] = MAX ? fmaxf(v[i], x) : v[i] + x;
    }
  if (g == 0) {
#pragma unroll
    for (int i = 0; i < 16; ++i) red[w * 64 + 8 * (i >> 1) + 2 * t + (i & 1)] = v[i];
  }
  bar_sync(BAR, 128);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float* r = red + 8 * (i >> 1) + 2 * t + (i & 1);
    v[i] = MAX ? fmaxf(fmaxf(r[0], r[64]), fmaxf(r[128], r[192])) : (r[0] + r[64]) + (r[128] + r[192]);
  }
  bar_sync(BAR, 128);
}

// the latent (0-511) or RoPE (512-575) channel of column k (0-15) of the scores' k-step K (0-35), as the A operands
// take a token's codes (deq_pair): content k-step K is plane K % 2 of word (K / 2) % 4 of 16-byte load K / 8 (of the
// thread's t), k 2t, 2t + 1 its bytes 0 and 2, k 2t + 8, 2t + 9 its bytes 1 and 3; byte c's plane p is channel
// c + 256p (RoPE: 8 bytes a thread, channel 512 + c + 32p)
__host__ __device__ constexpr int query_channel(int K, int k) {
  const int t = (k & 7) >> 1, e = k & 1, odd = k >> 3;
  return K < 32 ? 16 * (4 * (K >> 3) + t) + 4 * ((K >> 1) & 3) + odd + 2 * e + 256 * (K & 1)
                : 512 + 8 * t + 4 * ((K - 32) >> 1) + odd + 2 * e + 32 * (K & 1);
}
