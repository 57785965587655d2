// The output's 16-bit or fp32 stores of the CUDA decode kernels (OUT_KIND: 0 bf16, 1 fp16, 2 fp32), and the type of
// their split partials (PART_KIND: 0 fp32; 1 fp16 holding o·2^-PART_SHIFT; 2 bf16; kernels.partials.partial_dtype).
#pragma once

#ifndef PART_KIND
#define PART_KIND 0
#endif
#if PART_KIND == 1
typedef __half PartT;
constexpr float PART_SCALE = 1.0f / float(1 << PART_SHIFT);  // exact: a power of two, undone by the combine
#elif PART_KIND == 2
typedef __nv_bfloat16 PartT;
constexpr float PART_SCALE = 1.0f;
#else
typedef float PartT;
constexpr float PART_SCALE = 1.0f;
#endif

#if OUT_KIND == 0
typedef __nv_bfloat16 OutT;
#elif OUT_KIND == 1
typedef __half OutT;
#else
typedef float OutT;
#endif
__device__ __forceinline__ void put2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void put2(__half* p, float a, float b) { *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b); }
__device__ __forceinline__ void put2(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
// two output values, of channels c and c + CS where p points at c (one 4- or 8-byte store where CS = 1)
template <int CS, typename O>
__device__ __forceinline__ void store_pair(O* p, float a, float b) {
  if constexpr (CS == 1) put2(p, a, b);
  else p[0] = O(a), p[CS] = O(b);
}
