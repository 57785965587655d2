// The m16n8k32 products on 8-bit operands (the lab's kernels: mma_rate.cu, e4m3_scores.cu), and the macro that defines a
// warpgroup product of N = 32 (mma_rate.cu, output_phase.cu). The registers are those of
// m16n8k16 on 16-bit operands: four A words (16 x 32, each word four consecutive k of one row: rows g, g + 8, then
// k + 16), two B words (32 x 8, each word four consecutive k of one column), four fp32 (s32) accumulators.
#pragma once
#include <stdint.h>

// d += a·b, m16n8k32 on 8-bit operands: e4m3 with fp32 accumulators, or s8 with s32 accumulators (the same
// registers: four A words, two B words, four accumulators)
__device__ __forceinline__ void mma16832_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16832_s8(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  int* di = reinterpret_cast<int*>(d);
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+r"(di[0]), "+r"(di[1]), "+r"(di[2]), "+r"(di[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d (+)= a·B over the warpgroup with 16 accumulators a thread (N = 32): the product named by OP (its
// shape and types), A in registers (4 words a thread), B through `desc`; acc = 0 overwrites d. Float accumulators
// ("f") or s32 ("r")
#define WGMMA_N32(NAME, OP, C, T, SCALES)                                                                           \
  __device__ __forceinline__ void NAME(T (&d)[16], const uint32_t (&a)[4], uint64_t desc, int acc) {                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" OP " "                                              \
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p" SCALES ";\n}\n" \
                 : "+" C(d[0]), "+" C(d[1]), "+" C(d[2]), "+" C(d[3]), "+" C(d[4]), "+" C(d[5]), "+" C(d[6]),          \
                   "+" C(d[7]), "+" C(d[8]), "+" C(d[9]), "+" C(d[10]), "+" C(d[11]), "+" C(d[12]), "+" C(d[13]),      \
                   "+" C(d[14]), "+" C(d[15])                                                                          \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));                                \
  }
