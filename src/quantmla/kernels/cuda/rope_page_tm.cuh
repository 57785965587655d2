// The tokens-as-M decode kernel's RoPE scores where the RoPE path's metadata is the page's (R_PAGE: KIVI's per-channel
// keys, a scale and zero point per group of R_GS channels over R_BLK tokens; mla_decode_tm.cu). A warp's block of 16
// tokens lies in one metadata set, so the channels' scales fold into the query instead of the scores:
//
//   S_rope[token, row] = Σ_c code·2^(o-24) · (q_c·s_c·2^-e) · 2^(e+24-o)  +  Σ_c z_c·q_c
//
// B' = q·s·2^-e is the query fragment times the set's scales in fp16, 2^e the power of two at the set's largest scale
// (so |B'| < 2^15 for any fp16 scale); each code plane's products sum on their own accumulators and fold in 2^(e+24-o)
// once a tile. The zero points' term is the same for the block's 16 tokens: products of the zeros (every A row alike)
// with the query itself. Symmetric codes (R_FLD 1) have z = -2^(bits-1)·s: the constant's products with B', times 2^e.
// Included by scores_tm.cuh after plane(), code_weight() and fold_scale().
#pragma once

static_assert(!R_PAGE || ((R_GS == 1 || R_GS == 2) && (R_FLD == 1 || R_FLD == 2)),
              "a page's RoPE metadata: an fp16 scale, or (scale, zero), per channel or channel pair");

// the fp16x2 scale and zero pairs of channels (base, base + 2) and (base + 1, base + 3) of a metadata set, base a
// multiple of 4: the query fragment's k positions (2t, 2t + 1) and (2t + 8, 2t + 9). Symmetric codes: zeros 0
__device__ __forceinline__ void rope_set_pairs(const uint8_t* set, int base, uint32_t& s02, uint32_t& s13,
                                               uint32_t& z02, uint32_t& z13) {
  const uint8_t* m = set + (base / R_GS) * R_FLD * 2;
  if constexpr (R_GS == 1 && R_FLD == 2) {  // (scale, zero) a channel: a word each
    const uint4 w = *reinterpret_cast<const uint4*>(m);
    s02 = __byte_perm(w.x, w.z, 0x5410), z02 = __byte_perm(w.x, w.z, 0x7632);
    s13 = __byte_perm(w.y, w.w, 0x5410), z13 = __byte_perm(w.y, w.w, 0x7632);
  } else if constexpr (R_FLD == 2) {  // a pair of channels: (0, 1) in word x, (2, 3) in word y
    const uint2 w = *reinterpret_cast<const uint2*>(m);
    s02 = s13 = __byte_perm(w.x, w.y, 0x5410), z02 = z13 = __byte_perm(w.x, w.y, 0x7632);
  } else if constexpr (R_GS == 1) {  // a scale a channel
    const uint2 w = *reinterpret_cast<const uint2*>(m);
    s02 = __byte_perm(w.x, w.y, 0x5410), s13 = __byte_perm(w.x, w.y, 0x7632), z02 = z13 = 0u;
  } else {  // a scale a channel pair
    s02 = s13 = *reinterpret_cast<const uint32_t*>(m), z02 = z13 = 0u;
  }
}

__device__ __forceinline__ uint32_t hmul2_u32(uint32_t a, uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// sc[i] += the RoPE key's scores of the warp's token block i (tokens tok_lo + 16i and + 8; tok_lo = 16·TPW·tp + g)
// for rows 2t, 2t + 1 (+ 8), read from the stage st with the query block's fragments at qa
__device__ __forceinline__ void rope_page_scores(const uint8_t* st, const T* qa, int tok_lo, int t,
                                                 float (&sc)[TPW][2][4]) {
  constexpr int RKS = RW * NPR;  // the RoPE key's k-steps
  constexpr uint32_t SYM_ZERO = R_BITS == 4 ? 0xC800C800u : 0xC000C000u;  // -2^(bits-1) twice, fp16
#pragma unroll
  for (int i = 0; i < TPW; ++i) {
    const int blk = (tok_lo & ~15) + 16 * i;  // the block's first token in the tile
    const uint8_t* set = st + RAW_RM + (RM_SETS == 1 ? 0 : (blk / R_BLK) * PMB_R);
    uint32_t s02[RKS], s13[RKS], z02[RKS], z13[RKS];
#pragma unroll
    for (int s = 0; s < RW; ++s)
#pragma unroll
      for (int p = 0; p < NPR; ++p) {
        const int k = s * NPR + p;
        rope_set_pairs(set, p * FB_RC + 4 * RW * t + 4 * s, s02[k], s13[k], z02[k], z13[k]);
      }
    // the set's largest |scale| (lanes t = 0..3 hold every channel's): its fp16 exponent e, clamped so that 2^-e and
    // 2^e are normal fp16 values
    uint32_t h = 0u;
#pragma unroll
    for (int k = 0; k < RKS; ++k) {
      const uint32_t a = s02[k] & 0x7fff7fffu, b = s13[k] & 0x7fff7fffu;
      h = max(h, max(max(a & 0xffffu, a >> 16), max(b & 0xffffu, b >> 16)));
    }
    h = max(h, __shfl_xor_sync(0xffffffffu, h, 1));
    h = max(h, __shfl_xor_sync(0xffffffffu, h, 2));
    const int e = min(max((int)(h >> 10) - 15, -14), 14);
    const uint32_t inv = (uint32_t)(15 - e) << 10, inv2 = inv | (inv << 16);  // 2^-e, fp16x2
    const float f = __int_as_float((127 + e) << 23);                          // 2^e
    const uint8_t* rl = st + RAW_RC + (tok_lo + 16 * i) * FB_RC + 4 * RW * t;
    float racc[NPR][2][4], zacc[1][2][4];
    zero_acc(racc);
    zero_acc(zacc);
#pragma unroll
    for (int s = 0; s < (SKIP_QK ? 0 : RW); ++s) {
      const uint32_t xl = reinterpret_cast<const uint32_t*>(rl)[s];
      const uint32_t xh = reinterpret_cast<const uint32_t*>(rl + 8 * FB_RC)[s];
#pragma unroll
      for (int p = 0; p < NPR; ++p) {
        const int k = s * NPR + p;
        uint32_t q[4];
        ldsm_x4(q, qa + (CKS + k) * 16);
        const uint32_t n02 = hmul2_u32(s02[k], inv2), n13 = hmul2_u32(s13[k], inv2);  // exact: powers of two
        const uint32_t b[4] = {hmul2_u32(q[0], n02), hmul2_u32(q[1], n13), hmul2_u32(q[2], n02), hmul2_u32(q[3], n13)};
        const uint32_t a[4] = {plane<R_BITS>(xl, p), plane<R_BITS>(xh, p), plane<R_BITS>(xl >> 8, p),
                               plane<R_BITS>(xh >> 8, p)};
        mma16816(racc[p][0], a, b[0], b[1]);
        mma16816(racc[p][1], a, b[2], b[3]);
        if constexpr (R_FLD == 2) {  // Σ z·q: the zeros as A, every row alike
          const uint32_t az[4] = {z02[k], z02[k], z13[k], z13[k]};
          mma16816(zacc[0][0], az, q[0], q[1]);
          mma16816(zacc[0][1], az, q[2], q[3]);
        } else {  // Σ -2^(bits-1)·B'
          const uint32_t az[4] = {SYM_ZERO, SYM_ZERO, SYM_ZERO, SYM_ZERO};
          mma16816(zacc[0][0], az, b[0], b[1]);
          mma16816(zacc[0][1], az, b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int p = 0; p < NPR; ++p) {
      const float w = f * code_weight<R_BITS>(p);
      fold_scale(sc[i], racc[p], w, w);
    }
    const float zf = R_FLD == 2 ? 1.0f : f;
    fold_scale(sc[i], zacc[0], zf, zf);
  }
}
