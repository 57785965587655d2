// The pieces of the tokens-as-M tile loop at 64 query rows (the lab's timing model, tokens_m_64.cu): the warpgroup
// MMA with its A operand in registers, codes dequantized into that operand, and a row's maximum or sum over a tile's
// 64 tokens. Included after ptx.cuh and wgmma.cuh, with fp16 operands.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

// d[32] (+)= A·B over k16: m64n64k16, A (fp16) in registers (the m16n8k16 A layout, a warp's 16 rows), B (fp16)
// through a descriptor, K-major (TB 0) or N-major (TB 1); fp32 accumulators: thread t of the warpgroup holds rows
// 16·(t / 32) + (t % 32) / 4 (+ 8), columns 8j + 2·(t % 4) (+ 1) at d[4j ..]; scale_d = 0 overwrites d
template <int TB>
__device__ __forceinline__ void wgmma_m64n64_ra(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}

// two 4-bit codes (nibble pl of bytes 0 and 2 of x) dequantized: (1024 + code) exact in fp16, less 1024, times the
// pair's scales plus their zeros (half2 each) in one fused multiply-add, rounded once
__device__ __forceinline__ uint32_t deq_pair(uint32_t x, int pl, uint32_t s2, uint32_t z2) {
  const uint32_t m = ((x >> (4 * pl)) & 0x000F000Fu) | 0x64006400u;
  const __half2 c = __hsub2(*reinterpret_cast<const __half2*>(&m), __half2(__half(1024.0f), __half(1024.0f)));
  const __half2 v = __hfma2(c, *reinterpret_cast<const __half2*>(&s2), *reinterpret_cast<const __half2*>(&z2));
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float2 h2f(uint32_t u) { return __half22float2(*reinterpret_cast<const __half2*>(&u)); }
__device__ __forceinline__ uint32_t f2h(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// v[i] (the thread's row 8(i / 2) + 2t + i % 2 of the 64, i < 16) combined over a tile's 64 tokens: over the 8 lanes
// g of its warp, then over the warpgroup's 4 warps w through red[4 warps][64 rows] (named barrier BAR of its 128
// threads, twice: red is free after)
template <bool MAX, int BAR>
__device__ __forceinline__ void over_tokens(float (&v)[16], float* red, int w, int g, int t) {
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      const float x = __shfl_xor_sync(0xffffffffu, v[i], o);
      v[i] = MAX ? fmaxf(v[i], x) : v[i] + x;
    }
  if (g == 0) {
#pragma unroll
    for (int i = 0; i < 16; ++i) red[w * 64 + 8 * (i >> 1) + 2 * t + (i & 1)] = v[i];
  }
  bar_sync(BAR, 128);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float* r = red + 8 * (i >> 1) + 2 * t + (i & 1);
    v[i] = MAX ? fmaxf(fmaxf(r[0], r[64]), fmaxf(r[128], r[192])) : (r[0] + r[64]) + (r[128] + r[192]);
  }
  bar_sync(BAR, 128);
}

// acc (the output warpgroup's 4 m-blocks of m64n64 accumulators, query rows as N) times each query row's factor:
// register i of an m-block holds row 8(i / 4) + 2t + i % 2 of the 64 (alpha: [64] fp32, shared memory)
__device__ __forceinline__ void scale_rows(float (&acc)[4][32], const float* alpha, int t) {
#pragma unroll
  for (int mb = 0; mb < 4; ++mb)
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[mb][i] *= alpha[8 * (i >> 2) + 2 * t + (i & 1)];
}

// the latent (0-511) or RoPE (512-575) channel of column k (0-15) of the scores' k-step K (0-35), as the A operands
// take a token's codes (deq_pair): content k-step K is plane K % 2 of word (K / 2) % 4 of 16-byte load K / 8 (of the
// thread's t), k 2t, 2t + 1 its bytes 0 and 2, k 2t + 8, 2t + 9 its bytes 1 and 3; byte c's plane p is channel
// c + 256p (RoPE: 8 bytes a thread, channel 512 + c + 32p)
__host__ __device__ constexpr int query_channel(int K, int k) {
  const int t = (k & 7) >> 1, e = k & 1, odd = k >> 3;
  return K < 32 ? 16 * (4 * (K >> 3) + t) + 4 * ((K >> 1) & 3) + odd + 2 * e + 256 * (K & 1)
                : 512 + 8 * t + 4 * ((K - 32) >> 1) + odd + 2 * e + 32 * (K & 1);
}

// query_channel's inverse: the position 16K + k of channel c (0-575) in a row of the query block
__host__ __device__ constexpr int query_position(int c) {
  const int q = c & 3, k_off = (q & 1) * 8 + (q >> 1);  // bytes 0, 2, 1, 3 of a word: k 2t, 2t + 1, 2t + 8, 2t + 9
  if (c < 512) {
    const int b = c & 255;
    return 16 * (8 * (b >> 6) + 2 * ((b >> 2) & 3) + (c >> 8)) + 2 * ((b >> 4) & 3) + k_off;
  }
  const int b = (c - 512) & 31;
  return 16 * (32 + 2 * ((b >> 2) & 1) + ((c - 512) >> 5)) + 2 * (b >> 3) + k_off;
}

// ---------------------------------------------------------------------------------------------------
// A tile of 64 tokens in a raw stage: its four page sections as the cache stores them (INT4/INT4, groups 128/64, fp16
// metadata: a group's (scale, zero) in 4 bytes), bytes
// ---------------------------------------------------------------------------------------------------
constexpr int FB_CC = 256, FB_RC = 32, FB_CM = 16, FB_RM = 4;  // a token's codes, RoPE codes, their metadata
constexpr int RAW_CC = 0, RAW_RC = 64 * FB_CC, RAW_CM = RAW_RC + 64 * FB_RC, RAW_RM = RAW_CM + 64 * FB_CM;
constexpr int RAW_BYTES = RAW_RM + 64 * FB_RM;  // 19712
constexpr int CHUNK = 8192;                     // an operand chunk: 64 rows x 128 bytes in the 128-byte swizzle

// the descriptor of the scores' k-step k (0-35) in the query block dq (nine K-major chunks of 4 k-steps)
__device__ __forceinline__ uint64_t query_kstep(uint64_t dq, int k) { return dq + (((k >> 2) * CHUNK + (k & 3) * 32) >> 4); }

// the scores' A words of the thread's tokens r_lo (xl) and r_lo + 8 (xh): content load m (0-3) of 16 bytes (its t's
// part of each 64-byte block), or the 8 RoPE bytes
__device__ __forceinline__ void content_words(const uint8_t* st, int r_lo, int t, int m, uint32_t (&xl)[4],
                                              uint32_t (&xh)[4]) {
  const uint4 vl = *reinterpret_cast<const uint4*>(st + r_lo * FB_CC + 16 * (4 * m + t));
  const uint4 vh = *reinterpret_cast<const uint4*>(st + (r_lo + 8) * FB_CC + 16 * (4 * m + t));
  xl[0] = vl.x, xl[1] = vl.y, xl[2] = vl.z, xl[3] = vl.w, xh[0] = vh.x, xh[1] = vh.y, xh[2] = vh.z, xh[3] = vh.w;
}
__device__ __forceinline__ void rope_words(const uint8_t* st, int r_lo, int t, uint32_t (&xl)[2], uint32_t (&xh)[2]) {
  const uint2 vl = *reinterpret_cast<const uint2*>(st + RAW_RC + r_lo * FB_RC + 8 * t);
  const uint2 vh = *reinterpret_cast<const uint2*>(st + RAW_RC + (r_lo + 8) * FB_RC + 8 * t);
  xl[0] = vl.x, xl[1] = vl.y, xh[0] = vh.x, xh[1] = vh.y;
}

// the output's A words of k-step kk: the 4 code bytes at col of tokens r0 = 16kk + 2t, r0 + 8, r0 + 1, r0 + 9 (x .. w)
__device__ __forceinline__ uint4 code_words(const uint8_t* st, int kk, int col, int t) {
  const int r0 = 16 * kk + 2 * t;
  return make_uint4(*reinterpret_cast<const uint32_t*>(st + r0 * FB_CC + col),
                    *reinterpret_cast<const uint32_t*>(st + (r0 + 8) * FB_CC + col),
                    *reinterpret_cast<const uint32_t*>(st + (r0 + 1) * FB_CC + col),
                    *reinterpret_cast<const uint32_t*>(st + (r0 + 9) * FB_CC + col));
}

// the scores Sᵀ[64 tokens, 64 rows] of the tile in raw stage st into sc (overwritten), all products done on return:
// 36 products whose A operands are the dequantized codes of the thread's tokens r_lo and r_lo + 8 (a warp's 16 rows;
// its t picks 16 bytes of each 64-byte block and 8 RoPE bytes), B the query block (dq: nine K-major chunks in
// query_channel's order). WORDS words of a token per commit group, IN_FLIGHT groups left in flight at each wait.
template <int WORDS, int IN_FLIGHT>
__device__ __forceinline__ void scores_dqa(float (&sc)[32], const uint8_t* st, uint64_t dq, int r_lo, int t) {
  uint32_t s2[2][5], z2[2][5];  // (scale, scale) and (zero, zero) of the two tokens: 4 content groups, RoPE
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int G = 0; G < 5; ++G) {
      const uint32_t sz = G < 4 ? *reinterpret_cast<const uint32_t*>(st + RAW_CM + (r_lo + 8 * h) * FB_CM + 4 * G)
                                : *reinterpret_cast<const uint32_t*>(st + RAW_RM + (r_lo + 8 * h) * FB_RM);
      s2[h][G] = __byte_perm(sz, sz, 0x1010), z2[h][G] = __byte_perm(sz, sz, 0x3232);
    }
#pragma unroll
  for (int m = 0; m < 4; ++m) {  // content: 16-byte load m of each token, 4 words, 2 planes a word
    uint32_t xl[4], xh[4];
    content_words(st, r_lo, t, m, xl, xh);
#pragma unroll
    for (int s0 = 0; s0 < 4; s0 += WORDS) {  // WORDS words of each token: their operands, then their products
      uint32_t a[WORDS][2][4];
#pragma unroll
      for (int s = s0; s < s0 + WORDS; ++s)
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          const int G = 2 * p + m / 2;  // plane p of bytes 64m .. 64m + 63: channels 256p + 64m ..
          a[s - s0][p][0] = deq_pair(xl[s], p, s2[0][G], z2[0][G]), a[s - s0][p][1] = deq_pair(xh[s], p, s2[1][G], z2[1][G]);
          a[s - s0][p][2] = deq_pair(xl[s] >> 8, p, s2[0][G], z2[0][G]);
          a[s - s0][p][3] = deq_pair(xh[s] >> 8, p, s2[1][G], z2[1][G]);
        }
      wgmma_fence();
#pragma unroll
      for (int s = s0; s < s0 + WORDS; ++s)
#pragma unroll
        for (int p = 0; p < 2; ++p)
          if constexpr (!SKIP_QK) wgmma_m64n64_ra<0>(sc, a[s - s0][p], query_kstep(dq, (m * 4 + s) * 2 + p), m > 0 || s > 0 || p > 0);
      wgmma_commit();
      wgmma_wait<IN_FLIGHT>();  // the groups before: done, their operand registers free
    }
  }
  uint32_t xl[2], xh[2];  // RoPE: 8 bytes, 4 k-steps
  rope_words(st, r_lo, t, xl, xh);
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    uint32_t a[2][4];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      a[p][0] = deq_pair(xl[s], p, s2[0][4], z2[0][4]), a[p][1] = deq_pair(xh[s], p, s2[1][4], z2[1][4]);
      a[p][2] = deq_pair(xl[s] >> 8, p, s2[0][4], z2[0][4]), a[p][3] = deq_pair(xh[s] >> 8, p, s2[1][4], z2[1][4]);
    }
    wgmma_fence();
#pragma unroll
    for (int p = 0; p < 2; ++p)
      if constexpr (!SKIP_QK) wgmma_m64n64_ra<0>(sc, a[p], query_kstep(dq, 32 + 2 * s + p), 1);
    wgmma_commit();
    wgmma_wait<IN_FLIGHT>();
  }
  wgmma_wait<0>();
  fence_regs(sc);
}

// P = 2^(sc - ref) of the thread's two tokens (fp16) into P buffer pb, N-major, its rows (tokens) in the order the
// output's operands pair them: k 2t, 2t + 1 of a k-step are tokens 2t and 2t + 8, k 2t + 8, 2t + 9 tokens 2t + 1 and
// 2t + 9 (NATURAL: in token order, a negative control); each row's Σ P added to lsum. A reference of -inf (a row with
// no token yet, all its scores -inf) reads as 0.
template <bool NATURAL>
__device__ __forceinline__ void write_p(const float (&sc)[32], const float (&ref)[16], float (&lsum)[16], uint8_t* pb,
                                        int w, int g, int t) {
  const int p_lo = NATURAL ? 16 * w + g : 16 * w + ((g & 1) ? g + 7 : g);
  const int p_hi = NATURAL ? 16 * w + g + 8 : 16 * w + ((g & 1) ? g + 8 : g + 1);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float m0 = ref[2 * j] == -INFINITY ? 0.0f : ref[2 * j], m1 = ref[2 * j + 1] == -INFINITY ? 0.0f : ref[2 * j + 1];
    const float p0 = fast_exp2(sc[4 * j] - m0), p1 = fast_exp2(sc[4 * j + 1] - m1);
    const float p2 = fast_exp2(sc[4 * j + 2] - m0), p3 = fast_exp2(sc[4 * j + 3] - m1);
    lsum[2 * j] += p0 + p2, lsum[2 * j + 1] += p1 + p3;
    *reinterpret_cast<uint32_t*>(pb + swz(p_lo, j) + 4 * t) = f2h(p0, p1);
    *reinterpret_cast<uint32_t*>(pb + swz(p_hi, j) + 4 * t) = f2h(p2, p3);
  }
}

// k-step kk (tokens 16kk ..) of output warpgroup o's products, issued and committed (the caller waits):
// acc[2p + z] += Cᵀ·P with A the dequantized values of byte pair z of the thread's 4 code bytes at col (128o + 32w +
// 4g: channel rows g, g + 8 of m-block 2p + z) in plane p, of tokens 16kk + 2t, + 8, + 1, + 9 (one byte permute pairs
// two tokens' bytes of a channel), group o + 2p's metadata; B P (dp, N-major)
__device__ __forceinline__ void output_dqa_kstep(float (&acc)[4][32], const uint8_t* st, uint64_t dp, int kk, int col,
                                                 int o, int t) {
  const int r0 = 16 * kk + 2 * t;  // tokens r0, r0 + 8, r0 + 1, r0 + 9
  const uint4 w4 = code_words(st, kk, col, t);
  uint32_t sp[2][2], zp[2][2];  // group o + 2p's (scale, zero) pairs of tokens (r0, r0 + 8) [0], (r0 + 1, r0 + 9) [1]
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const uint8_t* m = st + RAW_CM + r0 * FB_CM + 4 * (o + 2 * p);
    const uint32_t sa = *reinterpret_cast<const uint32_t*>(m), sb = *reinterpret_cast<const uint32_t*>(m + 8 * FB_CM);
    const uint32_t sc = *reinterpret_cast<const uint32_t*>(m + FB_CM), sd = *reinterpret_cast<const uint32_t*>(m + 9 * FB_CM);
    sp[p][0] = __byte_perm(sa, sb, 0x5410), zp[p][0] = __byte_perm(sa, sb, 0x7632);
    sp[p][1] = __byte_perm(sc, sd, 0x5410), zp[p][1] = __byte_perm(sc, sd, 0x7632);
  }
  uint32_t a[4][4];  // m-block 2p + z
#pragma unroll
  for (int z = 0; z < 2; ++z) {
    const uint32_t sel = z ? 0x7632u : 0x5410u;
    const uint32_t zab = __byte_perm(w4.x, w4.y, sel), zcd = __byte_perm(w4.z, w4.w, sel);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      a[2 * p + z][0] = deq_pair(zab, p, sp[p][0], zp[p][0]), a[2 * p + z][1] = deq_pair(zab >> 8, p, sp[p][0], zp[p][0]);
      a[2 * p + z][2] = deq_pair(zcd, p, sp[p][1], zp[p][1]), a[2 * p + z][3] = deq_pair(zcd >> 8, p, sp[p][1], zp[p][1]);
    }
  }
  wgmma_fence();
#pragma unroll
  for (int mb = 0; mb < 4; ++mb)
    if constexpr (!SKIP_PV) wgmma_m64n64_ra<1>(acc[mb], a[mb], dp + ((kk * 16 * 128) >> 4), 1);
  wgmma_commit();
}
