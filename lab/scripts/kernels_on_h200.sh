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
# page-rope       the RoPE path per channel per page beside per-token groups (16 and 128 heads)
#                                                                -> kernels/decode_page_rope_h200.json
# rope-pages      RoPE keys grouped per page on the tokens-as-M kernel (rope_page_tm.cuh; TM_ROPE_PAGE_DEFAULT) and the
#                 heads-as-M kernel (wg_build.cuh's PM; WG_ROPE_PAGE_DEFAULT): their GPU tests with the page formats'
#                 API and engine tests, then their calls and decode kernels beside the built tile's, per-token and
#                 per-channel (16-token blocks) INT4/INT4 and INT2/INT4, at 16 heads and at 128
#                 -> kernels/rope_pages_gpu_tests_h200.log, kernels/decode_rope_pages_{16h,128h}_h200.json
# breakdown       a decode call split into the decode kernel, the combine kernel and the rest; fixed cost
#                 against cost per token                        -> kernels/decode_breakdown_h200.json
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
# partials-128    whole calls at 128 heads (decode_in_graph, graphs of 8 layers) with fp32 partials (fp32; the files of
#                 6f4d717 name them auto) and 16-bit ones (bf16), BF16 and INT4/INT4, a process each; then the
#                 combine alone at 128 rows with bf16 partials, the API's blocks beside blocks narrowed rows first
#                                   -> kernels/decode_in_graph_partials_128h_{fp32,bf16}_staged_h200.json,
#                                      kernels/combine_blocks_128rows_bf16_h200.json
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
# combine-calls   whole calls in graphs of 8 layers (decode_in_graph, 16 heads) with the combine's blocks the API's and
#                 1x64, 1x32, 2x32, 4x16 (rows x channels a program) at COMBINE_SHAPES, COMBINE_METHODS
#                                                        -> kernels/decode_in_graph_combine_blocks_h200.json
# fp8-one-cta-calls  FP8 whole calls in graphs of 8 layers (decode_in_graph) with the API's choice beside
#                 the tokens-as-M kernel at two and at one CTA an SM, and the built tile, at FP8_CALL_SHAPES
#                                                        -> kernels/decode_in_graph_fp8_one_cta_h200.json
# short-units     the short job's decode calls (16 heads, 1 to 64 sequences of 1536 or 2048 tokens: units of about two
#                 tiles), the built tile beside the tokens-as-M kernel for INT4/INT4 and INT2/INT4: whether short units
#                 read faster on the built tile, as FP8's below FP8_TM_MIN_TOKENS do -> kernels/decode_short_units_h200.json
# combine-rule    whole calls in graphs of 8 layers (decode_in_graph) with the combine's blocks as the API chooses them
#                 (schedule.combine_blocks) beside fixed blocks, INT4/INT4 and BF16 (the baseline every run times): 16
#                 heads at 1 x 131072, 4, 7 and 13 x 20480, 32 x 16384; 128 heads at 1 x 32768, 8 x 8192
#                                            -> kernels/decode_in_graph_combine_rule_{16h,128h}_h200.json
# combine-128-repeats whole calls at 128 heads with few splits a sequence (4 x 16384, 8, 16 and 32 x 8192), INT4/INT4
#                 and BF16, the API's combine blocks beside 4x32, 2x32, 8x32 and 4x64, in two processes
#                                       -> kernels/decode_in_graph_combine_128h_few_splits_{1,2}_h200.json
# rules-tests     the GPU tests of the API's rules: splits, 16-bit partials, full shapes, the error against fp64,
#                 the append's metadata rounding, mistral4's query scale
#                                                                         -> kernels/rules_gpu_tests_h200.log
#
# Files go under $OUT/kernels/ (schedule-long's under $OUT/decode_schedule/; default OUT=/tmp/out), named as in
# lab/results/.
# On a GPU other than an H200 the files a run writes are renamed when it exits (a step's failure or timeout too) to
# that GPU's tag, h100 for h200 (lab/scripts/device_names.sh); the commands recorded inside them keep the h200 paths.
set -uo pipefail
# shellcheck source=lab/scripts/gpu_steps.sh
source "$(dirname "$0")/gpu_steps.sh" "$@"

tests() {
  local log="$OUT/kernels/gpu_tests_h200.log"
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  } 2>&1 | tee "$log"
  local xdist=""
  python3 -c "import xdist" 2>/dev/null && xdist="-n ${TEST_WORKERS:-8}"
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/test_kernels_gpu.py tests/test_kernels_gpu_warpgroup.py tests/test_kernels_cuda.py tests/test_decode_configs.py tests/test_kernels.py tests/test_kernels_prefill.py tests/test_append.py -q -rfs -p no:cacheprovider $xdist 2>&1 | tee -a "$log"
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

page-rope() {
  timeout 240 python3 -m quantmla.cli bench-kernel --no-sweep --methods int4/int4,int4/int4-page,int2/int4,int2/int4-page \
    --out "$OUT/kernels/decode_page_rope_h200.json" 2>&1 | grep -v "^check " | tail -30
}

rope-pages() {
  local log="$OUT/kernels/rope_pages_gpu_tests_h200.log" f=int4/int4,int4/int4-page16,int2/int4,int2/int4-page16
  { date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$log"
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest tests/test_kernels_gpu_rope_page.py tests/test_page_rope.py \
    tests/test_kernels_gpu.py::test_decode_page_rope tests/test_kernels_gpu.py::test_decode_page_rope_blocks \
    -q -rfs -p no:cacheprovider -s 2>&1 | grep -v "^cuda/\|^$" | tee -a "$log" | tail -25
  timeout "${BENCH_TIMEOUT:-200}" python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --tokens-m --tilings 8x32 \
    --formats $f --shapes 1x131072,32x16384,64x4096 --out "$OUT/kernels/decode_rope_pages_16h_h200.json" 2>&1 | tail -30
  timeout "${BENCH_TIMEOUT:-200}" python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --warpgroup --heads 128 \
    --tilings 16x64 --formats $f --shapes 1x32768,32x8192 --out "$OUT/kernels/decode_rope_pages_128h_h200.json" 2>&1 \
    | tail -20
}

breakdown() {
  timeout 200 python3 -m quantmla_lab.bench.kernels.decode_breakdown --formats bf16,int4/int4 \
    --shapes 1x131072,8x16384,32x16384,264x32,264x512 --out "$OUT/kernels/decode_breakdown_h200.json" 2>&1 | tail -20
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
    tests/test_append.py tests/test_spec.py -q -rfs -p no:cacheprovider $xdist \
    -k "append or mistral4 or splits or full_shape or error_within" 2>&1 | grep -v -i warn > "$log"
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

combine-blocks() {
  timeout 100 python3 -m quantmla_lab.bench.kernels.combine --partials fp16 --blocks 1x64 2x32 1x32 4x16 \
    --out "$OUT/kernels/combine_blocks_16rows_fp16_h200.json" 2>&1 | tail -30
  timeout 100 python3 -m quantmla_lab.bench.kernels.combine --rows 128 --shapes 1x64,8x8,32x2 --blocks 2x64 4x32 1x128 \
    --out "$OUT/kernels/combine_blocks_128rows_fp32_h200.json" 2>&1 | tail -16
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

short-units() {
  timeout 300 python3 -m quantmla_lab.bench.kernels.decode_cuda_variants --formats int4/int4,int2/int4 --heads 16 \
    --shapes 1x2048,2x1536,8x1536,16x1536,64x1536 --tilings 8x32 --tokens-m \
    --out "$OUT/kernels/decode_short_units_h200.json" 2>&1 | tail -24
}

append-tilings() {
  timeout 200 python3 -m quantmla_lab.bench.kernels.append_tilings --tokens 1 8 16 128 8192 \
    --out "$OUT/kernels/append_tilings_h200.json" 2>&1 | grep -v -i warn | tail -140
}

run_steps
