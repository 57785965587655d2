// The tokens-as-M decode kernel's query block in two s8 terms, for its scores on 8-bit warpgroup MMAs (S8_QK,
// scores_s8.cuh): q ≈ (amax/127)·(q1 + q2/256) a row, amax the row's largest |q|; rows n < 16 of the block hold q1 of
// query row n, rows 16 + n its q2, per k-step of 32 channels K-major in 8 x 16-byte core matrices without swizzle.
// Included by mla_decode_tm.cu before query_tm.cuh.
#pragma once

#ifndef S8_QK
#define S8_QK 0
#endif
static_assert(!S8_QK || (WS && TPW == 1 && !C_FP8 && !R_PAGE && (C_BITS == 4 || C_BITS == 2) && R_BITS == 4 &&
                         C_GS == 128 && R_GS == 64 && FB_RC == 32),
              "8-bit warpgroup scores: the warps apart, a block a warp, INT4/INT4 or INT2/INT4 with groups 128/64");

// 16 content k-steps (column blocks x 2 halves x planes: 4 x 2 x 2 at 4 bits, 2 x 2 x 4 at 2 bits), 2 of RoPE
constexpr int Q8_KSTEPS = 18;
constexpr int Q8_BYTES = Q8_KSTEPS * 1024;  // per k-step 32 rows (16 query rows x 2 terms) x 32 bytes
static_assert(!S8_QK || (Q8_BYTES <= BM * LDQ * 2 && SM_Q % 16 == 0), "the s8 query block takes the fp16 block's place");

// byte offset in the s8 query block of element (row n of 32, k of 32) of k-step s
__host__ __device__ constexpr int q8_at(int s, int n, int k) {
  return s * 1024 + (k >> 4) * 512 + (n >> 3) * 128 + (n & 7) * 16 + (k & 15);
}

// the k-step and k of channel c (a multiple of 4; c .. c + 3 sit at k .. k + 3 of the same k-step)
__device__ __forceinline__ int2 q8_position(int c) {
  if (c < D_C) {  // plane p, byte b = 64m + 16t + 8h + 4u + j: k-step (2m + h)·NPC + p, k 16u + 4t + j
    const int p = c / FB_CC, b = c % FB_CC, m = b >> 6, t = (b >> 4) & 3, h = (b >> 3) & 1, u = (b >> 2) & 1;
    return make_int2((2 * m + h) * NPC + p, 16 * u + 4 * t);
  }
  const int cr = c - D_C, p = cr / FB_RC, b = cr % FB_RC, t = b >> 3, u = (b >> 2) & 1;  // RoPE: byte 8t + 4u + j
  return make_int2(16 + p, 16 * u + 4 * t);
}

// four channels' query values (times `inv`: 127/amax) as two s8 terms, packed 4 a word: (q1 word, q2 word)
__device__ __forceinline__ uint2 q8_terms(float2 a, float2 b, float inv) {
  const float v[4] = {a.x * inv, a.y * inv, b.x * inv, b.y * inv};
  uint32_t w1 = 0, w2 = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float q1 = rintf(v[i]);
    const float q2 = fminf(fmaxf(rintf((v[i] - q1) * 256.0f), -127.0f), 127.0f);
    w1 |= ((uint32_t)(int)q1 & 0xFFu) << (8 * i);
    w2 |= ((uint32_t)(int)q2 & 0xFFu) << (8 * i);
  }
  return make_uint2(w1, w2);
}

// a piece (8 bf16 channels from c, a multiple of 8) of query row `row` into the s8 block, both terms
__device__ __forceinline__ void store_piece_s8(uint8_t* sQ8, int row, int c, const uint4& piece, float inv) {
  const uint32_t w[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[2 * v]));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[2 * v + 1]));
    const uint2 q = q8_terms(a, b, inv);
    const int2 sk = q8_position(c + 4 * v);
    *reinterpret_cast<uint32_t*>(sQ8 + q8_at(sk.x, row, sk.y)) = q.x;
    *reinterpret_cast<uint32_t*>(sQ8 + q8_at(sk.x, 16 + row, sk.y)) = q.y;
  }
}

