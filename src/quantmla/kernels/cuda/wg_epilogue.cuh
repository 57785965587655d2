// The epilogue of the heads-as-M kernels (mla_decode_wg.cu, mla_decode_seesaw.cu): 64 query rows of two warpgroups,
// warpgroup g holding output channels 256g .. 256g + 255 in the warpgroup MMA's accumulator layout (thread t: rows
// r0 = 16·warp + lane / 4 and r0 + 8, channels 8j + cq (+ 1), cq = 2·(lane % 4), at o[4j + 2h ..]). Needs out_io.cuh
// (OutT, PartT, PART_SCALE) and the kernel's D_C.
#pragma once

// EPI_SMEM 1 (the default): the rows staged in shared memory and stored as whole 16-byte pieces; 0: each thread's
// pairs straight from its registers. At 128 heads the staged rows' decode kernels take 0.3 % longer to 3.2 % less
// with fp32 partials and 2.8 to 13 % less with 16-bit ones (docs/decode_heads_m.md, "The staged epilogue").
#ifndef EPI_SMEM
#define EPI_SMEM 1
#endif

// EPI_SMEM: this thread's values of rows r0 and r0 + 8 (times inv[h]·scale, as O) into `stage` [64 rows][512] of O
// (rows PITCH bytes apart: 8·sizeof(O) of padding puts a warp's 8 rows in distinct banks), then, behind a CTA barrier,
// the first `nrows` rows copied to dst (nrows x 512 contiguous O) in 16-byte pieces by all 256 threads
template <typename O>
__device__ __forceinline__ void wg_store_staged(const float (&o)[128], const float (&inv)[2], float scale,
                                                uint8_t* stage, int wg, int r0, int cq, int nrows, O* dst) {
  constexpr int PITCH = 512 * (int)sizeof(O) + 8 * (int)sizeof(O), PIECES = 512 * (int)sizeof(O) / 16;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 32; ++j)
      store_pair<1>(reinterpret_cast<O*>(stage + (r0 + 8 * h) * PITCH) + wg * 256 + 8 * j + cq,
                    o[4 * j + 2 * h] * inv[h] * scale, o[4 * j + 2 * h + 1] * inv[h] * scale);
  __syncthreads();
  uint8_t* d = reinterpret_cast<uint8_t*>(dst);
  for (int i = threadIdx.x; i < nrows * PIECES; i += 256) {
    const int r = i / PIECES, c = i % PIECES;
    *reinterpret_cast<uint4*>(d + (int64_t)r * (PIECES * 16) + 16 * c) =
        *reinterpret_cast<const uint4*>(stage + r * PITCH + 16 * c);
  }
}

// the rows' sums l_run (this thread's share) summed over both warpgroups through sL [2 warpgroups][64] fp32, then
// the unit's output rows divided by them and its log-sum-exps (m_of(h): row r0 + 8h's maximum, base 2, read after the
// CTA barrier): the sequence's own rows where it has one split (out, lse), else the unit's partials (part_out,
// part_lse). EPI_SMEM: the rows go through `stage` (at least 64 x 520 x 4 bytes of shared memory no one reads any
// more), else straight from the registers
template <class MaxOf>
__device__ __forceinline__ void wg_epilogue(const float (&o)[128], float (&l_run)[2], MaxOf m_of, float* sL, int wg,
                                            int lane, int r0, int cq, int row0, int R, int b, int u, int nsplit,
                                            void* out, float* lse, PartT* part_out, float* part_lse,
                                            uint8_t* stage = nullptr) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
    if ((lane & 3) == 0) sL[wg * 64 + r0 + 8 * h] = l_run[h];
  }
  __syncthreads();
  if constexpr (EPI_SMEM) {
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + r0 + 8 * h;
      const float l = sL[r0 + 8 * h] + sL[64 + r0 + 8 * h];
      inv[h] = l > 0.0f ? 1.0f / l : 0.0f;
      if (r < R && wg == 0 && (lane & 3) == 0) {
        const float lv = l > 0.0f ? (m_of(h) + log2f(l)) * 0.6931471805599453f : -INFINITY;
        if (nsplit == 1) lse[(int64_t)b * R + r] = lv;
        else part_lse[(int64_t)u * R + r] = lv;
      }
    }
    const int nrows = min(64, R - row0);
    if (nsplit != 1)
      wg_store_staged<PartT>(o, inv, PART_SCALE, stage, wg, r0, cq, nrows, part_out + ((int64_t)u * R + row0) * D_C);
    else
      wg_store_staged<OutT>(o, inv, 1.0f, stage, wg, r0, cq, nrows,
                            reinterpret_cast<OutT*>(out) + ((int64_t)b * R + row0) * D_C);
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + r0 + 8 * h;
      if (r >= R) continue;
      const float l = sL[r0 + 8 * h] + sL[64 + r0 + 8 * h];
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      if (wg == 0 && (lane & 3) == 0) {
        const float lv = l > 0.0f ? (m_of(h) + log2f(l)) * 0.6931471805599453f : -INFINITY;
        if (nsplit == 1) lse[(int64_t)b * R + r] = lv;
        else part_lse[(int64_t)u * R + r] = lv;
      }
      const int64_t orow = nsplit == 1 ? (int64_t)b * R + r : (int64_t)u * R + r;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int c = wg * 256 + 8 * j + cq;
        const float o0 = o[4 * j + 2 * h] * inv, o1 = o[4 * j + 2 * h + 1] * inv;
        if (nsplit != 1) store_pair<1>(part_out + orow * D_C + c, o0 * PART_SCALE, o1 * PART_SCALE);
        else store_pair<1>(reinterpret_cast<OutT*>(out) + orow * D_C + c, o0, o1);
      }
    }
  }
}
