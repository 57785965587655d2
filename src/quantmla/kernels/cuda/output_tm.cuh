// The tokens-as-M decode kernel's output products (mla_decode_tm.cu): Oᵀ[channel, row] = Cᵀ·(P·scale)ᵀ of one tile
// for a warp's 128 channels on mma.sync products, two tokens' codes of one channel paired by one byte permute into
// the A operand, the group's P·scale the B operand. Included by mla_decode_tm.cu after its constants, its
// shared-memory map and code_planes.cuh (plane, e4m3x2_f16x2; scores_tm.cuh includes it).
#pragma once

// the output products of one tile (stage st): warp w's 128 channels; per 16 tokens, thread t pairs the codes of
// tokens (2t, 2t + 8) and (2t + 1, 2t + 9), channel rows g and g + 8 of each m16 block
__device__ __forceinline__ void tile_output(const uint8_t* st, const T* sP, float (&oacc)[OMB][2][4], int warp, int g,
                                            int t, int lane, int valid) {
#pragma unroll
  for (int j = 0; j < BN / 16; ++j) {
    const int r0 = 16 * j + 2 * t, col = BW * warp + BT * g;
    const uint8_t *pa = cc_at(st, r0, col), *pb8 = cc_at(st, r0 + 8, col), *pc = cc_at(st, r0 + 1, col),
                  *pd = cc_at(st, r0 + 9, col);
    uint32_t wa[BT / 4], wb[BT / 4], wc[BT / 4], wd[BT / 4];  // tokens 2t, 2t + 8, 2t + 1, 2t + 9
    if constexpr (BT == 16) {
      const uint4 va = *reinterpret_cast<const uint4*>(pa), vb = *reinterpret_cast<const uint4*>(pb8);
      const uint4 vc = *reinterpret_cast<const uint4*>(pc), vd = *reinterpret_cast<const uint4*>(pd);
      wa[0] = va.x, wa[1] = va.y, wa[2] = va.z, wa[3] = va.w, wb[0] = vb.x, wb[1] = vb.y, wb[2] = vb.z, wb[3] = vb.w;
      wc[0] = vc.x, wc[1] = vc.y, wc[2] = vc.z, wc[3] = vc.w, wd[0] = vd.x, wd[1] = vd.y, wd[2] = vd.z, wd[3] = vd.w;
    } else if constexpr (BT == 8) {
      const uint2 va = *reinterpret_cast<const uint2*>(pa), vb = *reinterpret_cast<const uint2*>(pb8);
      const uint2 vc = *reinterpret_cast<const uint2*>(pc), vd = *reinterpret_cast<const uint2*>(pd);
      wa[0] = va.x, wa[1] = va.y, wb[0] = vb.x, wb[1] = vb.y;
      wc[0] = vc.x, wc[1] = vc.y, wd[0] = vd.x, wd[1] = vd.y;
    } else {
      wa[0] = *reinterpret_cast<const uint32_t*>(pa), wb[0] = *reinterpret_cast<const uint32_t*>(pb8);
      wc[0] = *reinterpret_cast<const uint32_t*>(pc), wd[0] = *reinterpret_cast<const uint32_t*>(pd);
    }
    if constexpr (C_FP8) {  // a token past the sequence may hold any byte, e4m3 NaN too, and its P·scale of 0 times
      if (valid < BN) {     // NaN is NaN: its bytes are zeroed (integer codes are finite: their P·scale of 0 is enough)
#pragma unroll
        for (int w = 0; w < BT / 4; ++w) {
          wa[w] = r0 < valid ? wa[w] : 0u, wb[w] = r0 + 8 < valid ? wb[w] : 0u;
          wc[w] = r0 + 1 < valid ? wc[w] : 0u, wd[w] = r0 + 9 < valid ? wd[w] : 0u;
        }
      }
    }
    uint32_t pb[NPC][4];
#pragma unroll
    for (int p = 0; p < NPC; ++p) {
      const int grp = (p * FB_CC + BW * warp) / C_GS;
      ldsm_x4(pb[p], sP + (grp * BM + 8 * ((lane >> 3) >> 1) + (lane & 7)) * LDP + 16 * j + 8 * ((lane >> 3) & 1));
    }
#pragma unroll
    for (int z = 0; z < BT / 2; ++z) {  // byte pair (2z, 2z + 1) of the thread's bytes: channel rows g, g + 8
      if constexpr (C_FP8) {  // e4m3 pairs of two tokens' bytes of one channel, widened to fp16 pairs
        const uint32_t sel = (z & 1) ? 0x7362u : 0x5140u;
        const uint32_t xab = __byte_perm(wa[z >> 1], wb[z >> 1], sel), xcd = __byte_perm(wc[z >> 1], wd[z >> 1], sel);
        const uint32_t a[4] = {e4m3x2_f16x2(xab), e4m3x2_f16x2(xab >> 16), e4m3x2_f16x2(xcd), e4m3x2_f16x2(xcd >> 16)};
        mma16816(oacc[z][0], a, pb[0][0], pb[0][1]);
        mma16816(oacc[z][1], a, pb[0][2], pb[0][3]);
        continue;
      }
      const uint32_t sel = (z & 1) ? 0x7632u : 0x5410u;
      const uint32_t zab = __byte_perm(wa[z >> 1], wb[z >> 1], sel), zcd = __byte_perm(wc[z >> 1], wd[z >> 1], sel);
      const uint32_t zab8 = zab >> 8, zcd8 = zcd >> 8;
#pragma unroll
      for (int p = 0; p < NPC; ++p) {
        const uint32_t a[4] = {plane<C_BITS>(zab, p), plane<C_BITS>(zab8, p), plane<C_BITS>(zcd, p), plane<C_BITS>(zcd8, p)};
        const int mb = p * (BT / 2) + z;
        mma16816(oacc[mb][0], a, pb[p][0], pb[p][1]);
        mma16816(oacc[mb][1], a, pb[p][2], pb[p][3]);
      }
    }
  }
}
