#!/usr/bin/env bash
# Decode kernel designs and profiles: builds that are not the default, the phases and profiles of the default
# plans, and the tensor pipe's rates (docs/decode_designs.md and the kernel docs cite each file). One named step per
# argument, in order, as lab/scripts/kernels_on_h200.sh takes its steps (the correctness tests, bench-kernel and the
# API's rules are there):
#
#   QUANTMLA_COMMIT=$(git rev-parse --short HEAD) OUT=/tmp/out bash lab/scripts/kernel_designs_on_h200.sh tokens-m phases
#
# tilings         the CUDA kernel's tilings at 16 and 128 heads  -> kernels/decode_cuda_tilings{,_128h}_h200.json
# phases          the default 16-row plan without its tile build, score products or output products (times only):
#                 each phase's share of a call              -> kernels/decode_cuda_phases_h200.json
# ncu-sections    Nsight Compute's throughput, memory, scheduler and warp-state sections of one decode call, INT4/INT4
#                 and BF16 at 16 heads, 32 x 16384      -> kernels/ncu_sections_{int4,bf16}_32x16384_h200.txt
# ncu-warpgroup   the same sections for the heads-as-M kernel at 128 heads, 32 x 8192 (INT4/INT4 and BF16)
#                                                  -> kernels/ncu_sections_{int4,bf16}_128h_32x8192_h200.txt
# sass-phases     Nsight Compute's SASS page of INT4/INT4 at 32 x 16384, split into the tile loop's phases
#                                                                -> kernels/sass_phases_int4_32x16384_h200.txt
# smem-wavefronts the same call's shared-memory wavefronts per token by instruction kind
#                                                         -> kernels/shared_wavefronts_int4_32x16384_h200.txt
# tokens-m        the tokens-as-M kernel (mla_decode_tm.cu): its GPU tests, then its calls and decode kernel beside
#                 the default plan's (TM_VARIANTS="MACRO=V ...": other builds timed beside it; NO_NCU=1: no profile)
#                                        -> kernels/tokens_m_gpu_tests_h200.log, kernels/decode_tokens_m_h200.json
# tokens-m-timeline  each CTA's clocks through one call of it (the prologue's three parts, first tile, tiles,
#                 epilogue), beside the loop with a second barrier a tile, and thread 0's clocks in the tile loop's
#                 phases (copy wait, scores, vote, output, P; with and without the products), INT4/INT4 and INT2/INT4
#                 at 1 x 131072 and 32 x 16384                            -> kernels/decode_tokens_m_timeline_h200.json
# tokens-m-timeline-short  the same at the short job's contexts, 1 x 2048 and 8 x 2048 (16 units of 128 tokens a
#                 sequence)                                 -> kernels/decode_tokens_m_timeline_short_h200.json
# staged-epilogue the heads-as-M kernels' epilogue from the registers (EPI_SMEM=0) beside the default staged one at
#                 128 heads, BF16 and INT4/INT4, with fp32 partials (QUANTMLA_PARTIALS=fp32; the files of 6f4d717 and
#                 before name them auto) and with 16-bit ones (bf16), a process each; its outputs against the default's
#                                              -> kernels/decode_staged_epilogue_128h_{fp32,bf16}_h200.json
# mma-rate        the tensor pipe's rate at 4 to 16 warps per SM: mma.sync m16n8k16 and m16n8k32 (e4m3, s8) against
#                 wgmma m64n16k16 and m64n32k16 (fp16), m64n32k32 (e4m3, s8) and m64n16k32 (e4m3)
# e4m3-scores     a 16-token tile's scores from the packed codes as e4m3 A operands and the query in 1 to 3 e4m3
#                 terms: the operand layouts against fp64 products of the same terms   -> kernels/e4m3_scores_h200.json
#                                                                         -> kernels/mma_rate_h200.json
# s8-scores       the tokens-as-M kernel's scores on 8-bit warpgroup MMAs (S8_QK): its GPU tests against the oracle
#                 and fp64, then its decode kernel beside the default, with the layout checks and without output products
#                 -> kernels/tokens_m_s8_scores_gpu_tests_h200.log, kernels/decode_tokens_m_s8_scores_h200.json
# fp8-one-cta     FP8 on the tokens-as-M kernel (16 heads), whose loop is bound by its copies through two 42 KB stages
#                 at two CTAs an SM: the plan at one CTA an SM with the stages that fit there, beside the default and
#                 the built tile (FP8's plan for units under 576 tokens), at the issue's 16-head shapes (FP8_SHAPES)
#                                                        -> kernels/decode_tokens_m_fp8_one_cta_h200.json
# seesaw          the heads-as-M kernel with its warpgroups out of phase (mla_decode_seesaw.cu, BF16): the heads-as-M
#                 GPU tests of BF16 (both loops), then at 128 heads its decode kernel beside the default loop's, with
#                 and without products (SEESAW_FORMATS: e.g. bf16,int4/int4 for INT4/INT4's default beside them;
#                 SEESAW_VARIANTS: other builds)
#                          -> kernels/seesaw_gpu_tests_h200.log, kernels/decode_seesaw_128h_h200.json
# append-one-tile the append kernel before its packed layout (cfb9bb0, prepared here by
#                 lab/scripts/prepare_append_one_tile.sh; carry .ab) at 4 warps and at one warp
#                 -> kernels/append_one_tile_a_path_{4warps,1warps}_h200.json
# output-phase    the tokens-as-M kernel's output phase alone, mma.sync fp16 against 8-bit warpgroup MMAs (e4m3, u8),
#                 at 128 registers a thread and without the cap, each build checked against fp64, one-hot probes
#                 saved, and the 8-bit builds on a tile stored pre-transposed (the bound of a token-interleaved
#                 cache layout)  -> kernels/output_phase_{128_registers,two_ctas,pretransposed}_h200.json
#
# Files go under $OUT/kernels/ (default OUT=/tmp/out), named as in lab/results/.
# On a GPU other than an H200 the files a run writes are renamed when it exits (a step's failure or timeout too) to
# that GPU's tag, h100 for h200 (lab/scripts/device_names.sh); the commands recorded inside them keep the h200 paths.
set -uo pipefail
# shellcheck source=lab/scripts/gpu_steps.sh
source "$(dirname "$0")/gpu_steps.sh" "$@"

tilings() {
  timeout 200 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4,fp8,bf16 \
    --shapes 1x131072,32x16384,8x16384 --tilings 8x32,16x32,16x64 --out "$OUT/kernels/decode_cuda_tilings_h200.json" 2>&1 | tail -40
  timeout 100 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --heads 128 --formats int4/int4,bf16 \
    --shapes 32x8192 --out "$OUT/kernels/decode_cuda_tilings_128h_h200.json" 2>&1 | tail -10
}

phases() {
  timeout 200 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,bf16 \
    --shapes 1x131072,32x16384 --tilings 8x32 --phases --out "$OUT/kernels/decode_cuda_phases_h200.json" 2>&1 | tail -12
}

# Nsight Compute's sections of one decode call of INT4/INT4 and BF16: heads, batch, context, file-name suffix
ncu_pair() {
  local f path
  for f in int4/int4 bf16; do
    path="$OUT/kernels/ncu_sections_${f%%/*}_$4_h200.txt"
    timeout 150 ncu --clock-control none -k regex:mla_decode -c 1 -s 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section SchedulerStats \
      --section WarpStateStats --section InstructionStats --section Occupancy \
      python3 -m quantmla_lab.bench.kernels.decode_once "$f" "$1" "$2" "$3" 2>&1 | grep -v "^==PROF==" > "$path"
    grep -i "shared\|throughput\|issue\|duration\|pipe" "$path" | head -24
  done
}

ncu-sections() { ncu_pair 16 32 16384 32x16384; }

ncu-warpgroup() { ncu_pair 128 32 8192 128h_32x8192; }

sass-phases() {
  local rep=/tmp/quantmla_sass_prof
  QUANTMLA_CUDA_LINEINFO=1 timeout 150 ncu --clock-control none -k regex:mla_decode -c 1 -s 2 --section WarpStateStats \
    --section SourceCounters -f -o "$rep" python3 -m quantmla_lab.bench.kernels.decode_once int4/int4 16 32 16384 > /dev/null 2>&1
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.csv" 2>&1
  python3 -m quantmla_lab.bench.kernels.sass_phases "$rep.csv" --tokens 524288 | tee "$OUT/kernels/sass_phases_int4_32x16384_h200.txt"
}

smem-wavefronts() {
  local rep=/tmp/quantmla_smem_prof f="$OUT/kernels/shared_wavefronts_int4_32x16384_h200.txt"
  QUANTMLA_CUDA_LINEINFO=1 timeout 150 ncu --clock-control none -k regex:mla_decode -c 1 -s 2 --section SourceCounters \
    -f -o "$rep" python3 -m quantmla_lab.bench.kernels.decode_once int4/int4 16 32 16384 > /dev/null 2>&1
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.csv" 2>&1
  { echo "$(nvidia-smi --query-gpu=name --format=csv,noheader), $(date -u +%F), commit ${QUANTMLA_COMMIT:-?}, INT4/INT4 16 heads 32 x 16384"
    python3 -m quantmla_lab.bench.kernels.shared_wavefronts "$rep.csv" --tokens 524288; } | tee "$f"
}

tokens-m() {
  local log="$OUT/kernels/tokens_m_gpu_tests_h200.log"
  { date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$log"
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest tests/test_kernels_gpu.py -q -rfs -p no:cacheprovider -s \
    -k "tokens_m or (decode_full_shape and cuda and int4 and 16-1)" 2>&1 | grep -v "^cuda/\|^$" | tee -a "$log" | tail -25
  timeout "${BENCH_TIMEOUT:-240}" python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4 \
    --shapes ${TM_SHAPES:-1x131072,8x16384,32x16384,64x4096} --tilings 8x32 --tokens-m ${TM_VARIANTS:+--variants $TM_VARIANTS} \
    --out "$OUT/kernels/decode_tokens_m_h200.json" 2>&1 | tail -50
  [ -n "${NO_NCU:-}" ] && return
  timeout 120 ncu --clock-control none -k regex:mla_decode -c 1 -s 2 --section SpeedOfLight --section SchedulerStats \
    --section WarpStateStats --section InstructionStats --section Occupancy --section MemoryWorkloadAnalysis \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 -m quantmla_lab.bench.kernels.decode_once int4/int4 16 32 16384 --tokens-m 2>&1 | grep -v "^==PROF==" \
    > "$OUT/kernels/ncu_sections_int4_tokens_m_32x16384_h200.txt"
  grep -i "stalled\|duration\|issued warp\|eligible warps\|dram throughput" "$OUT/kernels/ncu_sections_int4_tokens_m_32x16384_h200.txt" | head -40
}

tokens-m-timeline() {
  timeout 200 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4 \
    --shapes 1x131072,32x16384 --tilings 8x32 --tokens-m --timeline --out "$OUT/kernels/decode_tokens_m_timeline_h200.json" 2>&1 | tail -12
}

tokens-m-timeline-short() {
  timeout 200 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4 \
    --shapes 1x2048,8x2048 --tilings 8x32 --tokens-m --timeline --out "$OUT/kernels/decode_tokens_m_timeline_short_h200.json" 2>&1 | tail -12
}

staged-epilogue() {
  local p
  for p in fp32 bf16; do
    QUANTMLA_PARTIALS=$p timeout 200 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --heads 128 \
      --formats bf16,int4/int4 --shapes 1x32768,32x8192,64x4096 --tilings "" --warpgroup --variants EPI_SMEM=0 \
      --out "$OUT/kernels/decode_staged_epilogue_128h_${p}_h200.json" 2>&1 | grep -v -i warn | grep "warpgroup" | tail -24
  done
}

e4m3-scores() {
  timeout 100 python3 -m quantmla_lab.bench.kernels.e4m3_scores --out "$OUT/kernels/e4m3_scores_h200.json" 2>&1 | tail -8
}

fp8-one-cta() {
  timeout 240 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats fp8 --heads 16 \
    --shapes ${FP8_SHAPES:-1x131072,8x16384,8x65536,32x16384,64x4096,128x2048} --tilings 8x32 --tokens-m --variants CTAS=1 \
    --out "$OUT/kernels/decode_tokens_m_fp8_one_cta_h200.json" 2>&1 | grep -v -i warn | grep "tokens_m\|w8_n32" | tail -40
}

seesaw() {
  timeout 200 python3 -m pytest -q -x tests/test_kernels_gpu_warpgroup.py -k "not lowbit and not int and not fp8" -s \
    -p no:cacheprovider 2>&1 | grep -v -i warn > "$OUT/kernels/seesaw_gpu_tests_h200.log"
  tail -12 "$OUT/kernels/seesaw_gpu_tests_h200.log"
  timeout 240 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --heads 128 --formats ${SEESAW_FORMATS:-bf16} \
    --shapes 1x32768,32x8192,64x4096 --tilings "" --warpgroup \
    --variants SEESAW=1 SEESAW=1,SKIP_QK=1,SKIP_PV=1 SKIP_QK=1,SKIP_PV=1 ${SEESAW_VARIANTS:-} \
    --out "$OUT/kernels/decode_seesaw_128h_h200.json" 2>&1 | grep -v -i warn | tail -30
}

s8-scores() {
  timeout 240 python3 -m pytest -q -rfs tests/test_kernels_gpu.py -k "s8 or tokens_m_error" -s 2>&1 | grep -v -i warn \
    > "$OUT/kernels/tokens_m_s8_scores_gpu_tests_h200.log"
  tail -3 "$OUT/kernels/tokens_m_s8_scores_gpu_tests_h200.log"
  timeout 300 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4 --heads 16 \
    --shapes 32x16384,1x131072,64x4096 --tilings 8x32 --tokens-m --variants S8_QK=1 S8_QK=1,S8_AORDER=1 \
    S8_QK=1,S8_DESC=1 S8_QK=1,SKIP_PV=1 SKIP_PV=1 --out "$OUT/kernels/decode_tokens_m_s8_scores_h200.json" 2>&1 | tail -20
}

mma-rate() {
  timeout 300 python3 -m quantmla_lab.bench.kernels.mma_rate --chains 2 4 8 --ctas-per-sm 1 2 4 \
    --out "$OUT/kernels/mma_rate_h200.json" 2>&1 | grep -v SASS | tail -72
}

append-one-tile() {
  if [ ! -d .ab/src/quantmla ]; then
    echo "append-one-tile: no .ab/src: run lab/scripts/prepare_append_one_tile.sh locally and carry .ab" >&2
    return 1
  fi
  local w
  for w in 4 1; do
    AB_APPEND_WARPS=$w PYTHONPATH=.ab/src:lab timeout 100 python3 -m quantmla_lab.bench.kernels.append_tilings \
      --tilings default --tokens 1 8 16 128 8192 --out "$OUT/kernels/append_one_tile_a_path_${w}warps_h200.json" 2>&1 \
      | grep -v -i warn | tail -25
  done
}

output-phase() {
  timeout 250 python3 -m quantmla_lab.bench.kernels.output_phase --builds 0:4:1 1:4:1 2:4:1 --ctas-per-sm 2 4 \
    --out "$OUT/kernels/output_phase_128_registers_h200.json" 2>&1 | tail -5
  timeout 250 python3 -m quantmla_lab.bench.kernels.output_phase --builds 0:2:1 1:2:1 2:2:1 1:2:2 2:2:2 1:2:4 2:2:4 2:2:0 \
    --ctas-per-sm 2 --probe "$OUT/kernels/output_phase_probe_h200.pt" --out "$OUT/kernels/output_phase_two_ctas_h200.json" 2>&1 | tail -9
  timeout 250 python3 -m quantmla_lab.bench.kernels.output_phase --builds 0:2:1 1:2:1:T 2:2:1:T 1:2:2:T 2:2:2:T 1:2:4:T 2:2:4:T \
    2:4:1:T --ctas-per-sm 2 --out "$OUT/kernels/output_phase_pretransposed_h200.json" 2>&1 | tail -9
}

run_steps
