// A: the tile copy of the CUDA decode kernel: a tile's page sections into a shared-memory stage, as
// 16-byte cp.async copies by every thread, or (sm_90) as bulk copies by one warp. Included by mla_decode.cu
// after its tile constants (BN, NTB, LDK, RAW_*, RM_BYTES, rm_offset, DIRECT) and ptx.cuh.
#pragma once

// A: copy BYTES contiguous bytes (a multiple of 16) into shared memory, 16 per cp.async, unrolled
template <int BYTES>
__device__ __forceinline__ void copy_section(uint8_t* dst, const uint8_t* src, int tid) {
  constexpr int C = BYTES / 16;
#pragma unroll
  for (int n = 0; n < (C + NTB - 1) / NTB; ++n) {
    const int i = tid + n * NTB;
    if (C % NTB == 0 || i < C) cp_async16(dst + 16 * i, src + 16 * i);
  }
}

// A: copy BN rows of WIDTH bytes (a multiple of 16) into rows PITCH bytes apart in shared memory
template <int WIDTH, int PITCH>
__device__ __forceinline__ void copy_rows(uint8_t* dst, const uint8_t* src, int tid) {
  constexpr int C = WIDTH / 16, N = BN * C;
#pragma unroll
  for (int n = 0; n < (N + NTB - 1) / NTB; ++n) {
    const int i = tid + n * NTB;
    if (N % NTB == 0 || i < N) cp_async16(dst + (i / C) * PITCH + 16 * (i % C), src + 16 * i);
  }
}

// A: start copying tile `n0` (first token; a multiple of BN), which lies in page `page`, into `stage`
__device__ __forceinline__ void issue_tile(uint8_t* stage, const uint8_t* __restrict__ pages, int page, int n0,
                                           int tid) {
  const int tok0 = n0 % PS;
  const uint8_t* pg = pages + (int64_t)page * PAGE_BYTES;
  if constexpr (DIRECT) {  // raw bf16 rows straight into the padded tile layout
    copy_rows<D_C * 2, LDK * 2>(stage, pg + OFF_CC + tok0 * FB_CC, tid);
    copy_rows<D_R * 2, LDK * 2>(stage + D_C * 2, pg + OFF_RC + tok0 * FB_RC, tid);
  } else {  // the four sections, each contiguous for the tile's tokens
    copy_section<BN * FB_CC>(stage + RAW_CC, pg + OFF_CC + tok0 * FB_CC, tid);
    copy_section<BN * FB_RC>(stage + RAW_RC, pg + OFF_RC + tok0 * FB_RC, tid);
    copy_section<BN * FB_CM>(stage + RAW_CM, pg + OFF_CM + tok0 * FB_CM, tid);
    copy_section<RM_BYTES>(stage + RAW_RM, pg + OFF_RM + rm_offset(tok0), tid);
  }
}

// A (sm_90): the same tile as four bulk copies (one a section) by lane 0 of the issuing warp, completing on
// `bar` (a built tile's stage: not for a BF16 tile, whose rows land in the padded tile)
__device__ __forceinline__ void issue_tile_bulk(uint8_t* stage, uint64_t* bar, const uint8_t* __restrict__ pages,
                                                int page, int n0, int lane) {
  const int tok0 = n0 % PS;
  const uint8_t* pg = pages + (int64_t)page * PAGE_BYTES;
  if (!DIRECT && lane == 0) {
    mbar_expect_tx(bar, BN * FB_CC + BN * FB_RC + BN * FB_CM + RM_BYTES);
    bulk_g2s(stage + RAW_CC, pg + OFF_CC + tok0 * FB_CC, BN * FB_CC, bar);
    bulk_g2s(stage + RAW_RC, pg + OFF_RC + tok0 * FB_RC, BN * FB_RC, bar);
    bulk_g2s(stage + RAW_CM, pg + OFF_CM + tok0 * FB_CM, BN * FB_CM, bar);
    bulk_g2s(stage + RAW_RM, pg + OFF_RM + rm_offset(tok0), RM_BYTES, bar);
  }
}
