// A tokens-as-M tile's codes as the mma.sync products' 16-bit operands, shared by the scores (scores_tm.cuh) and the
// output products (output_tm.cuh): an integer code plane masked in place (exact fp16 subnormals), or two e4m3 values
// widened to fp16.
#pragma once
#include <stdint.h>

// two e4m3 values (the low 16 bits of x) as an fp16 pair (exact: every e4m3 value is an fp16 value)
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t x) {
  uint32_t r;
  asm("{\n.reg .b16 lo;\ncvt.u16.u32 lo, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(r) : "r"(x));
  return r;
}

// plane p's codes of the byte pairs (0, 2) of x, as exact fp16 subnormals in each half
template <int BITS>
__device__ __forceinline__ uint32_t plane(uint32_t x, int p) {
  return x & ((((1u << BITS) - 1u) << (p * BITS)) * 0x10001u);
}
