// The split-KV merge inside a decode kernel: where every split sequence has at most MERGE_MAX units
// (kernels.cuda.MERGE_MAX_SPLITS), the CTA that stores a sequence's last partial merges the sequence's partial
// outputs and log-sum-exps for its BM rows, and no combine kernel runs. Each CTA of a split sequence counts its
// arrival on arrivals[b, row block] (int32, zero before the launch) once its partial is stored; the last resets the
// count for the next launch. The arithmetic is the combine kernel's (kernels/decode.py, _mla_combine_kernel), fp32.
// Needs BM, NT, D_C and OutT.
#pragma once

#ifndef MERGE_MAX
#define MERGE_MAX 8
#endif
constexpr int MERGE_SCRATCH = BM * (MERGE_MAX + 1);  // floats of shared memory: each row's split weights and 1 / Σ

// whether this CTA stored the last of its sequence's nsplit partials (for its row block); every thread calls it
// after its own stores. flag: one int of shared memory
__device__ __forceinline__ bool last_to_arrive(int* arrivals, int b, int nsplit, int* flag) {
  __threadfence();  // this thread's partial is visible to the whole device before the CTA's arrival counts
  __syncthreads();
  if (threadIdx.x == 0) *flag = atomicAdd(arrivals + b * gridDim.y + blockIdx.y, 1) == nsplit - 1;
  __syncthreads();
  if (!*flag) return false;
  __threadfence();  // the other CTAs' partials are read after their arrivals
  return true;
}

// O[b, row] = Σ_i w_i·O_i / Σ_i w_i with w_i = e^(lse_i - max lse) over the sequence's units u0 .. u0 + nsplit - 1
// (u is one of them; units are in sequence order), rows row0 .. row0 + BM - 1 below R; lse[b, row] = max + ln Σ w.
// scratch: MERGE_SCRATCH floats of shared memory
__device__ __forceinline__ void merge_splits(const float* part_out, const float* part_lse, const int* __restrict__ units,
                                             int u, int b, int nsplit, int R, int row0, OutT* out, float* lse,
                                             int* arrivals, float* scratch) {
  const int tid = threadIdx.x;
  const int earlier = __syncthreads_count(tid < nsplit - 1 && u - 1 - tid >= 0 && units[4 * (u - 1 - tid)] == b);
  const int u0 = u - earlier;
  if (tid < BM && row0 + tid < R) {
    const int r = row0 + tid;
    float v[MERGE_MAX], m = -INFINITY;
#pragma unroll
    for (int i = 0; i < MERGE_MAX; ++i) {
      v[i] = i < nsplit ? __ldcg(part_lse + (int64_t)(u0 + i) * R + r) : -INFINITY;
      m = fmaxf(m, v[i]);
    }
    const float m_safe = m == -INFINITY ? 0.0f : m;
    float den = 0.0f;
#pragma unroll
    for (int i = 0; i < MERGE_MAX; ++i) {
      const float w = __expf(v[i] - m_safe);
      scratch[tid * (MERGE_MAX + 1) + i] = w;
      den += w;
    }
    scratch[tid * (MERGE_MAX + 1) + MERGE_MAX] = den > 0.0f ? 1.0f / den : 0.0f;
    lse[(int64_t)b * R + r] = den > 0.0f ? m_safe + __logf(den) : -INFINITY;
  }
  __syncthreads();
  constexpr int C4 = D_C / 4;  // float4 pieces of a row
  static_assert((BM * C4) % (2 * NT) == 0, "two pieces a thread a pass");
#pragma unroll 1
  for (int k = tid; k < BM * C4; k += 2 * NT) {
    float4 acc[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
    int rr[2], c[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) rr[j] = (k + j * NT) / C4, c[j] = 4 * ((k + j * NT) % C4);
    float4 o[MERGE_MAX][2];  // every split's pieces loaded before the sums: 2·MERGE_MAX loads in flight a thread
#pragma unroll
    for (int i = 0; i < MERGE_MAX; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        o[i][j] = i < nsplit && row0 + rr[j] < R
                      ? __ldcg(reinterpret_cast<const float4*>(part_out + ((int64_t)(u0 + i) * R + row0 + rr[j]) * D_C + c[j]))
                      : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < MERGE_MAX; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float w = scratch[rr[j] * (MERGE_MAX + 1) + i];  // 0 past nsplit
        acc[j].x = fmaf(w, o[i][j].x, acc[j].x), acc[j].y = fmaf(w, o[i][j].y, acc[j].y);
        acc[j].z = fmaf(w, o[i][j].z, acc[j].z), acc[j].w = fmaf(w, o[i][j].w, acc[j].w);
      }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (row0 + rr[j] >= R) continue;
      const float inv = scratch[rr[j] * (MERGE_MAX + 1) + MERGE_MAX];
      OutT* p = out + ((int64_t)b * R + row0 + rr[j]) * D_C + c[j];
      store_pair<1>(p, acc[j].x * inv, acc[j].y * inv);
      store_pair<1>(p + 2, acc[j].z * inv, acc[j].w * inv);
    }
  }
  if (tid == 0) arrivals[b * gridDim.y + blockIdx.y] = 0;  // for the next launch
}
