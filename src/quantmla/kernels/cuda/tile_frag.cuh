// C and E without a built tile (REG): each warp reads the integer codes of a stage and expands them in
// registers straight into the B operands of mma.sync m16n8k16, value = (code - offset)·scale + zero in the
// tile's 16-bit type (expand_pair: the same operations, so the same values, as the built tile). Included by
// mla_decode.cu after its tile constants and ptx.cuh, for the 16-row plan (8 warps, 32-token tiles, four
// channel shares) with fp16 metadata on both paths.
//
// Planar codes: byte j of a token's section holds channels j + k·NB for the K = 8 / bits planes k. One
// 32-bit word of codes (bytes 4t .. 4t+3 of a 16-byte block) yields, per plane, the channel pairs
// (4t, 4t+1) and (4t+2, 4t+3): a B fragment of the scores' product holds exactly those for the k indices
// (2t, 2t+1) and (2t+8, 2t+9). So a score step of 16 channels is one 16-byte block of one plane, its
// channels permuted within the block; the query block is stored in the same order (frag_column), which
// the query fragments then read as they are. The output's product pairs two tokens' codes of one byte
// (one byte permute) and writes its accumulators to the channels out_channel names.
#pragma once

#if REG
constexpr int CK = 8 / C_BITS, RK = 8 / R_BITS;               // planes of the content and RoPE codes
constexpr int NBC = D_C * C_BITS / 8, NBR = D_R * R_BITS / 8;  // code bytes of a token
constexpr int CB = NBC / 16 / KSPLIT;                          // C: 16-byte content blocks of a channel share
constexpr int BPT = 8 / CK;                                    // E: code bytes of a row a thread expands
constexpr int CF = C_KIND == 1 ? 2 : 1, RF = R_KIND == 1 ? 2 : 1;  // metadata fields of a group
static_assert((HALF && C_MB == 2 && R_MB == 2 && (C_KIND == 1 || C_KIND == 2) && (R_KIND == 1 || R_KIND == 2)),
              "fragments: integer codes with fp16 metadata on both paths");
static_assert((RM == 1 && !WS && BN == 32 && KSPLIT == 4 && TPW == 2 && D_R == 64 && !R_PAGE),
              "fragments: the 16-row plan, a 64-channel RoPE path with per-token metadata");
static_assert(((C_BITS == 2 || C_BITS == 4) && (R_BITS == 2 || R_BITS == 4) && C_GS % 16 == 0 && R_GS % 16 == 0),
              "fragments: 2- or 4-bit codes, groups of whole 16-channel steps");
static_assert((CB * CK + 1 == KSTEPS && NBC == 8 * BPT * NWC && (CF == 1 || FB_CM % 4 == 0) && (RF == 1 || FB_RM % 4 == 0)),
              "fragments: a share is CB content blocks of every plane and one RoPE step; a warp's output "
              "channels are 8 bytes a lane group");

// the query block's column of physical channel c: share ks, step s, k index. A step's k index κ reads byte
// π(κ) of its 16-byte block: π(2t + e) = 4t + e, π(2t + 8 + e) = 4t + 2 + e (e < 2)
__device__ __forceinline__ int frag_column(int c) {
  const auto kappa = [](int x) { return 2 * (x >> 2) + ((x & 3) < 2 ? (x & 3) : 6 + (x & 3)); };
  if (c < D_C) {  // content: share blk / CB, step (blk % CB)·CK + plane
    const int plane = c / NBC, byte = c % NBC, blk = byte / 16;
    return (blk / CB) * KSTEPS * 16 + ((blk % CB) * CK + plane) * 16 + kappa(byte % 16);
  }
  const int cr = c - D_C, plane = cr / NBR, byte = cr % NBR, blk = byte / 16;  // RoPE: share blk·RK + plane
  return (blk * RK + plane) * KSTEPS * 16 + CB * CK * 16 + kappa(byte % 16);
}

// E: the channel of column col (0..7) of the warp's output tile j = e·CK + plane
__device__ __forceinline__ int out_channel(int warp, int j, int col) {
  return (j % CK) * NBC + warp * 8 * BPT + col * BPT + j / CK;
}

// C: this warp's scores of token tiles nj0, nj0 + 1 over its channel share ks, from the stage
__device__ __forceinline__ void scores_frag(const uint8_t* stage, const uint32_t (&qf)[KSTEPS][4],
                                            float (&sacc)[TPW][1][4], int ks, int nj0, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  const int rplane = ks % RK, rblk = ks / RK;  // the share's RoPE step
  const int rgrp = (rplane * NBR + 16 * rblk) / R_GS;
#pragma unroll
  for (int j = 0; j < TPW; ++j) {
    const int r = (nj0 + j) * 8 + g;
    const uint8_t* cc = stage + RAW_CC + r * PCC + 16 * ks * CB + 4 * t4;
    const uint8_t* cm = stage + RAW_CM + r * FB_CM;
#pragma unroll
    for (int b = 0; b < CB; ++b) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(cc + 16 * b);
      const uint32_t lo = __byte_perm(w, 0, 0x4140), hi = __byte_perm(w, 0, 0x4342);  // bytes (0, 1), (2, 3)
#pragma unroll
      for (int k = 0; k < CK; ++k) {
        T2 s2, z2;
        group_meta<CF, 2, true>(cm + ((k * NBC + 16 * (ks * CB + b)) / C_GS) * CF * 2, s2, z2);
        mma16816(sacc[j][0], qf[b * CK + k], expand_pair<C_BITS, C_KIND>(lo, k * C_BITS, s2, z2),
                 expand_pair<C_BITS, C_KIND>(hi, k * C_BITS, s2, z2));
      }
    }
    const uint32_t w = *reinterpret_cast<const uint32_t*>(stage + RAW_RC + r * PRC + 16 * rblk + 4 * t4);
    T2 s2, z2;
    group_meta<RF, 2, true>(stage + RAW_RM + r * FB_RM + rgrp * RF * 2, s2, z2);
    mma16816(sacc[j][0], qf[CB * CK], expand_pair<R_BITS, R_KIND>(__byte_perm(w, 0, 0x4140), rplane * R_BITS, s2, z2),
             expand_pair<R_BITS, R_KIND>(__byte_perm(w, 0, 0x4342), rplane * R_BITS, s2, z2));
  }
}

// the (scale, zero) of one group of rows a and b, as (s_a, s_b) and (z_a, z_b); a row at or past `valid`
// (unless FULL) reads as scale 0 and zero 0, so its values are 0 whatever its page held
template <bool FULL>
__device__ __forceinline__ void row_pair_meta(const uint8_t* cm, int a, int b, int grp, int valid, T2& s2, T2& z2) {
  uint32_t xa, xb;
  if constexpr (CF == 2) {
    xa = *reinterpret_cast<const uint32_t*>(cm + a * FB_CM + grp * 4);
    xb = *reinterpret_cast<const uint32_t*>(cm + b * FB_CM + grp * 4);
  } else {
    xa = *reinterpret_cast<const uint16_t*>(cm + a * FB_CM + grp * 2);
    xb = *reinterpret_cast<const uint16_t*>(cm + b * FB_CM + grp * 2);
  }
  if (!FULL) {
    xa = a < valid ? xa : 0u;
    xb = b < valid ? xb : 0u;
  }
  s2 = as_t2(__byte_perm(xa, xb, 0x5410));
  z2 = as_t2(CF == 2 ? __byte_perm(xa, xb, 0x7632) : 0u);
}

// E: acc += P·c over this warp's output tiles (out_channel), from the stage's content codes
template <bool FULL>
__device__ __forceinline__ void output_frag(const uint8_t* stage, const T* sP, float (&acc)[RM][NT8][4], int warp,
                                            int lane, int valid) {
  const int n = lane >> 2, t4 = lane & 3;
  const int byte0 = warp * 8 * BPT + n * BPT;
  const uint8_t* cc = stage + RAW_CC + byte0;
  const uint8_t* cm = stage + RAW_CM;
#pragma unroll
  for (int k0 = 0; k0 < BN; k0 += 16) {
    uint32_t pa[4];
    ldsm_x4(pa, sP + (lane & 15) * LDP + k0 + (lane >> 4) * 8);
    const int ra = k0 + 2 * t4;  // this lane's tokens: ra, ra + 1 (b0) and ra + 8, ra + 9 (b1)
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = ra + (i & 1) + 8 * (i >> 1);
      if constexpr (BPT == 4) w[i] = *reinterpret_cast<const uint32_t*>(cc + r * PCC);
      else w[i] = *reinterpret_cast<const uint16_t*>(cc + r * PCC);
    }
#pragma unroll
    for (int k = 0; k < CK; ++k) {
      const int grp = (k * NBC + byte0) / C_GS;
      T2 s01, z01, s89, z89;
      row_pair_meta<FULL>(cm, ra, ra + 1, grp, valid, s01, z01);
      row_pair_meta<FULL>(cm, ra + 8, ra + 9, grp, valid, s89, z89);
#pragma unroll
      for (int e = 0; e < BPT; ++e) {
        const uint32_t sel = e | (e << 4) | ((4 + e) << 8) | ((4 + e) << 12);  // byte e of both rows, one per half
        mma16816(acc[0][e * CK + k], pa, expand_pair<C_BITS, C_KIND>(__byte_perm(w[0], w[1], sel), k * C_BITS, s01, z01),
                 expand_pair<C_BITS, C_KIND>(__byte_perm(w[2], w[3], sel), k * C_BITS, s89, z89));
      }
    }
  }
}
#endif  // REG
