// C without the built tile's key columns (QKC): each warp reads the stage's integer codes and masks them
// straight into the B operands of the score products, as exact fp16 subnormals: a code c at bit offset o of
// a 16-bit half, every other bit cleared, is the fp16 value c·2^(o-24). A group's products accumulate on
// their own, and its scale and zero point act once per token on the accumulators, in fp32:
//
//   S[h, t] += s[t, g]·2^(24-o)·Σ_{c in g} q[h, c]·code[t, c]·2^(o-24) + (z[t, g] - m·s[t, g])·Σ_{c in g} q[h, c]
//
// (m = 2^(b-1) for symmetric codes, 0 for affine ones). The output's product reads the content from the
// built tile as before (tile_build.cuh builds the content path only). Included by mla_decode.cu after its
// tile constants and ptx.cuh, for the 16-row plan with fp16 metadata and per-token metadata on both paths.
//
// Planar codes: byte j of a token's section holds channels j + k·NB for the 8 / b planes k. A warp's
// channel share is two (quad, plane) pairs of the content, a quad being 4 blocks of 16 bytes, and one
// (block, plane) pair of the RoPE codes. Lane t4 of a quad of lanes loads content block 4·quad + t4 of its
// token whole (16 bytes); word s of it gives, per plane, the channel pairs (4s, 4s + 1) and (4s + 2, 4s + 3)
// of that block: B fragment k indices (2·t4, 2·t4 + 1) and (2·t4 + 8, 2·t4 + 9) of score step 4·i + s. The
// query block is stored in that order (qkc_column), so the query fragments read it as they are.
#pragma once

#if QKC
constexpr int QCK = 8 / C_BITS, QRK = 8 / R_BITS;                // planes of the content and RoPE codes
constexpr int QNBC = D_C * C_BITS / 8, QNBR = D_R * R_BITS / 8;  // code bytes of a token
constexpr int QCF = C_KIND == 1 ? 2 : 1, QRF = R_KIND == 1 ? 2 : 1;  // metadata fields of a group
static_assert(HALF && C_MB == 2 && R_MB == 2 && (C_KIND == 1 || C_KIND == 2) && (R_KIND == 1 || R_KIND == 2),
              "scores from codes: integer codes with fp16 metadata on both paths");
static_assert(RM == 1 && !WS && !REG && BN == 32 && KSPLIT == 4 && TPW == 2 && KSTEPS == 9 && !R_PAGE,
              "scores from codes: the 16-row plan with per-token RoPE metadata");
static_assert((C_BITS == 2 || C_BITS == 4) && (R_BITS == 2 || R_BITS == 4) && D_C == 512 && D_R == 64,
              "scores from codes: 2- or 4-bit codes, 512 content and 64 RoPE channels");
static_assert(QNBC % 64 == 0 && (QNBC / 64) * QCK == 2 * KSPLIT && (QNBR / 16) * QRK == KSPLIT,
              "scores from codes: two (quad, plane) content pairs and one RoPE step a warp");
static_assert(C_GS % 64 == 0 && R_GS % 16 == 0, "scores from codes: a quad's 64 channels lie in one group");
static_assert(QCF == 1 || (FB_CM % 4 == 0 && FB_RM % 4 == 0), "affine metadata rows of whole (scale, zero) pairs");

// the query block's column of channel c (channel pairs (2n, 2n + 1) stay adjacent)
__host__ __device__ constexpr int qkc_column(int c) {
  if (c < D_C) {
    const int plane = c / QNBC, byte = c % QNBC, blk = byte / 16, quad = blk / 4, t4 = blk % 4;
    const int s = (byte % 16) / 4, r = byte % 4, pi = quad * QCK + plane;
    return ((pi / 2) * KSTEPS + (pi % 2) * 4 + s) * 16 + 2 * t4 + 8 * (r / 2) + (r % 2);
  }
  const int cr = c - D_C, plane = cr / QNBR, byte = cr % QNBR, rb = byte / 16, bb = byte % 16;
  const int ks = rb * QRK + plane, t4 = bb / 4, r = bb % 4;
  return (ks * KSTEPS + 8) * 16 + 2 * t4 + 8 * (r / 2) + (r % 2);
}

// the (scale, zero) of a group of two tokens as float2s: (s·2^(24-o), z - m·s) for the accumulators
template <int F, int BITS, int KIND>
__device__ __forceinline__ void token_pair_meta(const uint8_t* m0, const uint8_t* m1, int o, float2& sk, float2& zz) {
  constexpr float MID = KIND == 2 ? (float)(1 << (BITS - 1)) : 0.0f;
  const float up = __int_as_float((127 + 24 - o) << 23);  // 2^(24 - o)
  float s0, s1, z0 = 0.0f, z1 = 0.0f;
  if constexpr (F == 2) {
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(m0));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(m1));
    s0 = a.x, z0 = a.y, s1 = b.x, z1 = b.y;
  } else {
    s0 = __half2float(*reinterpret_cast<const __half*>(m0));
    s1 = __half2float(*reinterpret_cast<const __half*>(m1));
  }
  sk = make_float2(s0 * up, s1 * up);
  zz = make_float2(fmaf(-MID, s0, z0), fmaf(-MID, s1, z1));
}

// the sums of this warp's query columns [col0, col0 + n) over rows g and g + 8 (a quad's lanes share them)
__device__ __forceinline__ float2 query_sums(const T* sQ, int col0, int n, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  float lo = 0.0f, hi = 0.0f;
  for (int c = col0 + t4; c < col0 + n; c += 4) {
    lo += __half2float(sQ[g * LDK + c]);
    hi += __half2float(sQ[(g + 8) * LDK + c]);
  }
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    lo += __shfl_xor_sync(0xffffffffu, lo, o);
    hi += __shfl_xor_sync(0xffffffffu, hi, o);
  }
  return make_float2(lo, hi);
}

// this warp's query sums: its two content (quad, plane) pairs (64 columns each) and its RoPE step (16)
struct QuerySums {
  float2 c[2], r;
};
__device__ __forceinline__ QuerySums load_query_sums(const T* sQ, int ks, int lane) {
  QuerySums q;
  q.c[0] = query_sums(sQ, ks * KSTEPS * 16, 64, lane);
  q.c[1] = query_sums(sQ, (ks * KSTEPS + 4) * 16, 64, lane);
  q.r = query_sums(sQ, (ks * KSTEPS + 8) * 16, 16, lane);
  return q;
}

// acc (the scores of one m16 x n8 tile) += one group's products g, scaled per token and offset per row
__device__ __forceinline__ void add_group(float (&acc)[4], const float (&g)[4], float2 sk, float2 zz, float2 qs) {
  acc[0] = fmaf(g[0], sk.x, fmaf(zz.x, qs.x, acc[0]));
  acc[1] = fmaf(g[1], sk.y, fmaf(zz.y, qs.x, acc[1]));
  acc[2] = fmaf(g[2], sk.x, fmaf(zz.x, qs.y, acc[2]));
  acc[3] = fmaf(g[3], sk.y, fmaf(zz.y, qs.y, acc[3]));
}

// C: this warp's scores of token tiles nj0, nj0 + 1 over its channel share ks, from the stage's codes
__device__ __forceinline__ void scores_codes(const uint8_t* stage, const uint32_t (&qf)[KSTEPS][4],
                                             float (&sacc)[TPW][1][4], const QuerySums& qsum, int ks, int nj0,
                                             int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  const int pi0 = 2 * ks, quad = pi0 / QCK, plane0 = pi0 % QCK;  // both pairs share the quad
  const int rplane = ks % QRK, rblk = ks / QRK;
  const int rgrp = (rplane * QNBR + 16 * rblk) / R_GS;
#pragma unroll
  for (int j = 0; j < TPW; ++j) {
    const int r = (nj0 + j) * 8 + g;          // the token of this lane's B fragments
    const int rc = (nj0 + j) * 8 + 2 * t4;    // the tokens of its accumulators: rc, rc + 1
    const uint4 blk = *reinterpret_cast<const uint4*>(stage + RAW_CC + r * FB_CC + 16 * (4 * quad + t4));
    const uint32_t wv[4] = {blk.x, blk.y, blk.z, blk.w};
    uint32_t lo[4], hi[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      lo[s] = __byte_perm(wv[s], 0, 0x4140);  // bytes 0, 1 -> the two 16-bit halves
      hi[s] = __byte_perm(wv[s], 0, 0x4342);  // bytes 2, 3
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int plane = plane0 + i, o = plane * C_BITS;
      const uint32_t mask = (((1u << C_BITS) - 1u) << o) * 0x10001u;
      float ga[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < 4; ++s) mma16816(ga, qf[4 * i + s], lo[s] & mask, hi[s] & mask);
      const int grp = (plane * QNBC + 64 * quad) / C_GS;
      float2 sk, zz;
      token_pair_meta<QCF, C_BITS, C_KIND>(stage + RAW_CM + rc * FB_CM + grp * QCF * 2,
                                           stage + RAW_CM + (rc + 1) * FB_CM + grp * QCF * 2, o, sk, zz);
      add_group(sacc[j][0], ga, sk, zz, qsum.c[i]);
    }
    const uint32_t w = *reinterpret_cast<const uint32_t*>(stage + RAW_RC + r * FB_RC + 16 * rblk + 4 * t4);
    const int o = rplane * R_BITS;
    const uint32_t mask = (((1u << R_BITS) - 1u) << o) * 0x10001u;
    float ga[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma16816(ga, qf[8], __byte_perm(w, 0, 0x4140) & mask, __byte_perm(w, 0, 0x4342) & mask);
    float2 sk, zz;
    token_pair_meta<QRF, R_BITS, R_KIND>(stage + RAW_RM + rc * FB_RM + rgrp * QRF * 2,
                                         stage + RAW_RM + (rc + 1) * FB_RM + rgrp * QRF * 2, o, sk, zz);
    add_group(sacc[j][0], ga, sk, zz, qsum.r);
  }
}
#endif  // QKC
