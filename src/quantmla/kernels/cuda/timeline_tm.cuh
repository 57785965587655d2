// The tokens-as-M decode kernel's clocks for timing experiments (mla_decode_tm.cu): TIMELINE's marks and PHASES'
// per-phase sums, written over the unit's partial output. Included by mla_decode_tm.cu after ONE_BARRIER.
#pragma once

// TIMELINE (timing experiments only: the unit's partial output is overwritten): thread 0 of each CTA records
// %globaltimer and clock64 at NMARK marks (entry, the query pieces' loads issued, the first tiles' copies issued,
// the query block written, the first tile landed, after the tile loop, the end of every warp's epilogue), then
// the SM it ran on and its tile count, in the first 2·NMARK + 2 64-bit words of its unit's partial output
#ifndef TIMELINE
#define TIMELINE 0
#endif
// PHASES (with TIMELINE and ONE_BARRIER): thread 0 also sums clock64 over the tile loop's NPHASE phases (the copy's
// wait, the scores, the vote, the copy issue and the output products, P) into the NPHASE words after those
#ifndef PHASES
#define PHASES 0
#endif

constexpr int NMARK = 7;
__device__ __forceinline__ void mark(uint64_t (&tl)[2 * NMARK], int i) {
  if constexpr (TIMELINE) {
    uint64_t g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    tl[2 * i] = g;
    tl[2 * i + 1] = (uint64_t)clock64();
  }
}

static_assert(!PHASES || (TIMELINE && ONE_BARRIER), "the phases are timed in the one-barrier loop, with the marks");
constexpr int NPHASE = 5;
// PHASES: the clocks since the last call added to phase i (ph[NPHASE]: the clock of the last call)
__device__ __forceinline__ void phase(uint64_t (&ph)[NPHASE + 1], int i) {
  if constexpr (PHASES) {
    const uint64_t now = (uint64_t)clock64();
    ph[i] += now - ph[NPHASE];
    ph[NPHASE] = now;
  }
}

// thread 0's record to dst (64-bit words): the marks, the SM, the tile count, then the phases' clocks (ph: null
// where the loop keeps none)
__device__ __forceinline__ void write_timeline(const uint64_t (&tl)[2 * NMARK], const uint64_t* ph, uint64_t* dst,
                                               int ntiles) {
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
#pragma unroll
  for (int i = 0; i < 2 * NMARK; ++i) dst[i] = tl[i];
  dst[2 * NMARK] = smid;
  dst[2 * NMARK + 1] = (uint64_t)ntiles;
  if (PHASES && ph != nullptr) {
#pragma unroll
    for (int i = 0; i < NPHASE; ++i) dst[2 * NMARK + 2 + i] = ph[i];
  }
}
