// The RoPE metadata one tile's stage holds, for both 16-row decode kernels (mla_decode.cu, mla_decode_tm.cu): the
// tokens' own (FB_RM bytes each), or with R_PAGE the page's sets (KIVI's per-channel keys: PMB_R bytes a set at OFF_RM,
// one per R_BLK tokens, the page size unless given), of which a tile of BN tokens reads those its tokens fall in.
// Included after the kernel's constants PS, BN and FB_RM.
#pragma once

#ifndef R_PAGE
#define R_PAGE 0
#define PMB_R 0
#endif
#ifndef R_BLK
#define R_BLK PS  // tokens one RoPE metadata set of the page serves (R_PAGE)
#endif
constexpr int RM_SETS = R_BLK < BN ? BN / R_BLK : 1;  // R_PAGE: the metadata sets a tile's tokens read
static_assert(!R_PAGE || (R_BLK < BN ? BN % R_BLK == 0 : R_BLK % BN == 0), "a tile covers whole sets or lies in one");
constexpr int RM_BYTES = R_PAGE ? RM_SETS * PMB_R : BN * FB_RM;  // the RoPE metadata a tile's stage holds
constexpr int RM_PMT = RM_SETS == 1 ? 0 : R_BLK;  // R_PAGE: tokens a set of the stage serves (0: one for the tile)
// the byte offset in the page's RoPE metadata section of the tile whose first token is the page's token tok0
__host__ __device__ constexpr int rm_offset(int tok0) { return R_PAGE ? (tok0 / R_BLK) * PMB_R : tok0 * FB_RM; }
