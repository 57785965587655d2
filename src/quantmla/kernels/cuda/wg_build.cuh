// The tile build of the heads-as-M kernel's low-bit plans (mla_decode_wg.cu with LOWBIT=1): one path's integer
// codes and per-token metadata, as one bulk copy landed them in a raw stage, into 16-bit values (T: fp16 with HALF,
// else bf16) in the 128-byte swizzled 64-channel chunks the warpgroup MMAs read. Included after the kernel's
// constants (BN, NT, CHUNK), ptx.cuh and wgmma.cuh.
#pragma once

#include "code_expand.cuh"  // group_meta, expand_pair

// Codes are planar (quant.packing): byte j of a token's NB = DIM·BITS/8 bytes holds channels j + k·NB in bits
// [k·BITS, (k + 1)·BITS), k < 8 / BITS. A step of the build takes 8 bytes of one token (bytes 8·jb .. 8·jb + 7) and
// writes one 16-byte piece (8 channels) per plane: channels 8·jb + k·NB .. + 7, one metadata group for the piece
// (the group size is a multiple of 8). A value is code·scale + zero (affine, KIND 1) or (code − 2^(BITS−1))·scale
// (symmetric, KIND 2), rounded once: with fp16 metadata into an fp16 tile, two values an HFMA2 on exact codes
// (expand_pair); else in fp32, the codes read as exact floats (2^23 + code) before the subtraction, then rounded
// to T, as where a BF16 cache stores the values themselves.
//
// Steps of consecutive threads take consecutive 8-byte pieces of one token: a quarter warp's stores of one plane
// are one swizzled 128-byte row of a chunk (no bank conflict). Tokens at or past `valid` get zeros (a page's stale
// metadata may be NaN or inf, and P·V would take NaN · 0).
// Every step's codes (and, with fp16 metadata, its groups' scale and zero point) are loaded first, then expanded
// and stored (the loads do not wait behind the stores). A thread's steps share its byte column jb = tid % NBG and
// are NT / NBG tokens apart, so its addresses are a base plus a constant a step (the swizzle, which depends on the
// token mod 8, is the same at every step where NT / NBG is a multiple of 8).
template <int KIND, int BITS, int GS, int MB, int DIM, int FB, int FBM, int CH0>
__device__ __forceinline__ void build_path_wg(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ meta,
                                              uint8_t* __restrict__ tile, int valid, int tid) {
  constexpr int NB = DIM * BITS / 8;     // code bytes a token
  constexpr int K = 8 / BITS;            // planes
  constexpr int NBG = NB / 8;            // 8-byte steps a token
  constexpr int TS = NT / NBG;           // tokens between a thread's steps
  constexpr int NS = BN / TS;            // steps a thread
  constexpr int F = KIND == 1 ? 2 : 1;   // metadata fields a group
  constexpr int MS = meta_size<MB>();
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  constexpr float BIAS = 8388608.0f + (KIND == 2 ? (float)(1 << (BITS - 1)) : 0.0f);
  constexpr bool FAST = HALF && MB == 2;  // fp16 metadata, fp16 tile: bytes (2e, 2e + 1) of a piece a pair
  static_assert(NB % 8 == 0 && GS % 8 == 0 && DIM % 64 == 0, "whole 8-channel pieces, one group each");
  static_assert(NT % NBG == 0 && BN % TS == 0, "a thread's steps: one byte column, tokens TS apart");
  const int jb = tid % NBG, t0 = tid / NBG;
  const uint8_t* cp = codes + t0 * FB + 8 * jb;
  const uint8_t* mp0 = meta + t0 * FBM;
  uint2 raw[NS];
  T2 s2[NS][K], z2[NS][K];
#pragma unroll
  for (int n = 0; n < NS; ++n) {
    const bool live = t0 + n * TS < valid;
    raw[n] = live ? *reinterpret_cast<const uint2*>(cp + n * TS * FB) : make_uint2(0, 0);
    if constexpr (FAST) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (live) group_meta<F, MS, FBM % 4 == 0>(mp0 + n * TS * FBM + ((8 * jb + k * NB) / GS) * F * MS, s2[n][k], z2[n][k]);
        else s2[n][k] = z2[n][k] = as_t2(0u);
      }
    }
  }
  uint8_t* dst[K];  // plane k's piece at step 0
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int ch = 8 * jb + k * NB;
    dst[k] = tile + (CH0 + ch / 64) * CHUNK + swz(t0, (ch % 64) / 8);
  }
#pragma unroll
  for (int n = 0; n < NS; ++n) {
    const int t = t0 + n * TS;
    const bool live = t < valid;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int ch = 8 * jb + k * NB;  // the piece's first channel in the path
      uint32_t o4[4] = {0u, 0u, 0u, 0u};
      if constexpr (FAST) {  // zero codes and metadata past `valid`: zeros
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint32_t w = e < 2 ? raw[n].x : raw[n].y;
          o4[e] = expand_pair<BITS, KIND>(__byte_perm(w, 0, (e & 1) ? 0x4342 : 0x4140), k * BITS, s2[n][k], z2[n][k]);
        }
      } else if (live) {
        const uint8_t* mp = mp0 + n * TS * FBM + (ch / GS) * F * MS;
        const float s = meta_f32<MB>(mp);
        const float z = KIND == 1 ? meta_f32<MB>(mp + MS) : 0.0f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint32_t w = e < 2 ? raw[n].x : raw[n].y;
          const int sh0 = 16 * (e & 1) + k * BITS;  // bytes 2e and 2e + 1 of the piece
          const float c0 = __uint_as_float(0x4B000000u | ((w >> sh0) & MASK)) - BIAS;
          const float c1 = __uint_as_float(0x4B000000u | ((w >> (sh0 + 8)) & MASK)) - BIAS;
#if HALF
          o4[e] = as_u32(__floats2half2_rn(fmaf(c0, s, z), fmaf(c1, s, z)));
#else
          o4[e] = as_u32(__floats2bfloat162_rn(fmaf(c0, s, z), fmaf(c1, s, z)));
#endif
        }
      }
      uint8_t* d = TS % 8 == 0 ? dst[k] + n * TS * 128 : tile + (CH0 + ch / 64) * CHUNK + swz(t, (ch % 64) / 8);
      *reinterpret_cast<uint4*>(d) = make_uint4(o4[0], o4[1], o4[2], o4[3]);
    }
  }
}
