// The tokens-as-M decode kernel's query block (mla_decode_tm.cu): the channel order in which its scores' A
// operand reads the codes, and the prologue that writes the block, its group sums and row factors in that order.
// Included by mla_decode_tm.cu after its constants, its shared-memory map, mark() and query_pieces.cuh.
#pragma once

// the position (halves) of channel c in a query row: k-step · 16 + k, as the scores' A operand reads the codes
__device__ __forceinline__ int q_position(int c) {
  int kstep, j;
  if (c < D_C) {  // plane p byte j; thread t of a row reads 16-byte chunk 4m + t, word s: kstep (m·4 + s)·NPC + p
    const int p = c / FB_CC;
    j = c % FB_CC;
    const int chunk = j >> 4, m = chunk >> 2;
    kstep = (m * 4 + ((j >> 2) & 3)) * NPC + p;
    j = (chunk & 3) * 4 + (j & 3);  // (thread, byte of the word)
  } else if (C_FP8) {  // bf16 RoPE: thread t reads 32 bytes at 32t, words 2s, 2s + 1 are k-step CKS + s
    const int cr = c - D_C, t = cr / 16, s = (cr % 16) / 4;
    return (CKS + s) * 16 + 2 * t + (cr & 1) + 8 * ((cr >> 1) & 1);
  } else {        // RoPE: thread t reads RW words at byte 4·RW·t: kstep CKS + s·NPR + p
    const int cr = c - D_C, p = cr / FB_RC;
    j = cr % FB_RC;
    const int t = j / (4 * RW), s = (j / 4) % RW;
    kstep = CKS + s * NPR + p;
    j = t * 4 + (j & 3);
  }
  const int t = j >> 2, i = j & 3;
  // planar codes: bytes 0, 2 of a word -> k 2t, 2t + 1; bytes 1, 3 (shifted down) -> 2t + 8, 2t + 9.
  // e4m3 (one channel a byte): bytes 0, 1 -> k 2t, 2t + 1; bytes 2, 3 -> 2t + 8, 2t + 9
  return C_FP8 ? kstep * 16 + 2 * t + (i & 1) + 8 * (i >> 1) : kstep * 16 + 2 * t + (i >> 1) + 8 * (i & 1);
}

constexpr int QCH = D / 8;               // a query row's 16-byte pieces (8 channels each)
constexpr int RPW = BM / NWR;            // query rows a warp writes (of the NWR warps that write them)
constexpr int CPL = D_C / 8 / 32;        // content pieces a lane reads of each of its rows: pieces lane + 32k
constexpr int RPL = D_R / 8;             // RoPE pieces of a row: lane l reads piece l % RPL of row l / RPL
static_assert(BM % NWR == 0 && CPL == 2 && RPW * RPL == 32, "4 rows a warp: content in two passes, RoPE in one");
static_assert((C_GS & (C_GS - 1)) == 0 && (C_GS <= 256 || C_GS == 512),
              "a content group lies in one pass of the warp, or is the whole content");

// the query pieces of a warp's rows RPW·warp + j: content piece lane + 32k of each row (qv[j][k]), and RoPE piece
// lane % RPL of row lane / RPL (qrv), all loaded at once; rows past R read as zero
__device__ __forceinline__ void load_query_rows(const __nv_bfloat16* __restrict__ qc, const __nv_bfloat16* __restrict__ qr,
                                                uint4 (&qv)[RPW][CPL], uint4& qrv, int b, int R, int row0, int warp, int lane) {
#pragma unroll
  for (int j = 0; j < RPW; ++j) {
    const int r = row0 + RPW * warp + j;
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
      qv[j][k] = make_uint4(0, 0, 0, 0);
      if (r < R) qv[j][k] = __ldg(reinterpret_cast<const uint4*>(qc + ((int64_t)b * R + r) * D_C + 8 * (lane + 32 * k)));
    }
  }
  const int r = row0 + RPW * warp + lane / RPL;
  qrv = make_uint4(0, 0, 0, 0);
  if (r < R) qrv = __ldg(reinterpret_cast<const uint4*>(qr + ((int64_t)b * R + r) * D_R + 8 * (lane % RPL)));
}

// the sum of a piece's 8 bf16 values
__device__ __forceinline__ float piece_sum(const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float sum = 0.0f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
    sum += f.x + f.y;
  }
  return sum;
}

// x summed over aligned segments of W lanes (every lane of a segment gets its sum)
template <int W>
__device__ __forceinline__ float segment_sum(float x) {
#pragma unroll
  for (int o = 1; o < W; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// a piece (8 channels from c, a multiple of 8) into a row of the query block at the positions pos[v] of channels
// c + 4v: planar codes: channels c + 4v + (0, 2) sit at positions q + (0, 1), c + 4v + (1, 3) at q + (8, 9);
// FP8: channels c + 4v + (0, 1) at q + (0, 1), c + 4v + (2, 3) at q + (8, 9). FP8's RoPE part is stored in bf16
// (times the same power of two: exact), for the bf16 products with the key
template <bool BF16>
__device__ __forceinline__ void store_piece(T* qrow, const int (&pos)[2], const uint4& piece, float scale) {
  const uint4 hv = piece_to_half<BF16>(piece, scale);
  const uint32_t h[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    *reinterpret_cast<uint32_t*>(qrow + pos[v]) = C_FP8 ? h[2 * v] : __byte_perm(h[2 * v], h[2 * v + 1], 0x5410);
    *reinterpret_cast<uint32_t*>(qrow + pos[v] + 8) = C_FP8 ? h[2 * v + 1] : __byte_perm(h[2 * v], h[2 * v + 1], 0x7632);
  }
}

// a warp's rows of the query block from their pieces (load_query_rows), each warp on its own: into sQ (fp16, each row
// scaled by the power of two that brings its largest |q| below 2^13, channels at q_position), the rows' per-group
// sums into sQsum (times qk_scale_log2) and each row's score factor into sQf. A row's largest |q| is one warp
// reduction, its group sums are reductions over the lanes holding the group's pieces (deterministic), and each
// lane's store positions are computed once for all its rows
__device__ __forceinline__ void write_query_rows(const uint4 (&qv)[RPW][CPL], const uint4& qrv, T* sQ, float* sQsum,
                                                 float* sQf, float qk_scale_log2, int warp, int lane) {
  constexpr int WC = C_GS / 8 < 32 ? C_GS / 8 : 32;  // lanes holding a content group's pieces in one pass
  int pos[CPL][2], rpos[2];
#pragma unroll
  for (int v = 0; v < 2; ++v) {
#pragma unroll
    for (int k = 0; k < CPL; ++k) pos[k][v] = q_position(8 * (lane + 32 * k) + 4 * v);
    rpos[v] = q_position(D_C + 8 * (lane % RPL) + 4 * v);
  }
  const uint32_t ramax = piece_amax_bits(qrv);
  float rscale = 1.0f;  // the scale of the RoPE piece's row, lane / RPL
  [[maybe_unused]] float rinv = 0.0f;  // S8_QK: 127 / the largest |q| of the RoPE piece's row
#pragma unroll
  for (int j = 0; j < RPW; ++j) {
    const int rr = RPW * warp + j;
    uint32_t m = lane / RPL == j ? ramax : 0u;
#pragma unroll
    for (int k = 0; k < CPL; ++k) m = max(m, piece_amax_bits(qv[j][k]));
    const uint32_t abits = __reduce_max_sync(0xffffffffu, m);
    // the exact power of two 2^-(E - 12) that brings a row whose largest |q| is 2^E·1.m (> 2^13) below 2^13
    const bool big = __uint_as_float(abits) > 8192.0f;
    const float scale = big ? __uint_as_float((127u - ((abits >> 23) - 127u - 12u)) << 23) : 1.0f;
    if (lane / RPL == j) rscale = scale;
    [[maybe_unused]] const float amax = __uint_as_float(abits), inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    if (S8_QK && lane / RPL == j) rinv = inv;
    const float s0 = segment_sum<WC>(piece_sum(qv[j][0])), s1 = segment_sum<WC>(piece_sum(qv[j][1]));
    if constexpr (C_GS == 512) {
      if (lane == 0) sQsum[rr] = (s0 + s1) * qk_scale_log2;
    } else if (lane % WC == 0) {
      sQsum[(lane / WC) * BM + rr] = s0 * qk_scale_log2;
      sQsum[((32 + lane) / WC) * BM + rr] = s1 * qk_scale_log2;
    }
#if S8_QK
#pragma unroll
    for (int k = 0; k < CPL; ++k) store_piece_s8(reinterpret_cast<uint8_t*>(sQ), rr, 8 * (lane + 32 * k), qv[j][k], inv);
    if (lane == 0) sQf[rr] = qk_scale_log2 * amax * (1.0f / (127.0f * 256.0f));
#else
#pragma unroll
    for (int k = 0; k < CPL; ++k) store_piece<false>(sQ + rr * LDQ, pos[k], qv[j][k], scale);
    if (lane == 0) sQf[rr] = qk_scale_log2 * (big ? __uint_as_float(((abits >> 23) - 12u) << 23) : 1.0f);
#endif
  }
  const int rr = RPW * warp + lane / RPL;
#if S8_QK
  store_piece_s8(reinterpret_cast<uint8_t*>(sQ), rr, D_C + 8 * (lane % RPL), qrv, rinv);
#else
  store_piece<bool(C_FP8)>(sQ + rr * LDQ, rpos, qrv, rscale);
#endif
  if constexpr (RG > 0) {
    constexpr int WR = R_GS / 8;  // lanes holding a RoPE group's pieces
    const float s2 = segment_sum<WR>(piece_sum(qrv));
    if (lane % WR == 0) sQsum[(CG + (lane % RPL) / WR) * BM + rr] = s2 * qk_scale_log2;
  }
}

