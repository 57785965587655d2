// B: the tile build of the CUDA decode kernel: one path's codes and metadata (a cp.async stage) into
// 16-bit values in the shared-memory tile. Included by mla_decode.cu after its tile constants (BN, NTB,
// LDK, T, T2, HALF) and ptx.cuh.
#pragma once

#include "code_expand.cuh"  // group_meta, page_pair_meta, expand_pair

// ---------------------------------------------------------------------------------------------------
// B: build one path of the tile in shared memory (columns [COL0, COL0 + DIM) of the [BN, LDK] tile)
// ---------------------------------------------------------------------------------------------------
// PM: the metadata is the page's, [G, F] (groups over a set of the page's tokens), not the token's; PMT > 0: the
// stage holds several sets, PMB bytes each, and token t reads set t / PMT (0: one set for every token). FULL: every
// token of the tile is in the sequence (no row is checked against `valid`)
template <int KIND, int BITS, int GS, int MB, int DIM, int FB, int FBM, int COL0, bool PM = false, bool FULL = false,
          int PMT = 0, int PMB = 0>
__device__ __forceinline__ void build_path(const uint8_t* codes, const uint8_t* meta, T* tile, int valid, int tid) {
  if constexpr (KIND == 0) {  // raw bf16 values (only with T = bf16)
    constexpr int CH = DIM * 2 / 16;  // 16-byte chunks per token
    for (int i = tid; i < BN * CH; i += NTB) {
      const int t = i / CH, j = i % CH;
      uint4 v = FULL || t < valid ? *reinterpret_cast<const uint4*>(codes + t * FB + 16 * j) : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(tile + t * LDK + COL0 + 8 * j) = v;
    }
  } else if constexpr (KIND == 3) {  // e4m3 values, 8 a step (one group of GS >= 8): fp32 math, then T
    constexpr int CPT = DIM / 8;  // one 16-byte store a step: a quarter warp's stores are 128 contiguous bytes
    for (int i = tid; i < BN * CPT; i += NTB) {
      const int t = i / CPT, j = i % CPT;
      uint32_t o4[4] = {0, 0, 0, 0};
      if (FULL || t < valid) {
        const uint2 raw = *reinterpret_cast<const uint2*>(codes + t * FB + 8 * j);
        e4m3_piece(raw, meta_f32<MB>(meta + t * FBM + (8 * j / GS) * meta_size<MB>()), o4);
      }
      *reinterpret_cast<uint4*>(tile + t * LDK + COL0 + 8 * j) = make_uint4(o4[0], o4[1], o4[2], o4[3]);
    }
  } else {  // integer codes, planar: byte j holds channels j + k·NB in bits [k·b, (k+1)·b)
    constexpr int NB = DIM * BITS / 8;
    constexpr int K = 8 / BITS;
    constexpr int WPT = NB / 4;  // 32-bit words per token
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    constexpr int F = KIND == 1 ? 2 : 1;  // metadata fields per group
    constexpr int MS = meta_size<MB>();
    constexpr float MID = KIND == 2 ? (float)(1 << (BITS - 1)) : 0.0f;
    // fast path: T arithmetic on exact codes when the metadata is already in T's type
    constexpr bool FAST = (HALF && MB == 2) || (!HALF && MB == 3 && BITS <= 4);
    static_assert(!PM || (FAST && NB % 8 == 0 && (GS == 1 || GS % 2 == 0)), "page metadata: the 8-byte build steps");
    if constexpr (FAST && NB % 8 == 0 && (PM || GS % 8 == 0)) {
      // 8 bytes a step: 8 channels in each of the K planes, one group per plane (a page's metadata: one
      // (scale, zero) per channel pair), one 16-byte store per plane (a quarter warp's stores are 128
      // contiguous bytes: no bank conflict); each pair of codes expands in expand_pair.
      constexpr int CPT = NB / 8;  // 8-byte steps per token
      constexpr int STEPS = BN * CPT;
#pragma unroll
      for (int n = 0; n < (STEPS + NTB - 1) / NTB; ++n) {  // unrolled: a thread's steps are known here
        const int i = tid + n * NTB;
        if (STEPS % NTB != 0 && i >= STEPS) break;
        // a thread's column piece is the same at every step where the builders cover whole tokens
        const int u = NTB % CPT == 0 ? tid / CPT + n * (NTB / CPT) : i / CPT;
        // a quarter warp's 16-byte stores (8 lanes) cover 8 / CPT tokens: CPT rows apart, so that their
        // pieces fall in distinct banks (rows are 16 bytes apart mod 128 in the padded tile)
        constexpr bool SPREAD = CPT < 8 && 8 % CPT == 0;
        constexpr int R = SPREAD ? 8 / CPT : 1;
        const int t = SPREAD ? 8 * (u / R / CPT) + (u / R) % CPT + (u % R) * CPT : u;
        const int j = NTB % CPT == 0 ? tid % CPT : i % CPT;
        if (!FULL && t >= valid) {
#pragma unroll
          for (int k = 0; k < K; ++k)
            *reinterpret_cast<uint4*>(tile + t * LDK + COL0 + 8 * j + k * NB) = make_uint4(0, 0, 0, 0);
          continue;
        }
        const uint2 raw = *reinterpret_cast<const uint2*>(codes + t * FB + 8 * j);
        const uint32_t wv[2] = {raw.x, raw.y};
        uint32_t lo[2], hi[2];  // bytes (0, 1) and (2, 3) of each word, one per 16-bit half
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          lo[e] = __byte_perm(wv[e], 0, 0x4140);
          hi[e] = __byte_perm(wv[e], 0, 0x4342);
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int ch = 8 * j + k * NB;
          const uint8_t* mp = meta + t * FBM + (ch / GS) * F * MS;
          const uint8_t* pm = meta + (PMT ? (t / PMT) * PMB : 0);  // PM: the set token t reads
          T2 s2, z2;                                       // scale and zero point, in both halves
          if constexpr (!PM) group_meta<F, MS, FBM % 4 == 0>(mp, s2, z2);  // a page's: per pair, below
          uint32_t o4[4];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if constexpr (PM) page_pair_meta<GS, F, MS>(pm, ch + 4 * e, s2, z2);
            o4[2 * e] = expand_pair<BITS, KIND>(lo[e], k * BITS, s2, z2);
            if constexpr (PM) page_pair_meta<GS, F, MS>(pm, ch + 4 * e + 2, s2, z2);
            o4[2 * e + 1] = expand_pair<BITS, KIND>(hi[e], k * BITS, s2, z2);
          }
          *reinterpret_cast<uint4*>(tile + t * LDK + COL0 + ch) = make_uint4(o4[0], o4[1], o4[2], o4[3]);
        }
      }
    } else
    for (int i = tid; i < BN * WPT; i += NTB) {
      const int t = i / WPT, w = i % WPT;
      const uint32_t word = FULL || t < valid ? *reinterpret_cast<const uint32_t*>(codes + t * FB + 4 * w) : 0u;
      const uint32_t lo = __byte_perm(word, 0, 0x4140);  // bytes 0, 1 -> the two 16-bit halves
      const uint32_t hi = __byte_perm(word, 0, 0x4342);  // bytes 2, 3
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int ch = 4 * w + k * NB;  // first of the 4 channels of this plane
        const uint8_t* mp = meta + t * FBM + (ch / GS) * F * MS;
        uint2 out = make_uint2(0, 0);
        if (FULL || t < valid) {
          if constexpr (FAST) {
#if HALF
            const uint32_t magic = 0x64006400u;  // 1024.0 in each half
            const T2 off = __float2half2_rn(1024.0f + MID);
            const T2 s2 = __half2half2(*reinterpret_cast<const __half*>(mp));
            const T2 z2 = F == 2 ? __half2half2(*reinterpret_cast<const __half*>(mp + MS)) : __float2half2_rn(0.0f);
#else
            const uint32_t magic = 0x43004300u;  // 128.0 in each bf16
            const T2 off = __float2bfloat162_rn(128.0f + MID);
            const T2 s2 = __bfloat162bfloat162(*reinterpret_cast<const __nv_bfloat16*>(mp));
            const T2 z2 = F == 2 ? __bfloat162bfloat162(*reinterpret_cast<const __nv_bfloat16*>(mp + MS))
                                 : __float2bfloat162_rn(0.0f);
#endif
            const uint32_t m2 = MASK | (MASK << 16);
            const T2 c0 = __hsub2(as_t2(((lo >> (k * BITS)) & m2) | magic), off);  // exact small integers
            const T2 c1 = __hsub2(as_t2(((hi >> (k * BITS)) & m2) | magic), off);
            out.x = as_u32(__hfma2(c0, s2, z2));
            out.y = as_u32(__hfma2(c1, s2, z2));
          } else {
            const float s = meta_f32<MB>(mp);
            const float z = F == 2 ? meta_f32<MB>(mp + MS) : 0.0f;
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] = (float)((word >> (8 * e + k * BITS)) & MASK) - MID;
#if HALF
            out.x = as_u32(__floats2half2_rn(fmaf(v[0], s, z), fmaf(v[1], s, z)));
            out.y = as_u32(__floats2half2_rn(fmaf(v[2], s, z), fmaf(v[3], s, z)));
#else
            out.x = as_u32(__floats2bfloat162_rn(fmaf(v[0], s, z), fmaf(v[1], s, z)));
            out.y = as_u32(__floats2bfloat162_rn(fmaf(v[2], s, z), fmaf(v[3], s, z)));
#endif
          }
        }
        *reinterpret_cast<uint2*>(tile + t * LDK + COL0 + ch) = out;
      }
    }
  }
}
