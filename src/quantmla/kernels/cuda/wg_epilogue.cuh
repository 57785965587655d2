// The epilogue of the heads-as-M kernels (mla_decode_wg.cu, mla_decode_seesaw.cu): 64 query rows of two warpgroups,
// warpgroup g holding output channels 256g .. 256g + 255 in the warpgroup MMA's accumulator layout (thread t: rows
// r0 = 16·warp + lane / 4 and r0 + 8, channels 8j + cq (+ 1), cq = 2·(lane % 4), at o[4j + 2h ..]). Needs out_io.cuh
// (OutT, PartT, PART_SCALE) and the kernel's D_C.
#pragma once

#ifndef EPI_SMEM
#define EPI_SMEM 0  // 1: the rows staged in shared memory and stored as whole 16-byte pieces (not yet measured)
#endif
#ifndef CLUSTER_MERGE
#define CLUSTER_MERGE 0  // 1: the units of a thread-block cluster merged through distributed shared memory (below)
#endif
#if CLUSTER_MERGE
#include <cooperative_groups.h>
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

#if CLUSTER_MERGE
// The C CTAs of a thread-block cluster (launched with cluster dims (1, C): consecutive work units of one sequence and
// the same 64 rows; C = 1, 2, 4 or 8, read at run time) merge their outputs through distributed shared memory before
// anything leaves the SMs. Each CTA has its rows' log-sum-exps lse2[h] (base 2, -inf where the unit saw no token) and
// its outputs times inv[h] = 1 / Σ P. Every CTA scales its rows by w = 2^(lse2 - M) / W, M the row's largest
// log-sum-exp in the cluster and W = Σ 2^(lse_k - M), into its `stage` [64 rows][512] fp32 (rows 2080 bytes apart);
// then CTA k sums channels [512k/C, 512(k+1)/C) of the first `nrows` rows over the C stages and stores them, in
// 16-byte loads: the sequence's own rows (out, lse) where the cluster holds all `nsplit` units of the sequence, else
// one partial of the cluster in slot (u - k) / C, the cluster's index in the grid (every sequence's units start at a
// multiple of C and number a multiple of C, so its clusters' slots are contiguous: schedule.cluster_units). `sLse` [64]
// fp32 lies past the stage's rows. Three cluster barriers: the log-sum-exps are out (and every CTA's loop is done, so
// every stage is free), the scaled rows are out, and no CTA leaves while another reads its shared memory.
__device__ __forceinline__ void wg_merge_cluster(const float (&o)[128], const float (&lse2)[2], const float (&inv)[2],
                                                 uint8_t* stage, int wg, int lane, int r0, int cq, int row0, int R,
                                                 int b, int u, int nsplit, void* out, float* lse, PartT* part_out,
                                                 float* part_lse) {
  namespace cg = cooperative_groups;
  constexpr int PITCH = 520 * 4;
  cg::cluster_group cl = cg::this_cluster();
  const int C = (int)cl.num_blocks(), k = (int)cl.block_rank(), tid = threadIdx.x;
  float* sLse = reinterpret_cast<float*>(stage + 64 * PITCH);
  if (wg == 0 && (lane & 3) == 0) {
    sLse[r0] = lse2[0];
    sLse[r0 + 8] = lse2[1];
  }
  cl.sync();
  // a row's cluster maximum M (0 where every unit is empty) and 1 / W (0 likewise), from the C CTAs' sLse
  auto row_weights = [&](int r, float& m, float& inv_w) {
    m = -INFINITY;
    for (int j = 0; j < C; ++j) m = fmaxf(m, cl.map_shared_rank(sLse, j)[r]);
    float w = 0.0f;
    if (m != -INFINITY)
      for (int j = 0; j < C; ++j) w += exp2f(cl.map_shared_rank(sLse, j)[r] - m);
    if (m == -INFINITY) m = 0.0f;
    inv_w = w > 0.0f ? 1.0f / w : 0.0f;
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float m, inv_w;
    row_weights(r0 + 8 * h, m, inv_w);
    const float f = lse2[h] == -INFINITY ? 0.0f : inv[h] * exp2f(lse2[h] - m) * inv_w;
    float* row = reinterpret_cast<float*>(stage + (r0 + 8 * h) * PITCH) + wg * 256 + cq;
#pragma unroll
    for (int j = 0; j < 32; ++j) put2(row + 8 * j, o[4 * j + 2 * h] * f, o[4 * j + 2 * h + 1] * f);
  }
  cl.sync();
  const int nrows = min(64, R - row0), cw = D_C / C, pieces = cw / 4;
  const bool whole = nsplit == C;  // the cluster holds every unit of the sequence: its own rows, no combine
  const int64_t slot = whole ? b : (u - k) / C;  // (the sequences' first units are multiples of C)
  for (int i = tid; i < nrows * pieces; i += 256) {
    const int r = i / pieces, c = k * cw + 4 * (i % pieces);
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int j = 0; j < C; ++j) {
      const float4 v = *reinterpret_cast<const float4*>(
          cl.map_shared_rank(reinterpret_cast<float*>(stage + r * PITCH) + c, j));
      a.x += v.x, a.y += v.y, a.z += v.z, a.w += v.w;
    }
    const int64_t orow = slot * R + row0 + r;
    if (whole) {
      OutT* d = reinterpret_cast<OutT*>(out) + orow * D_C + c;
      store_pair<1>(d, a.x, a.y);
      store_pair<1>(d + 2, a.z, a.w);
    } else {
      PartT* d = part_out + orow * D_C + c;
      store_pair<1>(d, a.x * PART_SCALE, a.y * PART_SCALE);
      store_pair<1>(d + 2, a.z * PART_SCALE, a.w * PART_SCALE);
    }
  }
  if (k == 0 && tid < nrows) {  // the rows' log-sum-exps of the cluster, natural log
    float m, inv_w;
    row_weights(tid, m, inv_w);
    const float lv = inv_w > 0.0f ? (m - log2f(inv_w)) * 0.6931471805599453f : -INFINITY;
    if (whole) lse[slot * R + row0 + tid] = lv;
    else part_lse[slot * R + row0 + tid] = lv;
  }
  cl.sync();
}
#endif

// the rows' sums l_run (this thread's share) summed over both warpgroups through sL [2 warpgroups][64] fp32, then
// the unit's output rows divided by them and its log-sum-exps (m_of(h): row r0 + 8h's maximum, base 2, read after the
// CTA barrier): the sequence's own rows where it has one split (out, lse), else the unit's partials (part_out,
// part_lse). EPI_SMEM: the rows go through `stage` (at least 64 x 520 x 4 bytes of shared memory no one reads any
// more), else straight from the registers; CLUSTER_MERGE: the cluster's units merged first (wg_merge_cluster; `stage`
// of 64 x 520 x 4 + 256 bytes)
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
#if CLUSTER_MERGE
  {
    float lse2[2], inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = sL[r0 + 8 * h] + sL[64 + r0 + 8 * h];
      inv[h] = l > 0.0f ? 1.0f / l : 0.0f;
      lse2[h] = l > 0.0f ? m_of(h) + log2f(l) : -INFINITY;
    }
    wg_merge_cluster(o, lse2, inv, stage, wg, lane, r0, cq, row0, R, b, u, nsplit, out, lse, part_out, part_lse);
    return;
  }
#endif
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
