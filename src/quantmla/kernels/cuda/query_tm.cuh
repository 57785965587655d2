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
  } else {        // RoPE: thread t reads RW words at byte 4·RW·t: kstep CKS + s·NPR + p
    const int cr = c - D_C, p = cr / FB_RC;
    j = cr % FB_RC;
    const int t = j / (4 * RW), s = (j / 4) % RW;
    kstep = CKS + s * NPR + p;
    j = t * 4 + (j & 3);
  }
  const int t = j >> 2, i = j & 3;  // bytes 0, 2 of a word -> k 2t, 2t + 1; bytes 1, 3 (shifted down) -> 2t + 8, 2t + 9
  return kstep * 16 + 2 * t + (i >> 1) + 8 * (i & 1);
}

// QK_E4M3: the byte position of content channel c's first e4m3 term in a query row (its second term lies 32 bytes
// on): k-step ks = (m·NPC + p)·2 + (s >> 1) of 32 bytes a term, k = 16·(s & 1) + 4t + i, for the codes' byte
// j = c mod FB_CC of plane p read by thread t as word s of its 16-byte chunk 4m + t (scores_words_e4m3)
__device__ __forceinline__ int q_position_e4m3(int c) {
  const int p = c / FB_CC, j = c % FB_CC;
  const int chunk = j >> 4, m = chunk >> 2, s = (j >> 2) & 3;
  const int ks = (m * NPC + p) * 2 + (s >> 1);
  return ks * 64 + 16 * (s & 1) + 4 * (chunk & 3) + (j & 3);
}

// QK_E4M3: a piece's 8 channels (times `scale`) as two e4m3 terms hi + lo (lo = e4m3(x - hi)), 4 channels a word:
// words 0, 1: hi of channels 0..3, 4..7; words 2, 3: lo of the same
__device__ __forceinline__ uint4 piece_to_e4m3_terms(const uint4& v, float scale) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t hi[2] = {0u, 0u}, lo[2] = {0u, 0u};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
    const float2 x = make_float2(f.x * scale, f.y * scale);
    const __nv_fp8x2_storage_t h = __nv_cvt_float2_to_fp8x2(x, __NV_SATFINITE, __NV_E4M3);
    const float2 hf = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(h, __NV_E4M3)));
    const __nv_fp8x2_storage_t l = __nv_cvt_float2_to_fp8x2(make_float2(x.x - hf.x, x.y - hf.y), __NV_SATFINITE, __NV_E4M3);
    hi[e >> 1] |= (uint32_t)h << (16 * (e & 1));
    lo[e >> 1] |= (uint32_t)l << (16 * (e & 1));
  }
  return make_uint4(hi[0], hi[1], lo[0], lo[1]);
}

constexpr int QCH = D / 8, QN = BM * QCH, QPT = (QN + NT - 1) / NT;  // the query's 16-byte pieces

// the query block of rows [row0, row0 + BM) from its pieces qv (load_query_pieces) into sQ (fp16, each row scaled
// by the power of two that brings its largest |q| below 2^13; with QK_E4M3 the content as two e4m3 terms in the
// first 2·D_C bytes of a row, the RoPE in fp16 as before), its per-group sums into sQsum and each row's score
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
    // the exact power of two 2^-(E - 12) that brings a row whose largest |q| is 2^E·1.m (> 2^13) below 2^13; with
    // QK_E4M3, 2^(7 - E) that brings it into [2^7, 2^8), below e4m3's largest finite 448 (rows of zeros: 1)
    const unsigned abits = sAmax[rr], ebits = abits >> 23;
    float scale;
    if constexpr (QK_E4M3) scale = ebits >= 7u ? __uint_as_float((261u - ebits) << 23) : 1.0f;
    else scale = __uint_as_float(abits) > 8192.0f ? __uint_as_float((127u - (ebits - 127u - 12u)) << 23) : 1.0f;
    if (c == 0) sQf[rr] = qk_scale_log2 / scale;
    if (QK_E4M3 && c < D_C) {  // the content's two e4m3 terms
      const uint4 tv = piece_to_e4m3_terms(qv[n], scale);
      uint8_t* dst = reinterpret_cast<uint8_t*>(sQ + rr * LDQ) + q_position_e4m3(c);
      *reinterpret_cast<uint32_t*>(dst) = tv.x;
      *reinterpret_cast<uint32_t*>(dst + 16) = tv.y;
      *reinterpret_cast<uint32_t*>(dst + 32) = tv.z;
      *reinterpret_cast<uint32_t*>(dst + 48) = tv.w;
      continue;
    }
    const uint4 hv = piece_to_half(qv[n], scale);
    const uint32_t h[4] = {hv.x, hv.y, hv.z, hv.w};
    // channels c + 4v + (0, 2) sit at positions q + (0, 1), c + 4v + (1, 3) at q + (8, 9), q = q_position(c + 4v)
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      T* dst = sQ + rr * LDQ + q_position(c + 4 * v);
      *reinterpret_cast<uint32_t*>(dst) = __byte_perm(h[2 * v], h[2 * v + 1], 0x5410);
      *reinterpret_cast<uint32_t*>(dst + 8) = __byte_perm(h[2 * v], h[2 * v + 1], 0x7632);
    }
  }
}
