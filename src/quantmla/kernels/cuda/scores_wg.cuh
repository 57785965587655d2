// The tokens-as-M decode kernel's scores on warpgroup MMAs (mla_decode_tm.cu with WG_QK): the 4 scores' warps issue
// each product together as one m64n16k16 wgmma, tokens (64, a warp's 16 each) as M and the 16 query rows as N. The A
// operand is the warp's codes masked in place, exactly as tile_scores builds it for mma.sync; the B operand is the
// query block, read by the tensor cores from shared memory (q_at's layout, k-step s at 512·s bytes). The products
// run asynchronously: each batch of k-steps that one group's scale folds (a content group, then the RoPE key) is
// committed on its own accumulators, and the previous batch is folded while it runs. The same sums as tile_scores
// over the same channels, in the tensor cores' order. Included by mla_decode_tm.cu after scores_tm.cuh.
#pragma once

#ifndef WG_QK_DEPTH
#define WG_QK_DEPTH 1  // words whose products may still run when the next word's are issued; 0: a batch is one
                       // commit group, waited for before its fold
#endif
static_assert(WG_QK_DEPTH >= 0 && WG_QK_DEPTH <= 4, "words in flight behind the newest (0: a batch a commit group)");
static_assert(!WG_QK || (WS && TPW == 1 && !C_FP8), "the scores' warpgroup MMAs: the warps apart, a block a warp, codes");

// one word of the warp's tokens tok_lo (xl) and tok_lo + 8 (xh): its NP planes' A operands issued as k-steps
// kstep0 + p of the query block (descriptor dq) into acc[p]; `first` overwrites the accumulators
template <int BITS, int NP>
__device__ __forceinline__ void scores_word_wg(float (&acc)[NP][2][4], uint32_t xl, uint32_t xh, uint64_t dq,
                                               int kstep0, bool first) {
  uint32_t a[NP][4];
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    a[p][0] = plane<BITS>(xl, p), a[p][1] = plane<BITS>(xh, p);
    a[p][2] = plane<BITS>(xl >> 8, p), a[p][3] = plane<BITS>(xh >> 8, p);
  }
  wgmma_fence_after(a);
#pragma unroll
  for (int p = 0; p < NP; ++p) wgmma_m64n16_rs(acc[p], a[p], dq + (uint64_t)(32 * (kstep0 + p)), first ? 0 : 1);
}

// the scores of one tile (stage st) for the warp's 16 tokens (tok_lo, tok_lo + 8) and every row, as tile_scores<0>
// gives them with TPW = 1 (sc[0][nb][e]: row 8nb + 2t + (e & 1), token tok_lo + 8·(e >> 1)). Each word's products are
// a commit group of their own and at most WG_QK_DEPTH + 1 are in flight (a word's A operands live until its products
// are done): after word w is issued, word w - WG_QK_DEPTH is done, and once that was a batch's last word the batch is
// folded while the next words run
__device__ __forceinline__ void tile_scores_wg(const uint8_t* st, uint64_t dq, int tok_lo, int t, float (&sc)[1][2][4]) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[0][nb][e] = 0.0f;
  constexpr int CM = FB_CC / 64;                        // 64-byte column blocks of the content codes
  constexpr int MPG = C_GS / 64 < CM ? C_GS / 64 : CM;  // blocks a batch: one group of each plane
  constexpr int NBAT = CM / MPG;
  const uint8_t* ml = st + RAW_CM + tok_lo * FB_CM;
  float acc[2][NPC][2][4], racc[NPR][2][4];
  // content batch bt's products folded with its groups' scales (once they are done)
  auto fold = [&](auto& a, int bt) {
    fence_regs(a);
#pragma unroll
    for (int p = 0; p < NPC; ++p) {
      const int grp = (p * FB_CC + 64 * MPG * bt) / C_GS;
      const float f = code_weight<C_BITS>(p);
      fold_scale(sc[0], a[p], meta_sz(ml, grp).x * f, meta_sz(ml + 8 * FB_CM, grp).x * f);
    }
    fence_regs(a);  // (read before the products of batch bt + 2 overwrite them)
  };
#pragma unroll
  for (int bt = 0; bt < NBAT; ++bt) {
#pragma unroll
    for (int mm = 0; mm < MPG; ++mm) {
      const int m = bt * MPG + mm, col = 16 * (4 * m + t);
      const uint4 vl = *reinterpret_cast<const uint4*>(cc_at(st, tok_lo, col));
      const uint4 vh = *reinterpret_cast<const uint4*>(cc_at(st, tok_lo + 8, col));
      const uint32_t xl[4] = {vl.x, vl.y, vl.z, vl.w}, xh[4] = {vh.x, vh.y, vh.z, vh.w};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        if (!SKIP_QK) scores_word_wg<C_BITS, NPC>(acc[bt & 1], xl[s], xh[s], dq, (m * 4 + s) * NPC, mm == 0 && s == 0);
        if constexpr (WG_QK_DEPTH > 0) {
          wgmma_commit();
          wgmma_wait<WG_QK_DEPTH>();
          if (bt > 0 && mm * 4 + s == WG_QK_DEPTH - 1) fold(acc[(bt - 1) & 1], bt - 1);
        }
      }
    }
    if constexpr (WG_QK_DEPTH == 0) {  // one commit group a batch, folded once it is done
      wgmma_commit();
      wgmma_wait<0>();
      fold(acc[bt & 1], bt);
    }
  }
  // the RoPE key: RW words a thread at byte 4·RW·t of each row
  const uint8_t* rl = st + RAW_RC + tok_lo * FB_RC + 4 * RW * t;
  uint32_t xl[RW], xh[RW];
#pragma unroll
  for (int s = 0; s < RW; ++s) {
    xl[s] = reinterpret_cast<const uint32_t*>(rl)[s];
    xh[s] = reinterpret_cast<const uint32_t*>(rl + 8 * FB_RC)[s];
  }
#pragma unroll
  for (int s = 0; s < RW; ++s) {
    if (!SKIP_QK) scores_word_wg<R_BITS, NPR>(racc, xl[s], xh[s], dq, CKS + s * NPR, s == 0);
    if constexpr (WG_QK_DEPTH > 0) {
      wgmma_commit();
      wgmma_wait<WG_QK_DEPTH>();
      if (s == WG_QK_DEPTH - 1) fold(acc[(NBAT - 1) & 1], NBAT - 1);
    }
  }
  if constexpr (WG_QK_DEPTH == 0) wgmma_commit();
  wgmma_wait<0>();
  if constexpr (WG_QK_DEPTH > RW) fold(acc[(NBAT - 1) & 1], NBAT - 1);
  fence_regs(racc);
  const uint8_t* rml = st + RAW_RM + tok_lo * FB_RM;
#pragma unroll
  for (int p = 0; p < NPR; ++p) {
    const int grp = p * FB_RC / R_GS;
    const float f = code_weight<R_BITS>(p);
    fold_scale(sc[0], racc[p], meta_sz(rml, grp).x * f, meta_sz(rml + 8 * FB_RM, grp).x * f);
  }
}
