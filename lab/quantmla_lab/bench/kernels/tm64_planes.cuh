// The tokens-as-M tile loop at 64 query rows with the codes masked in place (tokens_m_64.cu's DQA=0 build): each 4-bit
// code's plane is an exact fp16 subnormal (code_planes.cuh's plane<4>), so a content group's products stay apart until
// its scale folds in per token and the zero points take products of their own. Included after tm64_ops.cuh.
#pragma once

// the scores Sᵀ[64 tokens, 64 rows] of the tile in raw stage st into sc (overwritten), all products done on return.
// Content: two 64-byte blocks a group pair (group q in plane 0, q + 2 in plane 1), both planes at once on two sets of
// accumulators, or (ONE) a plane at a time on one (the words read twice); WORDS words of a token a commit group; each
// group's sums times the token's scale into sc. RoPE: 4 k-steps (32 bytes a token), one group. The zero points: A a
// token's 5 zeros (hi and lo terms of the sums: k 2z, 2z + 1), B the query's group sums (dqs).
template <int WORDS, bool ONE>
__device__ __forceinline__ void scores_planes(float (&sc)[32], const uint8_t* st, uint64_t dq, uint64_t dqs, int r_lo,
                                              int t) {
  constexpr int NA = ONE ? 1 : 2;  // accumulator sets
  float acc[NA][32];
  const uint8_t* ml = st + RAW_CM + r_lo * FB_CM;
#pragma unroll
  for (int i = 0; i < 32; ++i) sc[i] = 0.0f;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
#pragma unroll
    for (int pp = 0; pp < (ONE ? 2 : 1); ++pp) {
#pragma unroll
      for (int m = 2 * q; m < 2 * q + 2; ++m) {
        uint32_t xl[4], xh[4];
        content_words(st, r_lo, t, m, xl, xh);
#pragma unroll
        for (int s0 = 0; s0 < 4; s0 += WORDS) {  // WORDS words of each token: their A operands, then their products
          uint32_t a[WORDS][2][4];
#pragma unroll
          for (int s = s0; s < s0 + WORDS; ++s)
#pragma unroll
            for (int p = 0; p < NA; ++p) {
              const int pl = ONE ? pp : p;
              a[s - s0][p][0] = plane<4>(xl[s], pl), a[s - s0][p][1] = plane<4>(xh[s], pl);
              a[s - s0][p][2] = plane<4>(xl[s] >> 8, pl), a[s - s0][p][3] = plane<4>(xh[s] >> 8, pl);
            }
          wgmma_fence();  // the operand registers just written, visible to the products
#pragma unroll
          for (int s = s0; s < s0 + WORDS; ++s)
#pragma unroll
            for (int p = 0; p < NA; ++p)
              if constexpr (!SKIP_QK)
                wgmma_m64n64_ra<0>(acc[p], a[s - s0][p], query_kstep(dq, (m * 4 + s) * 2 + (ONE ? pp : p)),
                                   m > 2 * q || s > 0);
          wgmma_commit();
          wgmma_wait<1>();  // the group before's products are done: their operand registers are free
        }
      }
      wgmma_wait<0>();
      fence_regs(acc[0]);
      if constexpr (!ONE) fence_regs(acc[1]);
#pragma unroll
      for (int p = 0; p < NA; ++p) {
        const int pl = ONE ? pp : p;
        const float s_lo = h2f(*reinterpret_cast<const uint32_t*>(ml + 4 * (q + 2 * pl))).x * (float)(1 << (24 - 4 * pl));
        const float s_hi = h2f(*reinterpret_cast<const uint32_t*>(ml + 8 * FB_CM + 4 * (q + 2 * pl))).x *
                           (float)(1 << (24 - 4 * pl));
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          sc[4 * j] = fmaf(acc[p][4 * j], s_lo, sc[4 * j]);
          sc[4 * j + 1] = fmaf(acc[p][4 * j + 1], s_lo, sc[4 * j + 1]);
          sc[4 * j + 2] = fmaf(acc[p][4 * j + 2], s_hi, sc[4 * j + 2]);
          sc[4 * j + 3] = fmaf(acc[p][4 * j + 3], s_hi, sc[4 * j + 3]);
        }
      }
    }
  }
  {  // RoPE: 8 bytes a token (masked), with ONE plane 1 shifted to plane 0's weight: one group, one sum
    uint32_t xl[2], xh[2];
    rope_words(st, r_lo, t, xl, xh);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      uint32_t a[2][4];
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const uint32_t l = ONE ? xl[s] >> (4 * p) : xl[s], h = ONE ? xh[s] >> (4 * p) : xh[s];
        const int pl = ONE ? 0 : p;
        a[p][0] = plane<4>(l, pl), a[p][1] = plane<4>(h, pl);
        a[p][2] = plane<4>(l >> 8, pl), a[p][3] = plane<4>(h >> 8, pl);
      }
      wgmma_fence();
#pragma unroll
      for (int p = 0; p < 2; ++p)
        if constexpr (!SKIP_QK)
          wgmma_m64n64_ra<0>(acc[ONE ? 0 : p], a[p], query_kstep(dq, 32 + 2 * s + p), s > 0 || (ONE && p > 0));
      wgmma_commit();
      wgmma_wait<1>();
    }
    wgmma_wait<0>();
    fence_regs(acc[0]);
    if constexpr (!ONE) fence_regs(acc[1]);
    const float r_lo_s = h2f(*reinterpret_cast<const uint32_t*>(st + RAW_RM + r_lo * FB_RM)).x;
    const float r_hi_s = h2f(*reinterpret_cast<const uint32_t*>(st + RAW_RM + (r_lo + 8) * FB_RM)).x;
#pragma unroll
    for (int e = 0; e < 32; ++e)
      sc[e] = fmaf(acc[0][e] * 16777216.0f + (ONE ? 0.0f : acc[ONE ? 0 : 1][e] * 1048576.0f), (e & 2) ? r_hi_s : r_lo_s,
                   sc[e]);
  }
  {  // the zero points: fp16 pairs (zero of group 2z', same) for k 2t, 2t + 1 and 2t + 8, 2t + 9
    auto zeros = [&](int row) {
      const uint8_t* m = st + RAW_CM + row * FB_CM;
      const uint32_t z0 = *reinterpret_cast<const uint32_t*>(m + 4 * (t & 3)) >> 16;
      return z0 | (z0 << 16);
    };
    const uint32_t a[4] = {zeros(r_lo), zeros(r_lo + 8), t == 0 ? zeros(r_lo) : 0u, t == 0 ? zeros(r_lo + 8) : 0u};
    wgmma_fence();
    wgmma_m64n64_ra<0>(sc, a, dqs, 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(sc);
  }
}

// P = 2^(sc - ref) of the thread's two tokens r_lo, r_lo + 8 and P·scale of each content group (fp16, N-major, the
// 128-byte swizzle) into P buffer pb: chunks 0-3 P·scale of groups 0-3, chunk 4 P (ml: token r_lo's content metadata)
__device__ __forceinline__ void write_p_scaled(const float (&sc)[32], const float (&ref)[16], const uint8_t* ml,
                                               uint8_t* pb, int r_lo, int t) {
  float cs[2][4];  // the content scales of the two tokens
#pragma unroll
  for (int G = 0; G < 4; ++G) {
    cs[0][G] = h2f(*reinterpret_cast<const uint32_t*>(ml + 4 * G)).x;
    cs[1][G] = h2f(*reinterpret_cast<const uint32_t*>(ml + 8 * FB_CM + 4 * G)).x;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float p0 = fast_exp2(sc[4 * j] - ref[2 * j]), p1 = fast_exp2(sc[4 * j + 1] - ref[2 * j + 1]);
    const float p2 = fast_exp2(sc[4 * j + 2] - ref[2 * j]), p3 = fast_exp2(sc[4 * j + 3] - ref[2 * j + 1]);
    const int o_lo = swz(r_lo, j) + 4 * t, o_hi = swz(r_lo + 8, j) + 4 * t;
#pragma unroll
    for (int G = 0; G < 4; ++G) {
      *reinterpret_cast<uint32_t*>(pb + G * CHUNK + o_lo) = f2h(p0 * cs[0][G], p1 * cs[0][G]);
      *reinterpret_cast<uint32_t*>(pb + G * CHUNK + o_hi) = f2h(p2 * cs[1][G], p3 * cs[1][G]);
    }
    *reinterpret_cast<uint32_t*>(pb + 4 * CHUNK + o_lo) = f2h(p0, p1);
    *reinterpret_cast<uint32_t*>(pb + 4 * CHUNK + o_hi) = f2h(p2, p3);
  }
}

// Σ P·zero of each content group (rows 0-3 of zl's N) and Σ P (row 4) over the tile's tokens, issued (the caller
// waits): A a token's zeros (row g < 4: group g's; row 4: ones), B = P (chunk 4 of P buffer pb, N-major)
__device__ __forceinline__ void zero_sums(float (&zl)[32], const uint8_t* st, const uint8_t* pb, int w, int g, int t) {
  const uint64_t dp = sw128_desc(pb + 4 * CHUNK, CHUNK, 1024);
  uint32_t a[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    a[kk][0] = a[kk][1] = a[kk][2] = a[kk][3] = 0u;
    if (w == 0 && g < 5) {  // tokens 16kk + 2t (+ 1, + 8, + 9)
      const uint8_t* m = st + RAW_CM + (16 * kk + 2 * t) * FB_CM + 4 * (g & 3) + 2;
      const uint32_t z0 = *reinterpret_cast<const uint16_t*>(m), z1 = *reinterpret_cast<const uint16_t*>(m + FB_CM);
      const uint32_t z8 = *reinterpret_cast<const uint16_t*>(m + 8 * FB_CM), z9 = *reinterpret_cast<const uint16_t*>(m + 9 * FB_CM);
      a[kk][0] = g < 4 ? z0 | (z1 << 16) : 0x3C003C00u;
      a[kk][2] = g < 4 ? z8 | (z9 << 16) : 0x3C003C00u;
    }
  }
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    wgmma_m64n64_ra<1>(zl, a[kk], dp + ((kk * 16 * 128) >> 4), 1);
    wgmma_commit();
    wgmma_wait<1>();
  }
}

// k-step kk of output warpgroup o's products, issued and committed (the caller waits): acc[2p + z] += Cᵀ·(P·scale)
// with A byte pair z of the thread's 4 code bytes at col (channel rows g, g + 8 of m-block 2p + z) masked to plane p,
// B P·scale of group o (d0, planes 0) or o + 2 (d1, plane 1), N-major
__device__ __forceinline__ void output_planes_kstep(float (&acc)[4][32], const uint8_t* st, uint64_t d0, uint64_t d1,
                                                    int kk, int col, int t) {
  const uint4 w4 = code_words(st, kk, col, t);
  uint32_t a[4][4];
#pragma unroll
  for (int z = 0; z < 2; ++z) {
    const uint32_t sel = z ? 0x7632u : 0x5410u;
    const uint32_t zab = __byte_perm(w4.x, w4.y, sel), zcd = __byte_perm(w4.z, w4.w, sel);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      a[2 * p + z][0] = plane<4>(zab, p), a[2 * p + z][1] = plane<4>(zab >> 8, p);
      a[2 * p + z][2] = plane<4>(zcd, p), a[2 * p + z][3] = plane<4>(zcd >> 8, p);
    }
  }
  wgmma_fence();
#pragma unroll
  for (int mb = 0; mb < 4; ++mb)
    if constexpr (!SKIP_PV) wgmma_m64n64_ra<1>(acc[mb], a[mb], (mb >= 2 ? d1 : d0) + ((kk * 16 * 128) >> 4), 1);
  wgmma_commit();
}
