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

constexpr int QCH = D / 8, QN = BM * QCH, QPT = (QN + NT - 1) / NT;  // the query's 16-byte pieces

// the query block of rows [row0, row0 + BM) from its pieces qv (load_query_pieces) into sQ (fp16, each row scaled
// by the power of two that brings its largest |q| below 2^13), its per-group sums into sQsum and each row's score
// factor into sQf. The pieces' sums meet in sPart and are added in channel order (deterministic); sAmax, each
// row's largest |q| as fp32 bits, is zero on entry
__device__ __forceinline__ void load_query_tm(const uint4 (&qv)[QPT], T* sQ, float* sQsum, float* sQf, float* sPart,
                                              unsigned* sAmax, float qk_scale_log2, int tid, uint64_t (&tl)[2 * NMARK]) {
#pragma unroll
  for (int n = 0; n < QPT; ++n) {
    const int i = tid + n * NT;
    const bool ok = QN % NT == 0 || i < QN;
    const uint32_t w[4] = {qv[n].x, qv[n].y, qv[n].z, qv[n].w};
    float sum = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
      sum += f.x + f.y;
    }
    if (ok) {
      atomicMax(sAmax + i / QCH, piece_amax_bits(qv[n]));
      sPart[i] = sum;
    }
  }
  __syncthreads();  // every row's largest |q| and every piece's sum are known
  mark(tl, 2);
  for (int i = tid; i < NG * BM; i += NT) {  // one (group, row) a thread
    const int grp = i / BM, rr = i % BM;
    const int p0 = grp < CG ? grp * (C_GS / 8) : (D_C + (grp - CG) * R_GS) / 8, np = (grp < CG ? C_GS : R_GS) / 8;
    float s = 0.0f;
    for (int k = 0; k < np; ++k) s += sPart[rr * QCH + p0 + k];
    sQsum[grp * BM + rr] = s * qk_scale_log2;
  }
#pragma unroll
  for (int n = 0; n < QPT; ++n) {
    const int i = tid + n * NT, rr = i / QCH, c = 8 * (i % QCH);
    if (QN % NT != 0 && i >= QN) break;
    // the exact power of two 2^-(E - 12) that brings a row whose largest |q| is 2^E·1.m (> 2^13) below 2^13
    const unsigned abits = sAmax[rr];
    const float scale = __uint_as_float(abits) > 8192.0f ? __uint_as_float((127u - ((abits >> 23) - 127u - 12u)) << 23) : 1.0f;
    // FP8: the RoPE part in bf16 (times the same power of two: exact), for the bf16 products with the key
    const uint4 hv = C_FP8 && c >= D_C ? piece_to_half<true>(qv[n], scale) : piece_to_half(qv[n], scale);
    const uint32_t h[4] = {hv.x, hv.y, hv.z, hv.w};
    // planar codes: channels c + 4v + (0, 2) sit at positions q + (0, 1), c + 4v + (1, 3) at q + (8, 9),
    // q = q_position(c + 4v); FP8: channels c + 4v + (0, 1) at q + (0, 1), c + 4v + (2, 3) at q + (8, 9)
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      T* dst = sQ + rr * LDQ + q_position(c + 4 * v);
      *reinterpret_cast<uint32_t*>(dst) = C_FP8 ? h[2 * v] : __byte_perm(h[2 * v], h[2 * v + 1], 0x5410);
      *reinterpret_cast<uint32_t*>(dst + 8) = C_FP8 ? h[2 * v + 1] : __byte_perm(h[2 * v], h[2 * v + 1], 0x7632);
    }
    if (c == 0) sQf[rr] = qk_scale_log2 / scale;
  }
}
