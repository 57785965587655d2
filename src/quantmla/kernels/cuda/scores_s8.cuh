// The tokens-as-M decode kernel's scores on 8-bit warpgroup MMAs (mla_decode_tm.cu with S8_QK; INT4/INT4 or
// INT2/INT4, the warps apart, one token block a warp). The 4 scores' warps issue each product together as one
// wgmma m64n32k32 u8·s8 -> s32: tokens (64, a warp's 16) as M, the 16 query rows' two 8-bit terms side by side as N.
//
//   A  a code plane masked in place: plane p of a byte is the u8 value c·2^(BITS·p) (4-bit codes: c and 16·c; 2-bit:
//      c, 4c, 16c, 64c); one AND a register of 4 codes. Register a0 (a2) of thread t holds bytes 0..3 of its word 2h
//      (2h + 1) of the 16 bytes it reads at column 64m + 16t of its row (a1, a3: the row 8 tokens down).
//   B  the query block in two s8 terms, q ≈ (amax/127)·(q1 + q2/256) a row (amax its largest |q|): rows n < 16 hold q1
//      of query row n, rows 16 + n its q2, K-major in 8 x 16-byte core matrices without swizzle (q8_at).
//   fold  each content group's products are exact s32 sums; a group's scale times the plane's weight 2^(-BITS·p)
//      multiplies 256·Σ(c·q1) + Σ(c·q2) once a token, in fp32. The row factor amax/(127·256) joins in sQf.
//
// Included by mla_decode_tm.cu after scores_tm.cuh (meta_sz) and wgmma.cuh.
#pragma once

#ifndef S8_AORDER
#define S8_AORDER 0  // layout checks: 1 swaps the A registers 1 and 2
#endif
#ifndef S8_DESC
#define S8_DESC 0  // layout checks: 1 swaps the descriptor's leading and stride offsets
#endif
__device__ __forceinline__ uint64_t q8_desc(const uint8_t* sQ8, int s) {
  return S8_DESC ? plain_desc(sQ8 + s * 1024, 128, 512) : plain_desc(sQ8 + s * 1024, 512, 128);
}

// d (+)= A·B over k32: m64n32k32, u8 A in registers (each warp's 16 rows), s8 B K-major through the descriptor db,
// s32 accumulators d[4j + e]: row g + 8·(e >> 1), column 8j + 2·(t % 4) + (e & 1); scale_d = 0 overwrites d
__device__ __forceinline__ void wgmma_m64n32k32_u8s8(int32_t (&d)[16], const uint32_t (&a)[4], uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.s32.u8.s8 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]),
        "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15])
      : "r"(a[0]), "r"(a[S8_AORDER ? 2 : 1]), "r"(a[S8_AORDER ? 1 : 2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

// sc += (256·d[term 1] + d[term 2])·(s_lo, s_hi): one group's products folded with its tokens' scales
__device__ __forceinline__ void fold_s8(float (&sc)[2][4], const int32_t (&d)[16], float s_lo, float s_hi) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float v = (float)(d[4 * nb + e] * 256 + d[4 * (nb + 2) + e]);
      sc[nb][e] = fmaf(v, e < 2 ? s_lo : s_hi, sc[nb][e]);
    }
}

// the mask of plane p of a byte's codes: the u8 value c·2^(BITS·p) of each of a register's 4 bytes
template <int BITS>
__device__ __forceinline__ uint32_t plane_mask(int p) {
  return (((1u << BITS) - 1u) << (BITS * p)) * 0x01010101u;
}

// the scores of one tile (stage st) for the warp's 16 tokens (tok_lo, tok_lo + 8) and every row, in the units of
// tile_scores<0> times 127·256/amax of each row (sQf holds the rest). The content in batches of two 64-byte column
// blocks and two planes (INT4: blocks 0-1 then 2-3 of planes 0 and 1, groups 0 and 2 then 1 and 3; INT2: blocks 0-1
// of planes 0 and 1, then of planes 2 and 3, one group a plane), then the RoPE key; each batch's products are
// waited for and folded (its two groups' scales, the planes' weights 2^(-BITS·p)) before the next is issued
__device__ __forceinline__ void tile_scores_s8(const uint8_t* st, const uint8_t* sQ8, int tok_lo, int t,
                                               float (&sc)[1][2][4]) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[0][nb][e] = 0.0f;
  const uint8_t* ml = st + RAW_CM + tok_lo * FB_CM;
  constexpr int NBP = FB_CC / 128, NPP = NPC / 2;  // block pairs, plane pairs
  int32_t acc[2][16];  // [plane of the pair]
#pragma unroll
  for (int bt = 0; bt < NBP * NPP; ++bt) {
    const int bp = bt / NPP, p0 = 2 * (bt % NPP);
#pragma unroll
    for (int mm = 0; mm < 2; ++mm) {
      const int m = 2 * bp + mm, col = 16 * (4 * m + t);
      const uint4 vl = *reinterpret_cast<const uint4*>(cc_at(st, tok_lo, col));
      const uint4 vh = *reinterpret_cast<const uint4*>(cc_at(st, tok_lo + 8, col));
      const uint32_t xl[4] = {vl.x, vl.y, vl.z, vl.w}, xh[4] = {vh.x, vh.y, vh.z, vh.w};
      uint32_t a[2][2][4];  // [h][plane of the pair]
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t mask = plane_mask<C_BITS>(p0 + j);
          a[h][j][0] = xl[2 * h] & mask, a[h][j][1] = xh[2 * h] & mask;
          a[h][j][2] = xl[2 * h + 1] & mask, a[h][j][3] = xh[2 * h + 1] & mask;
          asm volatile("" : "+r"(a[h][j][0]), "+r"(a[h][j][1]), "+r"(a[h][j][2]), "+r"(a[h][j][3])::"memory");
        }
      if (mm == 0) {
        fence_regs(acc[0]);
        fence_regs(acc[1]);
      }
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if (!SKIP_QK) wgmma_m64n32k32_u8s8(acc[j], a[h][j], q8_desc(sQ8, (2 * m + h) * NPC + p0 + j),
                                              mm == 0 && h == 0 ? 0 : 1);
      wgmma_commit();
    }
    wgmma_wait<0>();
    fence_regs(acc[0]);
    fence_regs(acc[1]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int p = p0 + j, grp = (p * FB_CC + 128 * bp) / C_GS;
      const float f = 1.0f / (float)(1 << (C_BITS * p));
      fold_s8(sc[0], acc[j], meta_sz(ml, grp).x * f, meta_sz(ml + 8 * FB_CM, grp).x * f);
    }
  }
  // the RoPE key: words 0, 1 of the 8 bytes at 8t of each row, both planes (one group: R_GS = 64)
  const uint8_t* rl = st + RAW_RC + tok_lo * FB_RC + 8 * t;
  const uint2 rwl = *reinterpret_cast<const uint2*>(rl), rwh = *reinterpret_cast<const uint2*>(rl + 8 * FB_RC);
  uint32_t ra[2][4];
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const uint32_t mask = plane_mask<4>(p);
    ra[p][0] = rwl.x & mask, ra[p][1] = rwh.x & mask, ra[p][2] = rwl.y & mask, ra[p][3] = rwh.y & mask;
    asm volatile("" : "+r"(ra[p][0]), "+r"(ra[p][1]), "+r"(ra[p][2]), "+r"(ra[p][3])::"memory");
  }
  fence_regs(acc[0]);
  fence_regs(acc[1]);
  wgmma_fence();
#pragma unroll
  for (int p = 0; p < 2; ++p)
    if (!SKIP_QK) wgmma_m64n32k32_u8s8(acc[p], ra[p], q8_desc(sQ8, 16 + p), 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(acc[0]);
  fence_regs(acc[1]);
  const uint8_t* rml = st + RAW_RM + tok_lo * FB_RM;
  const float r_lo = meta_sz(rml, 0).x, r_hi = meta_sz(rml + 8 * FB_RM, 0).x;
  fold_s8(sc[0], acc[0], r_lo, r_hi);
  fold_s8(sc[0], acc[1], r_lo * (1.0f / 16.0f), r_hi * (1.0f / 16.0f));
}
