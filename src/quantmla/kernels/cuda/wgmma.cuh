// Hopper warpgroup MMAs (wgmma) on bf16 operands in shared memory, for the heads-as-M decode kernel
// (mla_decode_wg.cu). Operands are 64-channel chunks of [rows x 128 bytes] in the 128-byte swizzle: 16-byte unit j
// of row r sits at r·128 + ((j ^ (r % 8)) << 4), chunks 1024-byte aligned.
#pragma once

#ifndef WG_AB
#define WG_AB "bf16"  // the operands' type: "bf16", or "f16" (the kernel defines it before including this file)
#endif

// byte offset of 16-byte unit j of row r in a 128-byte-swizzled chunk
__host__ __device__ constexpr int swz(int r, int j) { return r * 128 + ((j ^ (r & 7)) << 4); }

// a shared-memory matrix descriptor in the 128-byte swizzle: start address, leading and stride byte offsets
// (K-major operands: the stride is the 1024 bytes between 8-row groups, the leading offset unused; N-major B: the
// leading offset steps 64-element chunks along N, the stride 8-row groups along K)
__device__ __forceinline__ uint64_t sw128_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint64_t a = (smem_u32(p) & 0x3FFFF) >> 4;
  return a | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) | ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// a shared-memory matrix descriptor without swizzle: 8 x 16-byte core matrices (128 contiguous bytes each), `lbo`
// bytes apart along K and `sbo` bytes apart along M or N (both multiples of 16)
__device__ __forceinline__ uint64_t plain_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((smem_u32(p) & 0x3FFFFu) >> 4) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(sbo >> 4) << 32;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// keeps the compiler from moving accumulator reads or writes across an asynchronous product
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(int32_t (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// d[16] (+)= A·B over k16: m64n32k16, bf16 A and B from shared memory (descriptors), fp32 accumulators
// (thread t of the warpgroup: rows 16·(t / 32) + (t % 32) / 4 (+ 8), columns 8j + 2·(t % 4) (+ 1) at d[4j ..]);
// B K-major; scale_d = 0 overwrites d
__device__ __forceinline__ void wgmma_m64n32_k(float (&d)[16], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." WG_AB "." WG_AB " {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
      "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db), "r"(scale_d));
}

// the operand lists of 32 and 128 fp32 accumulators, d[0] .. d[N - 1] as %0 .. %N-1
#define WG_D10(i) "%" #i "0, %" #i "1, %" #i "2, %" #i "3, %" #i "4, %" #i "5, %" #i "6, %" #i "7, %" #i "8, %" #i "9, "
#define WG_REGS32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, " WG_D10(1) WG_D10(2) "%30, %31"
#define WG_REGS128                                                                                                  \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, " WG_D10(1) WG_D10(2) WG_D10(3) WG_D10(4) WG_D10(5) WG_D10(6)   \
  WG_D10(7) WG_D10(8) WG_D10(9) "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, "    \
  "%115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WG_OUT8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                      "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_OUT32(d) WG_OUT8(d, 0), WG_OUT8(d, 8), WG_OUT8(d, 16), WG_OUT8(d, 24)
#define WG_OUT128(d) WG_OUT32(d), WG_OUT8(d, 32), WG_OUT8(d, 40), WG_OUT8(d, 48), WG_OUT8(d, 56), WG_OUT8(d, 64), \
                     WG_OUT8(d, 72), WG_OUT8(d, 80), WG_OUT8(d, 88), WG_OUT8(d, 96), WG_OUT8(d, 104),             \
                     WG_OUT8(d, 112), WG_OUT8(d, 120)

// d[128] (+)= A·B over k16: m64n256k16, bf16 A and B from shared memory (descriptors), fp32 accumulators
// (thread t of the warpgroup: rows 16·(t / 32) + (t % 32) / 4 (+ 8), columns 8j + 2·(t % 4) (+ 1) at d[4j ..]);
// B N-major (imm-trans-b 1); scale_d = 0 overwrites d
__device__ __forceinline__ void wgmma_m64n256_n(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." WG_AB "." WG_AB " {" WG_REGS128 "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
      : WG_OUT128(d)
      : "l"(da), "l"(db), "r"(scale_d));
}

// d[128] += A·B over k16: m64n256k16 with A in registers (a: the 16 x 16 A fragment of this thread's warp, rows
// 16·warp .. + 15, as mma.sync's m16n8k16 holds it) and B from shared memory N-major
__device__ __forceinline__ void wgmma_m64n256_rn(float (&d)[128], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." WG_AB "." WG_AB " {" WG_REGS128 "}, {%128, %129, %130, %131}, "
      "%132, p, 1, 1, 1;\n}\n"
      : WG_OUT128(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// d[32] (+)= A·B over k16: m64n64k16, A and B (K-major) from shared memory; scale_d = 0 overwrites d
__device__ __forceinline__ void wgmma_m64n64_k(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_AB "." WG_AB " {" WG_REGS32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : WG_OUT32(d)
      : "l"(da), "l"(db), "r"(scale_d));
}
