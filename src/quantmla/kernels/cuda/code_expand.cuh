// Integer codes and e4m3 values into 16-bit values (T: bf16, or fp16 with HALF), shared by the built-tile kernel's
// tile build (tile_build.cuh) and the heads-as-M kernel's (wg_build.cuh). Included after ptx.cuh, cuda_fp8.h and the
// kernel's T, T2 and HALF.
#pragma once

// one group's scale (and zero point) at mp, in both halves of T2. ADJ: (scale, zero) adjacent and 4-byte
// aligned, one 32-bit load whose halves reach the HFMA2 as operand selectors (no PRMT)
template <int F, int MS, bool ADJ>
__device__ __forceinline__ void group_meta(const uint8_t* mp, T2& s2, T2& z2) {
  if constexpr (F == 2 && ADJ) {
    const T2 sz = as_t2(*reinterpret_cast<const uint32_t*>(mp));
#if HALF
    s2 = __low2half2(sz), z2 = __high2half2(sz);
#else
    s2 = __low2bfloat162(sz), z2 = __high2bfloat162(sz);
#endif
  } else {
    s2 = as_t2(*reinterpret_cast<const uint16_t*>(mp) * 0x10001u);
    z2 = as_t2(F == 2 ? *reinterpret_cast<const uint16_t*>(mp + MS) * 0x10001u : 0u);
  }
}

// the (scale, zero) of the channel pair (c0, c0 + 1) from a page's metadata [G, F] (groups of GS channels
// over the page's tokens), in T's two halves: one group for both channels when GS >= 2, one each when GS = 1
template <int GS, int F, int MS>
__device__ __forceinline__ void page_pair_meta(const uint8_t* meta, int c0, T2& s2, T2& z2) {
  if constexpr (GS == 1) {  // channel c0's fields, then c0 + 1's: (s0[, z0], s1[, z1])
    if constexpr (F == 2) {
      const uint2 w = *reinterpret_cast<const uint2*>(meta + c0 * 2 * MS);
      s2 = as_t2(__byte_perm(w.x, w.y, 0x5410));
      z2 = as_t2(__byte_perm(w.x, w.y, 0x7632));
    } else {
      s2 = as_t2(*reinterpret_cast<const uint32_t*>(meta + c0 * MS));
      z2 = as_t2(0u);
    }
  } else {
    group_meta<F, MS, true>(meta + (c0 / GS) * F * MS, s2, z2);
  }
}

// one pair of integer codes at bit offset o of each 16-bit half of x (other bits masked off), as the exact
// values (code - offset)·s2 + z2 in T (offset: 0 affine, 2^(b-1) symmetric). A code at bit offset o reads
// as an exact float by OR-ing the exponent that makes bit o weigh 1: fp16 2^(10-o) (no shift needed),
// bf16 2^7 for o = 0 (the codes are shifted down first)
template <int BITS, int KIND>
__device__ __forceinline__ uint32_t expand_pair(uint32_t x, int o, T2 s2, T2 z2) {
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  constexpr uint32_t MIDI = KIND == 2 ? 1u << (BITS - 1) : 0u;
#if HALF
  const uint32_t magic = (uint32_t)((25 - o) << 10) * 0x10001u;  // 2^(10-o) in each half
  const T2 off = as_t2((((uint32_t)(25 - o) << 10) | (MIDI << o)) * 0x10001u);  // 2^(10-o) + MID, exact
  const uint32_t v = and_or(x, (MASK << o) * 0x10001u, magic);
#else
  const T2 off = as_t2((0x4300u | MIDI) * 0x10001u);  // 128 + MID in each bf16, exact
  const uint32_t v = and_or(x >> o, MASK * 0x10001u, 0x43004300u);  // 128.0 in each bf16
#endif
  return as_u32(__hfma2(__hsub2(as_t2(v), off), s2, z2));
}

// 8 e4m3 values (raw: bytes 0 .. 7) times the group's scale sc, as four words of two T values each: widened to fp16
// exactly, multiplied in fp32, rounded once
__device__ __forceinline__ void e4m3_piece(uint2 raw, float sc, uint32_t (&o4)[4]) {
  const uint32_t wv[2] = {raw.x, raw.y};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(wv[e / 2] >> (16 * (e % 2))), __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<__half2*>(&h));
#if HALF
    o4[e] = as_u32(__floats2half2_rn(f.x * sc, f.y * sc));
#else
    o4[e] = as_u32(__floats2bfloat162_rn(f.x * sc, f.y * sc));
#endif
  }
}
