// The query rows' 16-byte pieces, shared by the CUDA decode kernels. Included after the kernel defines
// D, D_C, D_R, BM and NT.
#pragma once

// the pieces of rows [row0, row0 + BM) of sequence b (piece i: row i / (D / 8), channels 8·(i % (D / 8)) ..,
// thread tid's pieces tid, tid + NT, ...), all loaded at once; rows past R read as zero
template <int QPT>
__device__ __forceinline__ void load_query_pieces(const __nv_bfloat16* __restrict__ qc, const __nv_bfloat16* __restrict__ qr,
                                                  uint4 (&qv)[QPT], int b, int R, int row0, int tid) {
  constexpr int QCH = D / 8, QN = BM * QCH;
#pragma unroll
  for (int n = 0; n < QPT; ++n) {
    const int i = tid + n * NT, rr = i / QCH, c = 8 * (i % QCH), r = row0 + rr;
    qv[n] = make_uint4(0, 0, 0, 0);
    if ((QN % NT == 0 || i < QN) && r < R) {
      const int64_t qrow = (int64_t)b * R + r;
      qv[n] = __ldg(reinterpret_cast<const uint4*>(c < D_C ? qc + qrow * D_C + c : qr + qrow * D_R + c - D_C));
    }
  }
}

// the largest |q| of a piece of 8 bf16 values, as fp32 bits (positive floats order as their bits)
__device__ __forceinline__ uint32_t piece_amax_bits(const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t m = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) m = max(m, max((w[e] << 16) & 0x7fffffffu, w[e] & 0x7fff0000u));
  return m;
}

// the power of two that brings a query row whose largest |q| is amax below 2^13 (1 where it is already), for its
// fp16 copy: exact, and undone in the scores
__device__ __forceinline__ float row_scale_below_2p13(float amax) {
  float scale = 1.0f;
  if (amax > 8192.0f) {
    int e;
    frexpf(amax / 8192.0f, &e);
    scale = ldexpf(1.0f, -e);
  }
  return scale;
}

// a piece as 8 fp16 values (BF16: bf16 values), each times `scale` (a power of two: exact)
template <bool BF16 = false>
__device__ __forceinline__ uint4 piece_to_half(const uint4& v, float scale) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t h[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
    if constexpr (BF16) {
      const __nv_bfloat162 x = __floats2bfloat162_rn(f.x * scale, f.y * scale);
      h[e] = *reinterpret_cast<const uint32_t*>(&x);
    } else {
      const __half2 x = __floats2half2_rn(f.x * scale, f.y * scale);
      h[e] = *reinterpret_cast<const uint32_t*>(&x);
    }
  }
  return make_uint4(h[0], h[1], h[2], h[3]);
}

// the decode kernels' arguments: one launch ABI (kernels.cuda.launch_decode)
#define MLA_DECODE_PARAMS                                                                                         \
  const __nv_bfloat16* __restrict__ qc, const __nv_bfloat16* __restrict__ qr, const uint8_t* __restrict__ pages,  \
      const int* __restrict__ block_table, const int* __restrict__ seq_lens, const int* __restrict__ units,       \
      void* __restrict__ out, float* __restrict__ lse, PartT* __restrict__ part_out, float* __restrict__ part_lse, \
      int stride_bt, int H, int SQ, int R, int causal, float qk_scale_log2
