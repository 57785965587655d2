#!/usr/bin/env bash
# Are the decode kernels correct at full shapes, and how fast are they? One named step per argument, in order:
#
#   QUANTMLA_COMMIT=$(git rev-parse --short HEAD) OUT=/tmp/out bash lab/scripts/kernels_on_h200.sh tests bench serving-shapes
#
# tests           the kernel tests on the GPU (full shapes, CUDA host side, interpreter tests) -> kernels/gpu_tests_h200.log
# bench           `quantmla bench-kernel`: every format against BF16 at DeepSeek shapes, with the
#                 config sweep; extra arguments after `--` go to bench-kernel   -> kernels/decode_h200.json
# serving-shapes  the decode kernel at the serving job's shapes (16 heads)      -> kernels/decode_serving_shapes_h200.json
# schedule-long   one layer's decode (decode + combine) at the tight long job's decode batches (4, 7 and 13 of 20480
#                 tokens, 16 heads): FP8, INT4/INT4, INT2/INT4, every tiling at 1 and 2 CTAs an SM, each split as
#                 get_mla_metadata cuts it (an eager call's; a graph bucket deals its units by length)
#                                                                -> decode_schedule/long_decode_batches_h200.json
# tilings         the CUDA kernel's tilings at 16 and 128 heads  -> kernels/decode_cuda_tilings{,_128h}_h200.json
# phases          the default 16-row plan without its tile build, score products or output products (times only):
#                 each phase's share of a call              -> kernels/decode_cuda_phases_h200.json
# page-rope       the RoPE path per channel per page beside per-token groups (16 and 128 heads)
#                                                                -> kernels/decode_page_rope_h200.json
# breakdown       a decode call split into the decode kernel, the combine kernel and the rest; fixed cost
#                 against cost per token                        -> kernels/decode_breakdown_h200.json
# ncu-sections    Nsight Compute's throughput, memory, scheduler and warp-state sections of one decode call, INT4/INT4
#                 and BF16 at 16 heads, 32 x 16384      -> kernels/ncu_sections_{int4,bf16}_32x16384_h200.txt
# ncu-warpgroup   the same sections for the heads-as-M kernel at 128 heads, 32 x 8192 (INT4/INT4 and BF16)
#                                                  -> kernels/ncu_sections_{int4,bf16}_128h_32x8192_h200.txt
# ncu-fragments   the same for INT4/INT4's plan that reads the codes straight into the products' operands
#                                                         -> kernels/ncu_sections_int4_fragments_32x16384_h200.txt
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
# decode-in-graph  the decode call (decode and combine kernels) inside CUDA graphs of layers, between the absorbed
#                 query's and values' bmm, against the same calls back to back; a cache a layer; four formats at the
#                 short job's contexts (27 layers, with the tokens-as-M kernel's CTA spans and the gaps between
#                 layers) and at 32 x 16384 (8 layers)
#                                    -> kernels/decode_in_graph_{short,long}_h200.json
# partials        the decode call in graphs of 8 layers with fp16 split partials for integer codes (the default,
#                 partials.partial_dtype) and with fp32 partials (QUANTMLA_PARTIALS=fp32), one process each,
#                 INT4/INT4, INT2/INT4, and FP8 and BF16 (fp32 either way: the controls) at 1 x 131072, 8 x 16384,
#                 32 x 16384 and 8 x 2048; then, all with fp16 partials, the GPU tests of the splits and of
#                 partials past fp16's range        -> kernels/decode_in_graph_partials_{fp16,fp32}_h200.json,
#                                                      kernels/partials_gpu_tests_h200.log
# bf16-partials   the decode call in graphs of 8 layers with bf16 split partials for BF16 and FP8 at any row count
#                 (QUANTMLA_PARTIALS=bf16) and with fp32 ones (fp16: fp16 for integer codes, fp32 for the rest), a process each,
#                 BF16 and FP8 at the issue's 16-head shapes and BF16 at its 128-head ones; then, with the default,
#                 the GPU tests of the splits and of the error against fp64
#                            -> kernels/decode_in_graph_partials_{16h,128h}_{bf16,fp16}_h200.json,
#                               kernels/bf16_partials_gpu_tests_h200.log
# bf16-partials-repeat  the shapes where bf16 partials moved most (16 heads: 64 x 4096, 32 x 16384, BF16 and FP8;
#                 128 heads: 1 x 32768, 32 x 8192, BF16), fp16 / bf16 / bf16 / fp16 settings, a process each
#                 -> kernels/decode_in_graph_partials_repeat_{16h,128h}_{fp16,bf16}_{1..4}_h200.json
# staged-epilogue the heads-as-M kernels' epilogue from the registers (EPI_SMEM=0) beside the default staged one at
#                 128 heads, BF16 and INT4/INT4, with fp32 partials (QUANTMLA_PARTIALS=fp32; the files of 6f4d717 and
#                 before name them auto) and with 16-bit ones (bf16), a process each; its outputs against the default's
#                                              -> kernels/decode_staged_epilogue_128h_{fp32,bf16}_h200.json
# partials-128    whole calls at 128 heads (decode_in_graph, graphs of 8 layers) with fp32 partials (fp32; the files of
#                 6f4d717 name them auto) and 16-bit ones (bf16), BF16 and INT4/INT4, a process each; then the
#                 combine alone at 128 rows with bf16 partials, the API's blocks beside blocks narrowed rows first
#                                   -> kernels/decode_in_graph_partials_128h_{fp32,bf16}_staged_h200.json,
#                                      kernels/combine_blocks_128rows_bf16_h200.json
# tm-staged-epilogue the tokens-as-M kernel (16 heads) with its epilogue staged in shared memory and stored in whole
#                 16-byte pieces (TM_EPI_SMEM=1) beside the default, INT4/INT4, INT2/INT4 and FP8 at the issue's shapes,
#                 its outputs against the default's; then the tokens-as-M GPU tests with it as the source's default
#                 -> kernels/decode_tokens_m_staged_epilogue_h200.json, kernels/tokens_m_staged_epilogue_gpu_tests_h200.log
# combine         the combine kernel alone, every split in one step (the API's choice where they fit) against the
#                 two-pass loop, at the splits the jobs' decode steps make              -> kernels/combine_h200.json
# combine-blocks  the combine kernel alone at the API's program blocks and at blocks narrowed rows first (whole
#                 128-byte rows of a partial a program): 16 rows with fp16 partials, 128 rows with fp32
#                          -> kernels/combine_blocks_16rows_fp16_h200.json, kernels/combine_blocks_128rows_fp32_h200.json
# peer            `quantmla bench-kernel --no-sweep` against vLLM's Triton BF16 MLA decode (PEER: the path of its
#                 triton_decode_attention.py, never committed) at the issue's nine shapes, every format, its
#                 num_kv_splits swept over 1 to 512   -> kernels/${PEER_NAME:-decode_vs_peer}_h200.json (+ .png)
# scores-refill   the tokens-as-M kernel with the warps apart, its stages refilled by the output warps (SCORES_REFILL=0,
#                 INT4/INT4's default) and by the scores' warps after (1) or before (2, INT2/INT4's) a tile's scores:
#                 the tokens-as-M GPU tests (of the default builds), then the three builds' decode calls in one process   -> kernels/scores_refill_gpu_tests_h200.log,
#                                                          kernels/decode_tokens_m_scores_refill_h200.json
# whole-page      the tokens-as-M kernel with a stage as one bulk copy of a 64-token page (WHOLE_PAGE=1, the default but
#                 for INT2/INT4) beside a copy a section (WHOLE_PAGE=0): the tokens-as-M GPU tests (pages of 64, 128 and 256 tokens among them), the
#                 latent-range test, then both builds' decode calls, INT4/INT4, INT2/INT4 and FP8, in one process
#                     -> kernels/whole_page_gpu_tests_h200.log, kernels/decode_tokens_m_whole_page_h200.json
# stage-plans     the tokens-as-M plans' stage choices on this GPU, decode kernel alone: the 4-warp plans (the engine's
#                 for 4-bit codes' units under 384 tokens) with one copy a stage and a copy a section at short contexts, and the
#                 default plans with every stage count that fits (the tool's stage rows) at long ones, INT4/INT4 and
#                 INT2/INT4   -> kernels/decode_tokens_m_stage_plans_{short_2blocks,short_1blocks,long}_h200.json
# scale-vote      the tokens-as-M kernel's SCALE_VOTE build (P held under 65504 / its token's largest content scale): the
#                 wide-latent GPU tests, the tokens-as-M GPU tests with SCALE_VOTE=1 compiled in (the kernel's default
#                 edited on the device), then its decode calls beside the default's, INT4/INT4, INT2/INT4 and FP8
#                     -> kernels/scale_vote_gpu_tests_h200.log, kernels/decode_tokens_m_scale_vote_h200.json
# two-bit-plans   the 2-bit content rules measured on an H100, on this GPU: INT2/INT4's warps apart (3 stages) against
#                 its 4-warp plan over short units in CUDA graphs of 27 layers, and the SCALE_VOTE build's cost on
#                 3 stages          -> kernels/decode_in_graph_two_bit_short_units_h200.json,
#                                      kernels/decode_tokens_m_scale_vote_two_bit_h200.json
# warpgroup       the heads-as-M kernel (mla_decode_wg.cu at 128 heads): its GPU tests, its BF16 calls beside the
#                 API's default, and its decode kernel with cp.async copies and without products; INT4/INT4,
#                 INT2/INT4 and FP8 beside the built tile, with and without products; then the 128-head shapes of every
#                 format against vLLM's Triton decode (PEER=path/triton_decode_attention.py)
#                 -> kernels/warpgroup_gpu_tests_h200.log, kernels/decode_warpgroup_tma_128h_h200.json,
#                    kernels/decode_warpgroup_lowbit_128h_h200.json, kernels/decode_vs_peer_128h_h200.json
# append-tilings  the append kernel's tilings (warps, the two paths apart) by format at 1 to 8192 tokens, each append
#                 a node of a CUDA graph of 27                  -> kernels/append_tilings_h200.json
# mma-rate        the tensor pipe's rate at 4 to 16 warps per SM: mma.sync m16n8k16 and m16n8k32 (e4m3, s8) against
#                 wgmma m64n16k16 and m64n32k16 (fp16), m64n32k32 (e4m3, s8) and m64n16k32 (e4m3)
# e4m3-scores     a 16-token tile's scores from the packed codes as e4m3 A operands and the query in 1 to 3 e4m3
#                 terms: the operand layouts against fp64 products of the same terms   -> kernels/e4m3_scores_h200.json
#                                                                         -> kernels/mma_rate_h200.json
# s8-scores       the tokens-as-M kernel's scores on 8-bit warpgroup MMAs (S8_QK): its GPU tests against the oracle
#                 and fp64, then its decode kernel beside the default, with the layout checks and without output products
#                 -> kernels/tokens_m_s8_scores_gpu_tests_h200.log, kernels/decode_tokens_m_s8_scores_h200.json
# tokens-m64      the tokens-as-M kernel at 64 rows (mla_decode_tm64.cu): its GPU tests, then at 128 heads its calls
#                 and decode kernel beside the heads-as-M kernel's, INT4/INT4 and BF16 (TM64_VARIANTS="MACRO=V ...":
#                 other builds timed beside it)  -> kernels/tokens_m64_gpu_tests_h200.log,
#                                                   kernels/decode_tokens_m64_128h_h200.json
# fp8-one-cta     FP8 on the tokens-as-M kernel (16 heads), whose loop is bound by its copies through two 42 KB stages
#                 at two CTAs an SM: the plan at one CTA an SM with the stages that fit there, beside the default and
#                 the built tile (FP8's plan for units under 576 tokens), at the issue's 16-head shapes (FP8_SHAPES)
#                                                        -> kernels/decode_tokens_m_fp8_one_cta_h200.json
# combine-calls   whole calls in graphs of 8 layers (decode_in_graph, 16 heads) with the combine's blocks the API's and
#                 1x64, 1x32, 2x32, 4x16 (rows x channels a program) at COMBINE_SHAPES, COMBINE_METHODS
#                                                        -> kernels/decode_in_graph_combine_blocks_h200.json
# fp8-one-cta-calls  FP8 whole calls in graphs of 8 layers (decode_in_graph) with the API's choice beside
#                 the tokens-as-M kernel at two and at one CTA an SM, and the built tile, at FP8_CALL_SHAPES
#                                                        -> kernels/decode_in_graph_fp8_one_cta_h200.json
# seesaw          the heads-as-M kernel with its warpgroups out of phase (mla_decode_seesaw.cu, BF16): the heads-as-M
#                 GPU tests of BF16 (both loops), then at 128 heads its decode kernel beside the default loop's, with
#                 and without products (SEESAW_FORMATS: e.g. bf16,int4/int4 for INT4/INT4's default beside them;
#                 SEESAW_VARIANTS: other builds)
#                          -> kernels/seesaw_gpu_tests_h200.log, kernels/decode_seesaw_128h_h200.json
# short-units     the short job's decode calls (16 heads, 1 to 64 sequences of 1536 or 2048 tokens: units of about two
#                 tiles), the built tile beside the tokens-as-M kernel for INT4/INT4 and INT2/INT4: whether short units
#                 read faster on the built tile, as FP8's below FP8_TM_MIN_TOKENS do -> kernels/decode_short_units_h200.json
# append-one-tile the append kernel before its packed layout (cfb9bb0, prepared here by
#                 lab/scripts/prepare_append_one_tile.sh; carry .ab) at 4 warps and at one warp
#                 -> kernels/append_one_tile_a_path_{4warps,1warps}_h200.json
# output-phase    the tokens-as-M kernel's output phase alone, mma.sync fp16 against 8-bit warpgroup MMAs (e4m3, u8),
#                 at 128 registers a thread and without the cap, each build checked against fp64, one-hot probes
#                 saved, and the 8-bit builds on a tile stored pre-transposed (the bound of a token-interleaved
#                 cache layout)  -> kernels/output_phase_{128_registers,two_ctas,pretransposed}_h200.json
# combine-rule    whole calls in graphs of 8 layers (decode_in_graph) with the combine's blocks as the API chooses them
#                 (schedule.combine_blocks) beside fixed blocks, INT4/INT4 and BF16 (the baseline every run times): 16
#                 heads at 1 x 131072, 4, 7 and 13 x 20480, 32 x 16384; 128 heads at 1 x 32768, 8 x 8192
#                                            -> kernels/decode_in_graph_combine_rule_{16h,128h}_h200.json
# combine-128-repeats whole calls at 128 heads with few splits a sequence (4 x 16384, 8, 16 and 32 x 8192), INT4/INT4
#                 and BF16, the API's combine blocks beside 4x32, 2x32, 8x32 and 4x64, in two processes
#                                       -> kernels/decode_in_graph_combine_128h_few_splits_{1,2}_h200.json
# rules-tests     the GPU tests of the API's rules: splits, 16-bit partials, full shapes, the error against fp64,
#                 the append's metadata rounding, mistral4's query scale, the 64-row kernel
#                                                                         -> kernels/rules_gpu_tests_h200.log
#
# Files go under $OUT/kernels/ (schedule-long's under $OUT/decode_schedule/; default OUT=/tmp/out), named as in
# lab/results/.
# On a GPU other than an H200 the files a run writes are renamed when it exits (a step's failure or timeout too) to
# that GPU's tag, h100 for h200 (lab/scripts/device_names.sh); the commands recorded inside them keep the h200 paths.
set -uo pipefail
# Every result records the commit of its code: pass the local one (the device's copy of the tree may carry an older
# git history, whose HEAD would be recorded instead).
if [ -z "${QUANTMLA_COMMIT:-}" ]; then
  echo "set QUANTMLA_COMMIT to the commit of the tree you send: QUANTMLA_COMMIT=\$(git rev-parse --short HEAD), run locally" >&2
  exit 2
fi
OUT=${OUT:-/tmp/out}
# shellcheck source=lab/scripts/device_names.sh
source "$(dirname "$0")/device_names.sh"
NAME_SINCE=$(mktemp)
trap name_by_device EXIT
mkdir -p "$OUT/kernels" "$OUT/decode_schedule"
export TRITON_INTERPRET=0 PYTHONPATH=src:lab:tests PYTHONUNBUFFERED=1
EXTRA=()
STEPS=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; EXTRA=("$@"); break; fi
  STEPS+=("$1"); shift
done

tests() {
  local log="$OUT/kernels/gpu_tests_h200.log"
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  } 2>&1 | tee "$log"
  local xdist=""
  python3 -c "import xdist" 2>/dev/null && xdist="-n ${TEST_WORKERS:-8}"
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/test_kernels_gpu.py tests/test_kernels_gpu_warpgroup.py tests/test_kernels_cuda.py tests/test_decode_configs.py tests/test_kernels.py tests/test_append.py -q -rfs -p no:cacheprovider $xdist 2>&1 | tee -a "$log"
  echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$log"
}

bench() {
  timeout "${BENCH_TIMEOUT:-330}" python3 -m quantmla.cli bench-kernel --out "$OUT/kernels/decode_h200.json" "${EXTRA[@]}" 2>&1 \
    | tee "$OUT/kernels/bench_h200.log"
}

serving-shapes() {
  timeout 240 python3 -m quantmla.cli bench-kernel --heads 16 --methods int4/int4,int2/int4 \
    --shapes 64x1536,20x2048,6x2048,32x16384 --sweep-shape 64x1536 --out "$OUT/kernels/decode_serving_shapes_h200.json" 2>&1 \
    | grep -v "^check " | tail -30
}

schedule-long() {
  timeout 400 python3 -m quantmla_lab.bench.kernels.decode_schedule --methods fp8 int4/int4 int2/int4 \
    --shapes16 4x20480,7x20480,13x20480 --shapes128 "" --ctas 1 2 \
    --out "$OUT/decode_schedule/long_decode_batches_h200.json" 2>&1 | grep "^== best\|failed" | tail -20
}

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

page-rope() {
  timeout 240 python3 -m quantmla.cli bench-kernel --no-sweep --methods int4/int4,int4/int4-page,int2/int4,int2/int4-page \
    --out "$OUT/kernels/decode_page_rope_h200.json" 2>&1 | grep -v "^check " | tail -30
}

breakdown() {
  timeout 200 python3 -m quantmla_lab.bench.kernels.decode_breakdown --formats bf16,int4/int4 \
    --shapes 1x131072,8x16384,32x16384,264x32,264x512 --out "$OUT/kernels/decode_breakdown_h200.json" 2>&1 | tail -20
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

ncu-fragments() {
  timeout 120 ncu --clock-control none -k regex:mla_decode -c 1 -s 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section InstructionStats \
    --section Occupancy python3 -m quantmla_lab.bench.kernels.decode_once int4/int4 16 32 16384 --fragments 2>&1 \
    | grep -v "^==PROF==" > "$OUT/kernels/ncu_sections_int4_fragments_32x16384_h200.txt"
  grep -i "shared\|throughput\|issue\|duration" "$OUT/kernels/ncu_sections_int4_fragments_32x16384_h200.txt" | head -20
}

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

decode-in-graph() {
  timeout 200 python3 -m quantmla_lab.bench.kernels.decode_in_graph --shapes 1x2048 8x2048 --timeline \
    --out "$OUT/kernels/decode_in_graph_short_h200.json" 2>&1 | tail -12
  timeout 200 python3 -m quantmla_lab.bench.kernels.decode_in_graph --shapes 32x16384 --layers 8 \
    --out "$OUT/kernels/decode_in_graph_long_h200.json" 2>&1 | tail -4
}

partials() {
  local p
  for p in fp16 fp32; do
    QUANTMLA_PARTIALS=$p timeout 120 python3 -m quantmla_lab.bench.kernels.decode_in_graph --methods fp8 int4/int4 \
      int2/int4 --shapes 1x131072 8x16384 32x16384 8x2048 --layers 8 --out "$OUT/kernels/decode_in_graph_partials_${p}_h200.json" 2>&1 | grep -v -i warn | tail -17
  done
  local xdist=""
  python3 -c "import xdist" 2>/dev/null && xdist="-n ${TEST_WORKERS:-8}"
  QUANTMLA_PARTIALS=fp16 timeout 240 python3 -m pytest tests/test_kernels_gpu.py tests/test_kernels_gpu_warpgroup.py -q -rfs \
    -p no:cacheprovider $xdist -k "fp16_partials or many_splits or tokens_m_splits or warpgroup_splits or lowbit_splits or error_within or full_shape" 2>&1 \
    | tail -8 \
    | tee "$OUT/kernels/partials_gpu_tests_h200.log"
}

bf16-partials() {
  local p
  for p in ${PARTIALS_ORDER:-fp16 bf16}; do
    QUANTMLA_PARTIALS=$p timeout 200 python3 -m quantmla_lab.bench.kernels.decode_in_graph --methods bf16 fp8 \
      --shapes 1x131072 8x16384 32x16384 64x4096 128x2048 --layers 8 \
      --out "$OUT/kernels/decode_in_graph_partials_16h_${p}_h200.json" 2>&1 | grep -v -i warn | tail -12
    QUANTMLA_PARTIALS=$p timeout 150 python3 -m quantmla_lab.bench.kernels.decode_in_graph --methods bf16 --heads 128 \
      --shapes 1x32768 32x8192 64x4096 --layers 8 \
      --out "$OUT/kernels/decode_in_graph_partials_128h_${p}_h200.json" 2>&1 | grep -v -i warn | tail -5
  done
  local xdist=""
  python3 -c "import xdist" 2>/dev/null && xdist="-n ${TEST_WORKERS:-8}"
  timeout 240 python3 -m pytest tests/test_kernels_gpu.py tests/test_kernels_gpu_warpgroup.py -q -rfs -p no:cacheprovider \
    $xdist -k "many_splits or tokens_m_splits or warpgroup_splits or lowbit_splits or error_within or full_shape" 2>&1 \
    | tail -8 | tee "$OUT/kernels/bf16_partials_gpu_tests_h200.log"
}

bf16-partials-repeat() {  # the shapes where bf16 partials moved most, both settings twice, alternating
  local p n=0
  for p in fp16 bf16 bf16 fp16; do
    n=$((n + 1))
    QUANTMLA_PARTIALS=$p timeout 100 python3 -m quantmla_lab.bench.kernels.decode_in_graph --methods bf16 fp8 \
      --shapes 64x4096 32x16384 --layers 8 --out "$OUT/kernels/decode_in_graph_partials_repeat_16h_${p}_${n}_h200.json" \
      2>&1 | grep -v -i warn | tail -4
    QUANTMLA_PARTIALS=$p timeout 100 python3 -m quantmla_lab.bench.kernels.decode_in_graph --methods bf16 --heads 128 \
      --shapes 1x32768 32x8192 --layers 8 --out "$OUT/kernels/decode_in_graph_partials_repeat_128h_${p}_${n}_h200.json" \
      2>&1 | grep -v -i warn | tail -2
  done
}

staged-epilogue() {
  local p
  for p in fp32 bf16; do
    QUANTMLA_PARTIALS=$p timeout 200 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --heads 128 \
      --formats bf16,int4/int4 --shapes 1x32768,32x8192,64x4096 --tilings "" --warpgroup --variants EPI_SMEM=0 \
      --out "$OUT/kernels/decode_staged_epilogue_128h_${p}_h200.json" 2>&1 | grep -v -i warn | grep "warpgroup" | tail -24
  done
}

partials-128() {
  local p
  for p in fp32 bf16; do
    QUANTMLA_PARTIALS=$p timeout 150 python3 -m quantmla_lab.bench.kernels.decode_in_graph --methods bf16 int4/int4 \
      --heads 128 --shapes ${PARTIALS_SHAPES:-1x32768 4x16384 32x8192 64x4096} --layers 8 \
      --out "$OUT/kernels/decode_in_graph_partials_128h_${p}_staged_h200.json" 2>&1 | grep -v -i warn | tail -10
  done
  [ -n "${PARTIALS_NO_COMBINE:-}" ] && return
  timeout 100 python3 -m quantmla_lab.bench.kernels.combine --rows 128 --partials bf16 --shapes 1x64,4x16,8x8,32x2 \
    --blocks 1x128 2x64 4x32 1x64 2x32 --out "$OUT/kernels/combine_blocks_128rows_bf16_h200.json" 2>&1 | tail -28
}

peer() {
  timeout 420 python3 -m quantmla.cli bench-kernel --no-sweep \
    --peer "${PEER:?set PEER to the path of the vLLM file triton_decode_attention.py}" \
    --out "$OUT/kernels/${PEER_NAME:-decode_vs_peer}_h200.json" 2>&1 | grep -v -i warn | tail -40
}

combine-rule() {
  timeout 330 python3 -m quantmla_lab.bench.kernels.decode_in_graph --methods int4/int4 --layers 8 \
    --shapes 1x131072 4x20480 7x20480 13x20480 32x16384 --combine-blocks "" 8x16 2x16 2x64 4x64 4x16 1x64 \
    --out "$OUT/kernels/decode_in_graph_combine_rule_16h_h200.json" 2>&1 | grep -v -i warn | tail -30
  timeout 150 python3 -m quantmla_lab.bench.kernels.decode_in_graph --heads 128 --methods int4/int4 bf16 --layers 8 \
    --shapes 1x32768 8x8192 --combine-blocks "" 8x16 2x64 4x32 \
    --out "$OUT/kernels/decode_in_graph_combine_rule_128h_h200.json" 2>&1 | grep -v -i warn | tail -12
}

combine-128-repeats() {
  local k
  for k in 1 2; do
    timeout 140 python3 -m quantmla_lab.bench.kernels.decode_in_graph --heads 128 --methods int4/int4 bf16 --layers 8 \
      --shapes 4x16384 8x8192 16x8192 32x8192 --combine-blocks "" 4x32 2x32 8x32 4x64 \
      --out "$OUT/kernels/decode_in_graph_combine_128h_few_splits_${k}_h200.json" 2>&1 | grep -v -i warn | tail -40
  done
}

rules-tests() {
  local log="$OUT/kernels/rules_gpu_tests_h200.log" xdist=""
  python3 -c "import xdist" 2>/dev/null && xdist="-n ${TEST_WORKERS:-8}"
  timeout 240 python3 -m pytest tests/test_kernels_gpu.py tests/test_kernels_gpu_warpgroup.py \
    tests/test_kernels_gpu_tokens_m64.py tests/test_append.py tests/test_spec.py -q -rfs -p no:cacheprovider $xdist \
    -k "append or mistral4 or splits or full_shape or error_within or tm64" 2>&1 | grep -v -i warn > "$log"
  tail -4 "$log"
}

scores-refill() {
  local log="$OUT/kernels/scores_refill_gpu_tests_h200.log" xdist=""
  python3 -c "import xdist" 2>/dev/null && xdist="-n ${TEST_WORKERS:-8}"
  { date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$log"
  timeout 200 python3 -m pytest tests/test_kernels_gpu.py -q -rfs -p no:cacheprovider $xdist \
    -k "tokens_m or full_shape or many_splits" 2>&1 | grep -v -i warn | tail -8 | tee -a "$log"
  timeout 240 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4 \
    --shapes 1x131072,8x16384,32x16384,64x4096,8x2048 --tilings 8x32 --tokens-m --variants SCORES_REFILL=0 SCORES_REFILL=1 SCORES_REFILL=2 \
    --out "$OUT/kernels/decode_tokens_m_scores_refill_h200.json" 2>&1 | grep -v -i warn | tail -30
}

whole-page() {
  local log="$OUT/kernels/whole_page_gpu_tests_h200.log" xdist=""
  python3 -c "import xdist" 2>/dev/null && xdist="-n ${TEST_WORKERS:-8}"
  { date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$log"
  timeout 200 python3 -m pytest tests/test_kernels_gpu.py tests/test_latent_range.py -q -rfs -p no:cacheprovider $xdist \
    -k "tokens_m or full_shape or many_splits or wide_latents" 2>&1 | grep -v -i warn | tail -8 | tee -a "$log"
  timeout 240 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4,fp8 \
    --shapes 1x131072,8x16384,32x16384,64x4096,8x2048 --tilings 8x32 --tokens-m --variants WHOLE_PAGE=1 WHOLE_PAGE=0 \
    --out "$OUT/kernels/decode_tokens_m_whole_page_h200.json" 2>&1 | grep "WHOLE\|tokens_m_decode"
}

stage-plans() {
  local f t
  for f in int4/int4:2 int2/int4:1; do  # (the 4-warp plans' token blocks a warp)
    t=${f#*:}
    timeout 150 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats "${f%:*}" \
      --shapes 1x2048,8x2048,16x1536,64x1536 --tilings 8x32 --tokens-m \
      --variants "WS=0,TPW=$t,WHOLE_PAGE=1" "WS=0,TPW=$t,WHOLE_PAGE=0" \
      --out "$OUT/kernels/decode_tokens_m_stage_plans_short_${t}blocks_h200.json" 2>&1 | grep "PAGE\|tokens_m_decode"
  done
  timeout 240 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4 \
    --shapes 1x131072,8x16384,32x16384,64x4096 --tilings 8x32 --tokens-m --variants SCORES_REFILL=0 \
    --out "$OUT/kernels/decode_tokens_m_stage_plans_long_h200.json" 2>&1 | grep "stages_[0-9] \|REFILL\|tokens_m_decode"
}

scale-vote() {
  local log="$OUT/kernels/scale_vote_gpu_tests_h200.log" xdist=""
  python3 -c "import xdist" 2>/dev/null && xdist="-n ${TEST_WORKERS:-8}"
  { date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$log"
  timeout 150 python3 -m pytest tests/test_latent_range.py -q -rfs -p no:cacheprovider -k wide_latents 2>&1 \
    | grep -v -i warn | tail -6 | tee -a "$log"
  sed -i 's/^#define SCALE_VOTE 0$/#define SCALE_VOTE 1/' src/quantmla/kernels/cuda/softmax_tm.cuh
  grep -n "define SCALE_VOTE" src/quantmla/kernels/cuda/softmax_tm.cuh >> "$log"
  timeout 200 python3 -m pytest tests/test_kernels_gpu.py -q -rfs -p no:cacheprovider $xdist \
    -k "tokens_m or full_shape or many_splits" 2>&1 | grep -v -i warn | tail -8 | tee -a "$log"
  sed -i 's/^#define SCALE_VOTE 1$/#define SCALE_VOTE 0/' src/quantmla/kernels/cuda/softmax_tm.cuh
  timeout 240 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4,fp8 \
    --shapes 1x131072,8x16384,32x16384,64x4096,8x2048 --tilings 8x32 --tokens-m --variants SCALE_VOTE=1 \
    --out "$OUT/kernels/decode_tokens_m_scale_vote_h200.json" 2>&1 | grep "VOTE\|tokens_m_decode"
}

two-bit-plans() {
  timeout 200 python3 -m quantmla_lab.bench.kernels.decode_in_graph --methods int2/int4 \
    --shapes 8x2048 16x1536 32x1536 16x4096 --layers 27 --timeline --plans "" specialized=0 \
    --out "$OUT/kernels/decode_in_graph_two_bit_short_units_h200.json" 2>&1 | grep -v -i warn | tail -12
  timeout 200 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int2/int4 \
    --shapes 1x131072,8x16384,32x16384,64x4096 --tilings 8x32 --tokens-m --variants SCALE_VOTE=1 \
    --out "$OUT/kernels/decode_tokens_m_scale_vote_two_bit_h200.json" 2>&1 | grep "VOTE\|tokens_m_decode"
}

combine() {
  timeout 120 python3 -m quantmla_lab.bench.kernels.combine --out "$OUT/kernels/combine_h200.json" 2>&1 | tail -14
}

tm-staged-epilogue() {
  local log="$OUT/kernels/tokens_m_staged_epilogue_gpu_tests_h200.log" xdist=""
  timeout 240 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4,fp8 --heads 16 \
    --shapes ${TM_EPI_SHAPES:-1x131072,8x16384,32x16384,64x4096,128x2048} --tilings "" --tokens-m --variants TM_EPI_SMEM=1 \
    --out "$OUT/kernels/decode_tokens_m_staged_epilogue_h200.json" 2>&1 | grep -v -i warn | grep "EPI\|tokens_m_decode"
  python3 -c "import xdist" 2>/dev/null && xdist="-n ${TEST_WORKERS:-8}"
  { date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$log"
  sed -i 's/^#define TM_EPI_SMEM 0 /#define TM_EPI_SMEM 1 /' src/quantmla/kernels/cuda/mla_decode_tm.cu
  grep -n "^#define TM_EPI_SMEM" src/quantmla/kernels/cuda/mla_decode_tm.cu >> "$log"
  timeout 200 python3 -m pytest tests/test_kernels_gpu.py -q -rfs -p no:cacheprovider $xdist \
    -k "tokens_m or full_shape or many_splits" 2>&1 | grep -v -i warn | tail -6 | tee -a "$log"
  sed -i 's/^#define TM_EPI_SMEM 1 /#define TM_EPI_SMEM 0 /' src/quantmla/kernels/cuda/mla_decode_tm.cu
}

combine-blocks() {
  timeout 100 python3 -m quantmla_lab.bench.kernels.combine --partials fp16 --blocks 1x64 2x32 1x32 4x16 \
    --out "$OUT/kernels/combine_blocks_16rows_fp16_h200.json" 2>&1 | tail -30
  timeout 100 python3 -m quantmla_lab.bench.kernels.combine --rows 128 --shapes 1x64,8x8,32x2 --blocks 2x64 4x32 1x128 \
    --out "$OUT/kernels/combine_blocks_128rows_fp32_h200.json" 2>&1 | tail -16
}

e4m3-scores() {
  timeout 100 python3 -m quantmla_lab.bench.kernels.e4m3_scores --out "$OUT/kernels/e4m3_scores_h200.json" 2>&1 | tail -8
}

combine-calls() {
  timeout 300 python3 -m quantmla_lab.bench.kernels.decode_in_graph --methods ${COMBINE_METHODS:-int4/int4} --layers 8 \
    --shapes ${COMBINE_SHAPES:-8x16384 1x131072 4x32768 8x65536} --combine-blocks "" 1x64 1x32 2x32 4x16 \
    --out "$OUT/kernels/decode_in_graph_combine_blocks_h200.json" 2>&1 | grep -v -i warn | tail -30
}

fp8-one-cta-calls() {
  timeout 300 python3 -m quantmla_lab.bench.kernels.decode_in_graph --methods fp8 --layers 8 \
    --shapes ${FP8_CALL_SHAPES:-64x4096 128x2048 8x26112 16x26112 7x20480} \
    --configs "" "tokens_m=1,ctas_per_sm=2" "tokens_m=1,ctas_per_sm=1" "tokens_m=0" \
    --out "$OUT/kernels/decode_in_graph_fp8_one_cta_h200.json" 2>&1 | grep -v -i warn | tail -30
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

tokens-m64() {
  timeout 200 python3 -m pytest -q -x tests/test_kernels_gpu_tokens_m64.py -s -p no:cacheprovider 2>&1 | grep -v -i warn \
    > "$OUT/kernels/tokens_m64_gpu_tests_h200.log"
  tail -12 "$OUT/kernels/tokens_m64_gpu_tests_h200.log"
  timeout 240 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --heads 128 --formats int4/int4,bf16 \
    --shapes 1x32768,32x8192,64x4096 --tilings "" --warpgroup ${TM64_VARIANTS:+--tm64-variants $TM64_VARIANTS} \
    --out "$OUT/kernels/decode_tokens_m64_128h_h200.json" 2>&1 | grep -v -i warn | tail -24
}

warpgroup() {
  timeout 120 python3 -m pytest -q -x tests/test_kernels_gpu_warpgroup.py -s 2>&1 | grep -v -i warn \
    > "$OUT/kernels/warpgroup_gpu_tests_h200.log"
  tail -3 "$OUT/kernels/warpgroup_gpu_tests_h200.log"
  timeout 150 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats bf16 --heads 128 \
    --shapes 32x8192,1x32768,64x4096 --tilings 16x64 --warpgroup --variants TMA=0 SKIP_QK=1,SKIP_PV=1 \
    --out "$OUT/kernels/decode_warpgroup_tma_128h_h200.json" 2>&1 | tail -15
  timeout 200 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4,fp8 --heads 128 \
    --shapes 32x8192,64x4096,1x32768 --tilings 16x64 --warpgroup --variants SKIP_QK=1,SKIP_PV=1 SKIP_QK=1 SKIP_PV=1 \
    --out "$OUT/kernels/decode_warpgroup_lowbit_128h_h200.json" 2>&1 | tail -15
  timeout 150 python3 -m quantmla.cli bench-kernel --no-sweep --heads 128 --methods bf16,fp8,int4/int4,int2/int4 --peer "${PEER:?set PEER to the path of the vLLM file triton_decode_attention.py}" \
    --out "$OUT/kernels/decode_vs_peer_128h_h200.json" 2>&1 | tail -8
}

s8-scores() {
  timeout 240 python3 -m pytest -q -rfs tests/test_kernels_gpu.py -k "s8 or tokens_m_error" -s 2>&1 | grep -v -i warn \
    > "$OUT/kernels/tokens_m_s8_scores_gpu_tests_h200.log"
  tail -3 "$OUT/kernels/tokens_m_s8_scores_gpu_tests_h200.log"
  timeout 300 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4 --heads 16 \
    --shapes 32x16384,1x131072,64x4096 --tilings 8x32 --tokens-m --variants S8_QK=1 S8_QK=1,S8_AORDER=1 \
    S8_QK=1,S8_DESC=1 S8_QK=1,SKIP_PV=1 SKIP_PV=1 --out "$OUT/kernels/decode_tokens_m_s8_scores_h200.json" 2>&1 | tail -20
}

short-units() {
  timeout 300 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4 --heads 16 \
    --shapes 1x2048,2x1536,8x1536,16x1536,64x1536 --tilings 8x32 --tokens-m \
    --out "$OUT/kernels/decode_short_units_h200.json" 2>&1 | tail -24
}

mma-rate() {
  timeout 300 python3 -m quantmla_lab.bench.kernels.mma_rate --chains 2 4 8 --ctas-per-sm 1 2 4 \
    --out "$OUT/kernels/mma_rate_h200.json" 2>&1 | grep -v SASS | tail -72
}

append-tilings() {
  timeout 200 python3 -m quantmla_lab.bench.kernels.append_tilings --tokens 1 8 16 128 8192 \
    --out "$OUT/kernels/append_tilings_h200.json" 2>&1 | grep -v -i warn | tail -140
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

for s in "${STEPS[@]}"; do
  echo "== $(date -u +%T) $s"
  "$s"
done
