// The scores of one 16-token tile on e4m3 products, the operand layout of the e4m3 scores design (docs/decode_designs.md,
// "8-bit operands through `mma.sync`": built into the decode kernel, measured slower on sm_90, removed):
// Sᵀ[token, row] = Σ_c code(token, c)·2^-9 · q(row, c), the codes read from the cache's packed planes and the
// query given as NQ e4m3 terms. One warp; the result is in the scaled units the caller undoes (2^9 for the codes,
// the query's factor a row).
//
// A operand (16 tokens x 32 channels): a code c of BITS bits is the e4m3 bit pattern of c·2^-9 (0 to 7 subnormal,
// 8 to 15 at the smallest exponent). Byte j of a token's codes holds channel j + k·NB in bits [k·BITS, (k + 1)·BITS)
// (NB = D·BITS/8), so a word of packed codes masked to plane k, (w >> k·BITS) & MASK, is four consecutive channels
// of one token, one e4m3 byte each: one shift and one AND for four codes.
// B operand (32 channels x 8 rows): four consecutive channels of one row a word, the query stored [rows, D] e4m3.
//
// Macros: BITS (2 or 4), D (channels, a multiple of 32·8/BITS), NQ (e4m3 terms of the query).
#include <stdint.h>
#include "mma8.cuh"

constexpr int NB = D * BITS / 8;                           // code bytes a token
constexpr int NP = 8 / BITS;                               // planes of a byte
constexpr uint32_t MASK = ((1u << BITS) - 1u) * 0x01010101u;
static_assert(NB % 32 == 0, "a k-step of 32 channels lies in one plane");

// codes [16, NB] uint8; q [NQ][16, D] e4m3 bytes; out [16 tokens, 16 rows] fp32
extern "C" __global__ void __launch_bounds__(32) e4m3_scores(const uint8_t* __restrict__ codes,
                                                             const uint8_t* __restrict__ q, float* __restrict__ out) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  float acc[2][4] = {};
  const uint8_t* lo = codes + g * NB;        // token g
  const uint8_t* hi = codes + (g + 8) * NB;  // token g + 8
#pragma unroll 1
  for (int k0 = 0; k0 < NB; k0 += 32) {      // 32 bytes: 32 channels of every plane
    const uint32_t w[4] = {*reinterpret_cast<const uint32_t*>(lo + k0 + 4 * t),
                           *reinterpret_cast<const uint32_t*>(hi + k0 + 4 * t),
                           *reinterpret_cast<const uint32_t*>(lo + k0 + 16 + 4 * t),
                           *reinterpret_cast<const uint32_t*>(hi + k0 + 16 + 4 * t)};
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      const uint32_t a[4] = {(w[0] >> (p * BITS)) & MASK, (w[1] >> (p * BITS)) & MASK, (w[2] >> (p * BITS)) & MASK,
                             (w[3] >> (p * BITS)) & MASK};
      const int c0 = p * NB + k0;            // the k-step's first channel
#pragma unroll
      for (int term = 0; term < NQ; ++term) {
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
          const uint8_t* qr = q + (size_t)term * 16 * D + (size_t)(8 * nb + g) * D + c0 + 4 * t;
          mma16832_e4m3(acc[nb], a, *reinterpret_cast<const uint32_t*>(qr),
                        *reinterpret_cast<const uint32_t*>(qr + 16));
        }
      }
    }
  }
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {           // c0, c1: token g, rows 8nb + 2t, + 1; c2, c3: token g + 8
    out[g * 16 + 8 * nb + 2 * t] = acc[nb][0];
    out[g * 16 + 8 * nb + 2 * t + 1] = acc[nb][1];
    out[(g + 8) * 16 + 8 * nb + 2 * t] = acc[nb][2];
    out[(g + 8) * 16 + 8 * nb + 2 * t + 1] = acc[nb][3];
  }
}
