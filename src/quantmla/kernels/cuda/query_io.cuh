// The query block in and the output out, for the CUDA decode kernel. Included by mla_decode.cu after its
// tile constants and ptx.cuh.
#pragma once

#include "query_pieces.cuh"

// the query block of rows [row0, row0 + BM) of sequence b into sQ [BM, LDK] as T, rows past R zero: every
// thread loads its 16-byte pieces at once. In fp16 each row is scaled by the power of two that brings its
// largest |q| below 2^13 (exact); sQs[row] gets the factor that undoes it. sAlpha [BM] must be zero (it
// holds each row's largest |q| meanwhile)
__device__ __forceinline__ void load_query_block(const __nv_bfloat16* __restrict__ qc, const __nv_bfloat16* __restrict__ qr,
                                                 T* sQ, float* sAlpha, float* sQs, int b, int R, int row0, int tid) {
  constexpr int QCH = D / 8, QN = BM * QCH, QPT = (QN + NT - 1) / NT;  // pieces: a row, in all, a thread
  uint4 qv[QPT];
  load_query_pieces(qc, qr, qv, b, R, row0, tid);
#if HALF
  unsigned* sAmax = reinterpret_cast<unsigned*>(sAlpha);  // per row, as fp32 bits (sAlpha is free until D)
  __syncthreads();  // sAmax is zeroed
#pragma unroll
  for (int n = 0; n < QPT; ++n) {
    const int i = tid + n * NT;
    if (QN % NT != 0 && i >= QN) break;
    atomicMax(sAmax + i / QCH, piece_amax_bits(qv[n]));
  }
  __syncthreads();  // every row's largest |q| is known
#endif
#pragma unroll
  for (int n = 0; n < QPT; ++n) {
    const int i = tid + n * NT, rr = i / QCH, c = 8 * (i % QCH);
    if (QN % NT != 0 && i >= QN) break;
#if HALF
    const float amax = __uint_as_float(sAmax[rr]);
    const float scale = row_scale_below_2p13(amax);
    const uint4 v = piece_to_half(qv[n], scale);
#else
    const float scale = 1.0f;
    const uint4 v = qv[n];
#endif
    *reinterpret_cast<uint4*>(sQ + rr * LDK + c) = v;
    if (c == 0) sQs[rr] = 1.0f / scale;
  }
}

#include "out_io.cuh"
