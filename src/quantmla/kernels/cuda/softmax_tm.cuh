// The tokens-as-M decode kernel's softmax (mla_decode_tm.cu), base 2 and in registers: P of a tile for a thread's
// own rows, the tile's vote on whether a row's reference maximum moves, and the move itself (rare). Included by
// mla_decode_tm.cu after its constants, its shared-memory map and scores_tm.cuh.
#pragma once

// P = 2^(s - ref) of one tile for the thread's own rows: their sums and Σ P·zero per content group in registers,
// P·scale per content group into sP [CG, BM, LDP] at the tokens' output k positions (tok_lo and tok_lo + 8 side by
// side); sc and mref are the own rows' scores and reference maxima, nb0 their first 8-row block.
// No per-token guards: a masked token's score is -inf, so its P is 2^-inf = 0 (against a reference of 0 where the
// row has seen no score yet), and a token past the unit's end has its metadata zeroed (zero_past_end), so 0·scale
// stays 0 whatever bytes the page held there
__device__ __forceinline__ void tile_probabilities(const uint8_t* st, T* sP, const float (&sc)[NB_OWN][4],
                                                   const float (&mref)[RI], float (&l_run)[RI], float (&zacc)[CG][RI],
                                                   int tb, int nb0, int g, int t, int tok_lo) {
  const uint8_t* ml = st + RAW_CM + tok_lo * FB_CM;
  const uint8_t* mh = ml + 8 * FB_CM;
  const int kpos = 16 * tb + 2 * (g >> 1) + 8 * (g & 1);
  float2 szl[CG], szh[CG];
#pragma unroll
  for (int grp = 0; grp < CG; ++grp) szl[grp] = meta_sz(ml, grp), szh[grp] = meta_sz(mh, grp);
#pragma unroll
  for (int ri = 0; ri < RI; ++ri) {
    const int nb = ri >> 1, e = ri & 1, row = 8 * (nb0 + nb) + 2 * t + e;
    const float m_safe = mref[ri] == -INFINITY ? 0.0f : mref[ri];
    const float plo = fast_exp2(sc[nb][e] - m_safe), phi = fast_exp2(sc[nb][e + 2] - m_safe);
    l_run[ri] += plo + phi;
#pragma unroll
    for (int grp = 0; grp < CG; ++grp) {
      zacc[grp][ri] += plo * szl[grp].y + phi * szh[grp].y;
      *reinterpret_cast<T2*>(sP + (grp * BM + row) * LDP + kpos) = __floats2half2_rn(plo * szl[grp].x, phi * szh[grp].x);
    }
  }
}

// a tile that runs past its unit's end (valid < BN tokens are the unit's): the content metadata of the tokens past
// it zeroed in the stage, before the vote's barrier (P reads it after). Other warps' scores may still read those
// bytes, for tokens they mask
__device__ __forceinline__ void zero_past_end(uint8_t* st, int valid, int tid) {
  uint32_t* m = reinterpret_cast<uint32_t*>(st + RAW_CM + valid * FB_CM);
  for (int i = tid; i < (BN - valid) * FB_CM / 4; i += NTR) m[i] = 0u;  // by the NTR threads of the scores
}

// SCALE_VOTE (not a default until measured on a GPU): a token's P may also not pass 65504 / its largest content scale,
// so that P·scale, an fp16 operand, stays finite whatever scales the cache holds; without it P stays below 2^8 only,
// and content scales past 65504 / 2^8 (TM_MAX_CONTENT_SCALE) can overflow
#ifndef SCALE_VOTE
#define SCALE_VOTE 0
#endif
constexpr float LOG2_P_SCALE_MAX = 15.99f;  // log2 of a bound on P·scale: 2^15.99 = 65081, under fp16's 65504
// (a bound for scales up to 65504, all that fp16 metadata holds: past it, as FP8's fp32 scales may be, P·scale overflows
// at P = 1)

// the largest base-2 exponent past its row's reference that P of the thread's tokens tok_lo + 16i + 8h may take: 8,
// or with SCALE_VOTE min(8, LOG2_P_SCALE_MAX - log2 of the token's largest content scale), at least 0 (a token whose
// metadata is garbage has the score -inf: past the unit's end, or masked)
__device__ __forceinline__ void p_limits(const uint8_t* st, int tok_lo, float (&lim)[TPW][2]) {
#pragma unroll
  for (int i = 0; i < TPW; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lim[i][h] = 8.0f;
      if constexpr (SCALE_VOTE) {
        const uint8_t* m = st + RAW_CM + (tok_lo + 16 * i + 8 * h) * FB_CM;
        float smax = 0.0f;
#pragma unroll
        for (int grp = 0; grp < CG; ++grp) smax = fmaxf(smax, fabsf(meta_sz(m, grp).x));
        lim[i][h] = fminf(8.0f, fmaxf(0.0f, LOG2_P_SCALE_MAX - __log2f(smax)));
      }
    }
}

// does any of the thread's own scores exceed its row's reference maximum by more than its token's limit (2^8, base 2,
// or less with SCALE_VOTE: p_limits)? (the tile's vote)
__device__ __forceinline__ bool exceeds_reference(const float (&sc)[TPW][NB_OWN][4], const float (&mref)[RI],
                                                  const float (&lim)[TPW][2], bool scores) {
  bool exceeds = false;
#pragma unroll
  for (int i = 0; i < TPW; ++i)
#pragma unroll
    for (int nb = 0; nb < NB_OWN; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) exceeds |= scores && sc[i][nb][e] > mref[2 * nb + (e & 1)] + lim[i][e >> 1];
  return exceeds;
}

// the own rows' reference maxima (mref) from every row's (ref: rows 8·(ri >> 1) + 2t + (ri & 1))
__device__ __forceinline__ void own_reference(const float (&ref)[4], float (&mref)[RI], int nb0) {
#pragma unroll
  for (int ri = 0; ri < RI; ++ri) mref[ri] = KS == 1 ? ref[ri] : (nb0 ? ref[2 + ri] : ref[ri]);
}

// the output accumulators' row 8·(ri >> 1) + 2t + (ri & 1) times alpha
__device__ __forceinline__ void rescale_rows(float (&oacc)[OMB][2][4], int ri, float alpha) {
#pragma unroll
  for (int mb = 0; mb < OMB; ++mb) {
    oacc[mb][ri >> 1][ri & 1] *= alpha;
    oacc[mb][ri >> 1][(ri & 1) + 2] *= alpha;
  }
}

// after a vote that some row's maximum moved (rare; uniform over the warps that score): the tile's row maxima across
// those warps through sRed [NTB, BM] (a token block's maxima at its index); a row moves where a score exceeds its
// reference by 8 (with SCALE_VOTE: by its token's limit, each row's flag compared as the vote compares, through
// sRed's next NTB·BM floats), to the row's largest score. Every such warp moves every row's reference; without WS it rescales its output
// accumulators, with WS it leaves each row's factor (1 where the row stays) in alpha for the output warps. The own
// rows' sums are rescaled by the warps that own them
__device__ __forceinline__ void move_reference(const float (&sc)[TPW][NB_OWN][4], const float (&lim)[TPW][2],
                                               float (&ref)[4], float (&mref)[RI], float (&l_run)[RI],
                                               float (&zacc)[CG][RI], float (&oacc)[OMB][2][4], float (&alpha_out)[4],
                                               float* sRed, int tp, int nb0, int g, int t) {
  static_assert(!SCALE_VOTE || CG >= 1, "sRed holds the rows' maxima and their flags");
#pragma unroll
  for (int i = 0; i < TPW; ++i)
#pragma unroll
    for (int ri = 0; ri < RI; ++ri) {
      const int nb = ri >> 1, e = ri & 1;
      float mx = fmaxf(sc[i][nb][e], sc[i][nb][e + 2]);
      float mv = sc[i][nb][e] > mref[ri] + lim[i][0] || sc[i][nb][e + 2] > mref[ri] + lim[i][1] ? 1.0f : 0.0f;
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        if constexpr (SCALE_VOTE) mv = fmaxf(mv, __shfl_xor_sync(0xffffffffu, mv, o));
      }
      if (g == 0) {
        sRed[(TPW * tp + i) * BM + 8 * (nb0 + nb) + 2 * t + e] = mx;
        if constexpr (SCALE_VOTE) sRed[(NTB + TPW * tp + i) * BM + 8 * (nb0 + nb) + 2 * t + e] = mv;
      }
    }
  if constexpr (WS) bar_sync(BAR_MOVE, NTR);
  else __syncthreads();
#pragma unroll
  for (int ri = 0; ri < 4; ++ri) {
    const int row = 8 * (ri >> 1) + 2 * t + (ri & 1);
    float tm = sRed[row], tv = SCALE_VOTE ? sRed[NTB * BM + row] : 0.0f;
#pragma unroll
    for (int w = 1; w < NTB; ++w) {
      tm = fmaxf(tm, sRed[w * BM + row]);
      if constexpr (SCALE_VOTE) tv = fmaxf(tv, sRed[(NTB + w) * BM + row]);
    }
    alpha_out[ri] = 1.0f;
    if (SCALE_VOTE ? tv > 0.0f : tm > ref[ri] + 8.0f) {
      const float alpha = ref[ri] == -INFINITY ? 0.0f : fast_exp2(ref[ri] - tm);
      alpha_out[ri] = alpha;
      ref[ri] = tm;
      if (KS == 1 || (ri >> 1) == nb0) {  // an own row: its sums
        const int own = KS == 1 ? ri : (ri & 1);
        l_run[own] *= alpha;
#pragma unroll
        for (int grp = 0; grp < CG; ++grp) zacc[grp][own] *= alpha;
      }
      if constexpr (!WS) rescale_rows(oacc, ri, alpha);
    }
  }
  own_reference(ref, mref, nb0);
}
