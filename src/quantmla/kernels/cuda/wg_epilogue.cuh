// The epilogue of the heads-as-M kernels (mla_decode_wg.cu, mla_decode_seesaw.cu): 64 query rows of two warpgroups,
// warpgroup g holding output channels 256g .. 256g + 255 in the warpgroup MMA's accumulator layout (thread t: rows
// r0 = 16·warp + lane / 4 and r0 + 8, channels 8j + cq (+ 1), cq = 2·(lane % 4), at o[4j + 2h ..]). Needs out_io.cuh
// (OutT, PartT, PART_SCALE) and the kernel's D_C.
#pragma once

// the rows' sums l_run (this thread's share) summed over both warpgroups through sL [2 warpgroups][64] fp32, then
// the unit's output rows divided by them and its log-sum-exps (m_of(h): row r0 + 8h's maximum, base 2, read after the
// CTA barrier): the sequence's own rows where it has one split (out, lse), else the unit's partials (part_out,
// part_lse)
template <class MaxOf>
__device__ __forceinline__ void wg_epilogue(const float (&o)[128], float (&l_run)[2], MaxOf m_of, float* sL, int wg,
                                            int lane, int r0, int cq, int row0, int R, int b, int u, int nsplit,
                                            void* out, float* lse, PartT* part_out, float* part_lse) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
    if ((lane & 3) == 0) sL[wg * 64 + r0 + 8 * h] = l_run[h];
  }
  __syncthreads();
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
