// The heads-as-M kernels' copies into shared memory (mla_decode_wg.cu, mla_decode_seesaw.cu): a [64 tokens x 64
// channels] box of the pages through a tensor map, and the BF16 query block, both as 64-channel chunks of 64 rows x
// 128 bytes in the 128-byte swizzle (wgmma.cuh's swz). Needs ptx.cuh and wgmma.cuh, and the kernel's D_C and D_R.
#pragma once

// one bulk tensor copy of a [64 tokens x 64 channels] box at (channel c0, token t0, page pg) of the tensor map `map`
// (a CUtensorMap passed by value as a kernel argument) into dst, completing on bar
__device__ __forceinline__ void tma_box(void* dst, const void* map, int c0, int t0, int pg, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(t0), "r"(pg), "r"(smem_u32(bar))
      : "memory");
}

// query rows row0 .. row0 + 63 of sequence b (R rows a sequence; rows past R read as zero) into sQ, nine chunks of
// 8192 bytes (eight of the latent, one of the RoPE part), with every thread's cp.async (one commit group: the caller's)
__device__ __forceinline__ void load_query_block_bf16(uint8_t* sQ, const __nv_bfloat16* __restrict__ qc,
                                                      const __nv_bfloat16* __restrict__ qr, int b, int R, int row0,
                                                      int tid, int nthreads) {
  constexpr int NCH = (D_C + D_R) / 64, CCH = D_C / 64;
  for (int i = tid; i < 64 * NCH * 8; i += nthreads) {
    const int r = i / (NCH * 8), c = (i >> 3) % NCH, j = i & 7, gr = row0 + r;
    const int64_t qrow = (int64_t)b * R + (gr < R ? gr : 0);
    const __nv_bfloat16* src = c < CCH ? qc + qrow * D_C + 64 * c + 8 * j : qr + qrow * D_R + 8 * j;
    cp_async16_zfill(sQ + c * 8192 + swz(r, j), src, gr < R);
  }
}
