// The tile build of the heads-as-M kernel's low-bit plans (mla_decode_wg.cu with LOWBIT=1): one path's integer
// codes and per-token metadata, as one bulk copy landed them in a raw stage, into 16-bit values (T: fp16 with HALF,
// else bf16) in the 128-byte swizzled 64-channel chunks the warpgroup MMAs read. Included after the kernel's
// constants (BN, NT, CHUNK), ptx.cuh and wgmma.cuh.
#pragma once

#include "code_expand.cuh"  // group_meta, expand_pair, e4m3_piece

#ifndef BUILD_BATCH
#define BUILD_BATCH 4  // a thread's steps whose codes and metadata are loaded before any is expanded
#endif
#ifndef SKIP_BUILD
#define SKIP_BUILD 0  // timing experiments only (the result is wrong): the tile is not built
#endif
#ifndef E4M3_EXPAND
#define E4M3_EXPAND 0  // 1: affine 2- and 4-bit codes widened two at a time as e4m3 bit patterns (c·2^-9 exactly),
#endif                 // one HFMA2 with the scale times 2^9 (wrong for scales of 2^7 or more: a timing build)

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
// NTH threads (thread ltid of them) build byte columns [JB0, JB0 + JBN) of tokens [T0, T0 + TN), planes [K0, K1)
// (the default: all of them, by all NT threads). Steps are taken BUILD_BATCH (4) at a time a thread: every step's
// codes (and, with fp16 metadata, its groups' scale and zero point) are loaded first, then expanded and stored (the
// loads do not wait behind the stores). Where NTH is a multiple of JBN a thread's steps share one byte column and
// are NTH / JBN tokens apart: its addresses are a base plus a constant a step (the swizzle, which depends on the
// token mod 8, is the same at every step where that distance is a multiple of 8).
// PM: the metadata is the page's, [G, F] over a set of its tokens (KIVI's per-channel keys), a (scale, zero) per
// channel pair (page_pair_meta); PMT > 0: the stage holds several sets, PMB bytes each, and token t reads set t / PMT.
template <int KIND, int BITS, int GS, int MB, int DIM, int FB, int FBM, int CH0, int NTH = NT, int JB0 = 0,
          int JBN = DIM * BITS / 64, int K0 = 0, int K1 = (BITS < 8 ? 8 / BITS : 1), int T0 = 0, int TN = BN,
          bool PM = false, int PMT = 0, int PMB = 0>
__device__ __forceinline__ void build_path_wg(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ meta,
                                              uint8_t* __restrict__ tile, int valid, int ltid) {
  constexpr int NB = DIM * BITS / 8;     // code bytes a token
  constexpr int STEPS = TN * JBN;        // 8-byte steps in all
  constexpr int NS = (STEPS + NTH - 1) / NTH;  // steps a thread
  constexpr bool REG = NTH % JBN == 0;   // a thread's steps: one byte column, TS tokens apart
  constexpr int TS = REG ? NTH / JBN : 1;
  constexpr int F = KIND == 1 ? 2 : 1;   // metadata fields a group
  constexpr int MS = meta_size<MB>();
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  constexpr float BIAS = 8388608.0f + (KIND == 2 ? (float)(1 << (BITS - 1)) : 0.0f);
  constexpr bool FAST = HALF && MB == 2 && KIND != 0 && KIND != 3;  // fp16 metadata and tile: a pair an HFMA2
  static_assert(NB % 8 == 0 && (KIND == 0 || PM || GS % 8 == 0) && DIM % 64 == 0,
                "whole 8-channel pieces, one group each");
  static_assert(!PM || (FAST && (GS == 1 || GS % 2 == 0)), "a page's metadata: fp16, a (scale, zero) per channel pair");
  static_assert(KIND != 0 || (BITS == 16 && !HALF), "16-bit values: bf16, copied into a bf16 tile as they are");
  // step n's token and byte column (REG: t0 + n·TS and jb0)
  const int jb0 = JB0 + ltid % JBN, t0 = T0 + ltid / JBN;
  auto tok = [&](int n) { return REG ? t0 + n * TS : T0 + (ltid + n * NTH) / JBN; };
  auto col = [&](int n) { return REG ? jb0 : JB0 + (ltid + n * NTH) % JBN; };
  if constexpr (SKIP_BUILD) return;
#pragma unroll
  for (int n0 = 0; n0 < NS; n0 += BUILD_BATCH) {
    constexpr int B = NS < BUILD_BATCH ? NS : BUILD_BATCH;
    uint2 raw[B];
    T2 s2[B][K1 - K0], z2[B][K1 - K0];
#pragma unroll
    for (int q = 0; q < B; ++q) {
      const int i = ltid + (n0 + q) * NTH, t = tok(n0 + q), jb = col(n0 + q);
      const bool live = (STEPS % NTH == 0 || i < STEPS) && n0 + q < NS && t < valid;
      raw[q] = live ? *reinterpret_cast<const uint2*>(codes + t * FB + 8 * jb) : make_uint2(0, 0);
      if constexpr (FAST && !PM) {
#pragma unroll
        for (int k = K0; k < K1; ++k) {
          if (live)
            group_meta<F, MS, FBM % 4 == 0>(meta + t * FBM + ((8 * jb + k * NB) / GS) * F * MS, s2[q][k - K0], z2[q][k - K0]);
          else s2[q][k - K0] = z2[q][k - K0] = as_t2(0u);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < B; ++q) {
      const int i = ltid + (n0 + q) * NTH, t = tok(n0 + q), jb = col(n0 + q);
      if ((STEPS % NTH != 0 && i >= STEPS) || n0 + q >= NS) break;
      const bool live = t < valid;
      if constexpr (KIND == 0) {  // bf16 values: 8 bytes (4 channels) into half a piece
        const int ch = 4 * jb;
        *reinterpret_cast<uint2*>(tile + (CH0 + ch / 64) * CHUNK + swz(t, (ch % 64) / 8) + 8 * (jb & 1)) = raw[q];
      } else
#pragma unroll
      for (int k = K0; k < K1; ++k) {
        const int ch = 8 * jb + k * NB;  // the piece's first channel in the path
        uint32_t o4[4] = {0u, 0u, 0u, 0u};
        if constexpr (PM) {  // a page's (scale, zero) per channel pair; zeros past `valid` (stale metadata)
          const uint8_t* pm = meta + (PMT ? (t / PMT) * PMB : 0);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            T2 s2p = as_t2(0u), z2p = as_t2(0u);
            if (live) page_pair_meta<GS, (KIND == 1 ? 2 : 1), MS>(pm, ch + 2 * e, s2p, z2p);
            const uint32_t w = e < 2 ? raw[q].x : raw[q].y;
            o4[e] = expand_pair<BITS, KIND>(__byte_perm(w, 0, (e & 1) ? 0x4342 : 0x4140), k * BITS, s2p, z2p);
          }
        } else if constexpr (KIND == 3) {  // e4m3 values times the group's fp32 scale (one group: GS >= 8)
          if (live) e4m3_piece(raw[q], meta_f32<MB>(meta + t * FBM + (ch / GS) * MS), o4);
#if HALF
        } else if constexpr (FAST && E4M3_EXPAND && KIND == 1 && BITS <= 4) {  // (scales below 2^7 only: unguarded)
          const T2 s9 = __hmul2(s2[q][k - K0], __float2half2_rn(512.0f));
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // a word's four bytes of plane k: two pairs of channels
            const uint32_t x = ((h ? raw[q].y : raw[q].x) >> (k * BITS)) & (MASK * 0x01010101u);
            uint32_t v[2];  // its low and high 16 bits, each two e4m3 values widened to fp16
            asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.rn.f16x2.e4m3x2 %0, lo;\ncvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
                : "=r"(v[0]), "=r"(v[1]) : "r"(x));
#pragma unroll
            for (int e = 0; e < 2; ++e) o4[2 * h + e] = as_u32(__hfma2(as_t2(v[e]), s9, z2[q][k - K0]));
          }
#endif
        } else if constexpr (FAST) {  // zero codes and metadata past `valid`: zeros
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const uint32_t w = e < 2 ? raw[q].x : raw[q].y;
            o4[e] = expand_pair<BITS, KIND>(__byte_perm(w, 0, (e & 1) ? 0x4342 : 0x4140), k * BITS, s2[q][k - K0],
                                            z2[q][k - K0]);
          }
        } else if (live) {
          const uint8_t* mp = meta + t * FBM + (ch / GS) * F * MS;
          const float s = meta_f32<MB>(mp);
          const float z = KIND == 1 ? meta_f32<MB>(mp + MS) : 0.0f;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const uint32_t w = e < 2 ? raw[q].x : raw[q].y;
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
        // REG with TS a multiple of 8: the step-0 swizzle (the compiler keeps one base a plane)
        const int ts = REG && TS % 8 == 0 ? t0 : t;
        uint8_t* d = tile + (CH0 + ch / 64) * CHUNK + swz(ts, (ch % 64) / 8) + (t - ts) * 128;
        *reinterpret_cast<uint4*>(d) = make_uint4(o4[0], o4[1], o4[2], o4[3]);
      }
    }
  }
}
