// The tokens-as-M decode kernel's scores (mla_decode_tm.cu): Sᵀ = K·Qᵀ of one tile for a warp's 16 tokens over its
// share of the 576 channels (all, or half with two token blocks a warp) on mma.sync products, the codes masked in
// place into the A operand, each group's scale folded in once and the zero points through the query's group sums (a
// RoPE path grouped per page: rope_page_tm.cuh). Included by mla_decode_tm.cu after its constants and its
// shared-memory map.
#pragma once

// the (scale, zero) of group grp of a token's metadata row, fp32 (FP8 content: its fp32 scale, zero 0)
__device__ __forceinline__ float2 meta_sz(const uint8_t* row, int grp) {
  if constexpr (C_FP8) return make_float2(*reinterpret_cast<const float*>(row + 4 * grp), 0.0f);
  else return __half22float2(*reinterpret_cast<const __half2*>(row + 4 * grp));
}

// the weight of plane p's codes as the products read them (code·2^(o-24) at bit offset o: 2^(24-o)); e4m3: 1
template <int BITS>
__device__ __forceinline__ float code_weight(int p) {
  if constexpr (BITS == 8) return 1.0f;
  else return (float)(1 << (24 - p * BITS));
}

#include "code_planes.cuh"  // plane, e4m3x2_f16x2

// sc += acc·(s_lo, s_hi): a group's products folded into the scores with the scale of token tok_lo (rows
// c0, c1 of an accumulator) and of tok_lo + 8 (rows c2, c3)
__device__ __forceinline__ void fold_scale(float (&sc)[2][4], const float (&acc)[2][4], float s_lo, float s_hi) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
    sc[nb][0] = fmaf(acc[nb][0], s_lo, sc[nb][0]);
    sc[nb][1] = fmaf(acc[nb][1], s_lo, sc[nb][1]);
    sc[nb][2] = fmaf(acc[nb][2], s_hi, sc[nb][2]);
    sc[nb][3] = fmaf(acc[nb][3], s_hi, sc[nb][3]);
  }
}

template <int NP>
__device__ __forceinline__ void zero_acc(float (&acc)[NP][2][4]) {
#pragma unroll
  for (int p = 0; p < NP; ++p)
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[p][nb][e] = 0.0f;
}

#include "rope_page_tm.cuh"  // rope_page_scores

// one word of each of the scores' tokens (xl[i]: tok_lo + 16i, xh[i]: tok_lo + 16i + 8, for the warp's TPW token
// blocks i) into the products of its NP planes: plane p is k-step kstep0 + p of the query block (its bytes 0, 2
// give k 2t, 2t + 1, bytes 1, 3 k 2t + 8, 2t + 9); the query fragment of a k-step is read once for the TPW blocks
template <int BITS, int NP>
__device__ __forceinline__ void scores_word(float (&acc)[TPW][NP][2][4], const uint32_t (&xl)[TPW],
                                            const uint32_t (&xh)[TPW], const T* qa, int kstep0) {
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    uint32_t q[4];
    ldsm_x4(q, qa + (kstep0 + p) * 16);
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      if constexpr (BITS == 8) {  // e4m3: bytes 0, 1 give k 2t, 2t + 1, bytes 2, 3 k 2t + 8, 2t + 9
        const uint32_t a[4] = {e4m3x2_f16x2(xl[i]), e4m3x2_f16x2(xh[i]), e4m3x2_f16x2(xl[i] >> 16),
                               e4m3x2_f16x2(xh[i] >> 16)};
        mma16816(acc[i][p][0], a, q[0], q[1]);
        mma16816(acc[i][p][1], a, q[2], q[3]);
      } else {
        const uint32_t a[4] = {plane<BITS>(xl[i], p), plane<BITS>(xh[i], p), plane<BITS>(xl[i] >> 8, p),
                               plane<BITS>(xh[i] >> 8, p)};
        mma16816(acc[i][p][0], a, q[0], q[1]);
        mma16816(acc[i][p][1], a, q[2], q[3]);
      }
    }
  }
}

// the partial scores of one tile (stage st) for the warp's TPW token blocks (tokens tok_lo + 16i and + 8) and rows
// 2t, 2t + 1 (+ 8) over the channels of score half KH (of KS): content blocks [KH, KH + 1)·CM / KS of 64 bytes, and
// the RoPE key in the last half. sc[i][nb][e] is row 8nb + 2t + (e & 1) of token tok_lo + 16i + 8·(e >> 1):
// Σ scale·codes·q, each group's scale folded in per token (a group split between halves is folded in each); the
// zero points come in finish_scores
template <int KH>
__device__ __forceinline__ void tile_scores(const uint8_t* st, const T* qa, int tok_lo, int t, float (&sc)[TPW][2][4]) {
#pragma unroll
  for (int i = 0; i < TPW; ++i)
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[i][nb][e] = 0.0f;
  constexpr int CM = FB_CC / 64, M0 = KH * CM / KS, M1 = (KH + 1) * CM / KS;
  constexpr int MPG = C_GS / 64;  // 64-channel blocks of a plane in one group
  float acc[TPW][NPC][2][4];
#pragma unroll
  for (int m = M0; m < M1; ++m) {
    if (m % MPG == 0 || m == M0) {
#pragma unroll
      for (int i = 0; i < TPW; ++i) zero_acc(acc[i]);
    }
    uint32_t xl[TPW][4], xh[TPW][4];
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      const int row = tok_lo + 16 * i, col = 16 * (4 * m + t);
      const uint4 vl = *reinterpret_cast<const uint4*>(cc_at(st, row, col));
      const uint4 vh = *reinterpret_cast<const uint4*>(cc_at(st, row + 8, col));
      xl[i][0] = vl.x, xl[i][1] = vl.y, xl[i][2] = vl.z, xl[i][3] = vl.w;
      xh[i][0] = vh.x, xh[i][1] = vh.y, xh[i][2] = vh.z, xh[i][3] = vh.w;
    }
#pragma unroll
    for (int s = 0; s < (SKIP_QK ? 0 : 4); ++s) {
      uint32_t wl[TPW], wh[TPW];
#pragma unroll
      for (int i = 0; i < TPW; ++i) wl[i] = xl[i][s], wh[i] = xh[i][s];
      scores_word<C_BITS>(acc, wl, wh, qa, (m * 4 + s) * NPC);
    }
    if (m % MPG == MPG - 1 || m == M1 - 1) {
#pragma unroll
      for (int i = 0; i < TPW; ++i) {
        const uint8_t* ml = st + RAW_CM + (tok_lo + 16 * i) * FB_CM;
#pragma unroll
        for (int p = 0; p < NPC; ++p) {  // fold the group's scale (and the codes' 2^(24 - o)) per token
          const int grp = (p * FB_CC + 64 * m) / C_GS;
          const float f = code_weight<C_BITS>(p);
          fold_scale(sc[i], acc[i][p], meta_sz(ml, grp).x * f, meta_sz(ml + 8 * FB_CM, grp).x * f);
        }
      }
    }
  }
  if constexpr (KH == KS - 1 && R_PAGE) {
    rope_page_scores(st, qa, tok_lo, t, sc);
  } else if constexpr (KH == KS - 1) {
    // the RoPE key: RW words a thread at byte 4·RW·t of each row
    uint32_t xl[TPW][RW], xh[TPW][RW];
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      const uint8_t* rl = st + RAW_RC + (tok_lo + 16 * i) * FB_RC + 4 * RW * t;
#pragma unroll
      for (int s = 0; s < RW; ++s) {
        xl[i][s] = reinterpret_cast<const uint32_t*>(rl)[s];
        xh[i][s] = reinterpret_cast<const uint32_t*>(rl + 8 * FB_RC)[s];
      }
    }
    float racc[TPW][NPR][2][4];
#pragma unroll
    for (int i = 0; i < TPW; ++i) zero_acc(racc[i]);
    if constexpr (C_FP8) {  // bf16 values: words 2s, 2s + 1 of a thread's 32 bytes are k-step CKS + s
#pragma unroll
      for (int s = 0; s < (SKIP_QK ? 0 : RW / 2); ++s) {
        uint32_t q[4];
        ldsm_x4(q, qa + (CKS + s) * 16);
#pragma unroll
        for (int i = 0; i < TPW; ++i) {
          const uint32_t a[4] = {xl[i][2 * s], xh[i][2 * s], xl[i][2 * s + 1], xh[i][2 * s + 1]};
          mma16816<true>(racc[i][0][0], a, q[0], q[1]);  // bf16
          mma16816<true>(racc[i][0][1], a, q[2], q[3]);
        }
      }
#pragma unroll
      for (int i = 0; i < TPW; ++i) fold_scale(sc[i], racc[i][0], 1.0f, 1.0f);
    } else {
#pragma unroll
      for (int s = 0; s < (SKIP_QK ? 0 : RW); ++s) {
        uint32_t wl[TPW], wh[TPW];
#pragma unroll
        for (int i = 0; i < TPW; ++i) wl[i] = xl[i][s], wh[i] = xh[i][s];
        scores_word<R_BITS>(racc, wl, wh, qa, CKS + s * NPR);
      }
#pragma unroll
      for (int i = 0; i < TPW; ++i) {
        const uint8_t* rml = st + RAW_RM + (tok_lo + 16 * i) * FB_RM;
#pragma unroll
        for (int p = 0; p < NPR; ++p) {
          const int grp = p * FB_RC / R_GS;
          const float f = code_weight<R_BITS>(p);
          fold_scale(sc[i], racc[i][p], meta_sz(rml, grp).x * f, meta_sz(rml + 8 * FB_RM, grp).x * f);
        }
      }
    }
  }
}

// the thread's own rows' scores (row blocks nb0 + nbl, nbl < NB_OWN) of token block i (tokens tok_lo, tok_lo + 8)
// finished: the zero points through the query's group sums, the row factor; base-2 scaled scores, -inf past the
// sequence or the row's limit
__device__ __forceinline__ void finish_scores(const uint8_t* st, float (&sc)[NB_OWN][4], const float (&qf)[RI],
                                              const float (&qsum)[NG][RI], const int (&limit)[RI], int tok_lo, int valid,
                                              int n0) {
  const uint8_t* ml = st + RAW_CM + tok_lo * FB_CM;
  const uint8_t* mh = ml + 8 * FB_CM;
  const uint8_t* rml = st + RAW_RM + tok_lo * FB_RM;
  float z_lo[NG], z_hi[NG];
#pragma unroll
  for (int grp = 0; grp < NG; ++grp) {  // FP8: no zero points (its meta_sz reads zero 0)
    z_lo[grp] = grp < CG ? meta_sz(ml, grp).y : meta_sz(rml, grp - CG).y;
    z_hi[grp] = grp < CG ? meta_sz(mh, grp).y : meta_sz(rml + 8 * FB_RM, grp - CG).y;
  }
#pragma unroll
  for (int nbl = 0; nbl < NB_OWN; ++nbl)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ri = 2 * nbl + (e & 1), tok = tok_lo + 8 * (e >> 1);
      float v = sc[nbl][e] * qf[ri];
#pragma unroll
      for (int grp = 0; grp < NG; ++grp) v = fmaf(e < 2 ? z_lo[grp] : z_hi[grp], qsum[grp][ri], v);
      sc[nbl][e] = tok < valid && n0 + tok < limit[ri] ? v : -INFINITY;
    }
}
