// PTX and warp helpers of the CUDA decode kernel (included by mla_decode.cu after it defines T, T2 and
// MMA_TYPE, the tile's 16-bit type).
#pragma once

// SKIP_QK, SKIP_PV (timing experiments only: the result is wrong): a kernel leaves its score or its output
// products out, so that a phase's share of the time is a difference
#ifndef SKIP_QK
#define SKIP_QK 0
#endif
#ifndef SKIP_PV
#define SKIP_PV 0
#endif
// ---------------------------------------------------------------------------------------------------
// PTX helpers
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src));
}
// cp.async of 16 bytes, zero-filled where `valid` is false (nothing read from src)
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0));
}
// generic-proxy writes to shared memory (stores, cp.async) made visible to reads through the async proxy (warpgroup
// MMAs, bulk copies)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

// d += a·b, m16n8k16, a: 4 regs (16x16 row-major), b: 2 regs (16x8 col-major), d: 4 fp32; operands of the
// kernel's 16-bit type T (MMA_TYPE), or bf16 with BF16 = true
#define MMA16816(TY)                                                                                 \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 "                             \
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                              \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                      \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <bool BF16 = false>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16) MMA16816("bf16");
  else MMA16816(MMA_TYPE);
}
#undef MMA16816

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// (x & mask) | magic in one LOP3 (written as C, ptxas spends two: both constants cannot be immediates)
__device__ __forceinline__ uint32_t and_or(uint32_t x, uint32_t mask, uint32_t magic) {
  uint32_t y;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(y) : "r"(x), "r"(mask), "r"(magic));
  return y;
}

__device__ __forceinline__ T2 as_t2(uint32_t u) { return *reinterpret_cast<T2*>(&u); }
__device__ __forceinline__ uint32_t as_u32(T2 v) { return *reinterpret_cast<uint32_t*>(&v); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// one metadata value (fp16, bf16 or fp32 by MB) as fp32
template <int MB>
__device__ __forceinline__ float meta_f32(const uint8_t* p) {
  if constexpr (MB == 4) return *reinterpret_cast<const float*>(p);
  else if constexpr (MB == 3) return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
  else return __half2float(*reinterpret_cast<const __half*>(p));
}
template <int MB>
__host__ __device__ constexpr int meta_size() { return MB == 4 ? 4 : 2; }

// named barriers: bar_sync waits until n threads arrived at barrier id; bar_arrive arrives without waiting
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
// bar_sync that also returns whether pred held in any of the n threads (__syncthreads_or on a named barrier)
__device__ __forceinline__ bool bar_or(int id, int n, bool pred) {
  uint32_t r;
  asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, %3, p;\nselp.u32 %0, 1, 0, q;\n}\n"
               : "=r"(r) : "r"((uint32_t)pred), "r"(id), "r"(n) : "memory");
  return r != 0;
}

// ---------------------------------------------------------------------------------------------------
// Hopper bulk copies (sm_90): one thread copies a contiguous section into shared memory; an mbarrier
// counts its bytes, and the tile's readers wait on the barrier's phase
// ---------------------------------------------------------------------------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define BULK 1
#else
#define BULK 0
#endif

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// the barriers' initialisation, visible to the copy engine (the async proxy)
__device__ __forceinline__ void mbar_fence_init() {
#if BULK
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// arrive once on `bar` and expect `bytes` more to land in this phase
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
#if BULK
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
#endif
}
// wait until the phase of parity `parity` of `bar` has completed
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if BULK
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
#endif
}
// copy `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if BULK
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
#endif
}

// the page numbers of the first S - 1 tiles read at once (page_of(it)), then their copies started
// (issue(s, page) for s < ntiles); returns the page of tile S - 1, which the next issue needs
template <int S, class PageOf, class Issue>
__device__ __forceinline__ int start_tiles(int ntiles, PageOf page_of, Issue issue) {
  int pg[S - 1];
#pragma unroll
  for (int s = 0; s < S - 1; ++s) pg[s] = page_of(s);
  const int next = page_of(S - 1);
#pragma unroll
  for (int s = 0; s < S - 1; ++s)
    if (s < ntiles) issue(s, pg[s]);
  return next;
}
