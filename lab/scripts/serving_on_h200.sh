#!/usr/bin/env bash
# Serving on the H200: does the engine agree with transformers, how much throughput does a low-bit cache
# buy under a KV budget, and where does a step's time go? One named step per argument, in order:
#
#   QUANTMLA_COMMIT=$(git rev-parse --short HEAD) OUT=/tmp/out bash lab/scripts/serving_on_h200.sh gpu-tests agreement budget-curve
#
# gpu-tests       the GPU cases of the read / graph-schedule / engine / observer / fused-module tests (log only)
# agreement       `serve-bench --check-only`: greedy outputs against generate() on the shipped models
#                 (bf16, int4/int4, int2/int4)                              -> agreement/check_h200.json
# budget-curve    `serve-bench`, 64 requests, budgets 0.075-1 GiB, groups 128/64      -> serving/budget_curve_h200.json
# point-0.1       the same job at 0.1 GiB only            -> serving/point_0.1gib_decode_splits_128_h200.json
# job-shapes      `serve-bench` on the two job shapes the projection rates best for INT4/INT4
#                                      -> serving/job_prompts_3072-4096_h200.json, serving/job_prompts_256-512_h200.json
# short           the short job (64 prompts of 1K-2K tokens, 256-384 new) at the budgets of the goals (0.075, 0.1 GiB) and
#                 where BF16 holds about 8 and 32 requests: BF16, FP8, INT4/INT4, INT2/INT4       -> serving/short_h200.json
# jobs            the three named jobs at every budget of each (BF16 holds about 2, 8 and 32 requests; `longest` 2 and 8):
#                 BF16, FP8, INT4/INT4, INT2/INT4, each job's own chunk budget, one process a job
#                                                        -> serving/{short,long,longest}_budgets_h200.json
# tight           the long and longest jobs where BF16 holds about 2 requests (1.26 and 3.74 GiB), four formats:
#                 tight-long and tight-longest, about 280 s each with the warm-up (one device call each)
#                                       -> serving/long_1.26gib_h200.json, serving/longest_3.74gib_h200.json
# long-fp8-repeats the tight long job's FP8 and INT4/INT4 three times in turn: the median ratio of the 1.8x goal
#                                                        -> serving/long_1.26gib_fp8_int4_repeats_h200.json
# long-partials   the tight long job's FP8 and INT4/INT4 with fp16 partials (the default; QUANTMLA_PARTIALS=fp16 set
#                 all the same), then INT4/INT4 with fp32 partials (QUANTMLA_PARTIALS=fp32), one process each
#                                                        -> serving/long_1.26gib_partials_{fp16,fp32}_h200.json
# long-fp8-int4   the tight long job's FP8 and INT4/INT4 at the defaults, one process  -> serving/long_1.26gib_fp8_int4_h200.json
# long            the long job at the budget where BF16 holds about 8 requests: BF16, FP8, INT4/INT4, INT2/INT4, and
#                 INT4/INT4 and INT2/INT4 with RoPE keys per channel per page  -> serving/long_5.04gib_h200.json
# longest         the longest job likewise (BF16, FP8, INT4/INT4, INT2/INT4)  -> serving/longest_14.95gib_h200.json
# serve-cli       `quantmla serve` on a shipped model, 48 prompts under a 2 MiB KV budget, three formats (log only)
# decode-profile  per-kernel GPU time of eager decode steps: batch 64 of 1536-token prompts (groups 64/32),
#                 batch 1 and 8 of 1900 tokens (groups 128/64)             -> profile/decode_batch{64,1,8}_h200.json
# step-grid       an eager decode step split into attention, cache append, projections and MLP, sampling and host time,
#                 with bytes and fraction of copy bandwidth, at batches 1-64 x contexts 2K-64K x bf16, fp8,
#                 int4/int4, int2/int4 (groups 128/64), one process            -> profile/step_grid_h200.json
# prefill-profile per-kernel GPU time of prefill steps: 2048 and 8192 batched tokens, 1531-token chunks
#                                                 -> prefill/profile_{2048,8192,1531}_tokens_h200.json
# prefill-rates   prefill at the long job's shape (4 prompts of 20480 tokens, 16384 batched tokens): tokens/s and
#                 TFLOP/s of the dense and attention parts against a bf16 matmul    -> prefill/rates_long_h200.json
# prefill-kernel  one chunk's prefill attention: the kernel's tilings against SDPA and plain matmuls
#                                                                           -> prefill/attention_variants_h200.json
# prefill-split   the prefill kernel's default tiling with its unmasked key blocks apart and as one masked loop,
#                 at long chunks (16384 of 16384, 4096 of 20480, 8192, 1536)   -> prefill/split_diagonal_h200.json
# prefill-tilings the default tiling against the 128-query tiling, deeper pipelines and key blocks through tensor
#                 descriptors, at long and short chunks                      -> prefill/tilings_tma_h200.json
# prefill-sdpa    one chunk's attention: the engine's kernel against torch's SDPA backends (cuDNN, flash, efficient)
#                 at the long jobs' chunks                                  -> prefill/sdpa_backends_h200.json
# host-profile    the host time of prefilling steps at the long job's shape (prompts of 20K tokens, 16384 a step, the
#                 tight budget: BF16 preempts): launch and total ms a step, and the Python functions it goes to
#                 (cProfile), BF16, FP8 and INT4/INT4
#                                                                   -> profile/host_prefill_steps_h200.json
# projection-gemms cuBLAS's time for each projection weight alone and for the stacked ones, 1 to 64 rows, and the
#                 Triton candidate that streams the weight (skinny_gemm.py)   -> profile/projection_gemms_triton_h200.json
# step-grid-merged the (eager) step grid, and the same engine without merged projections at batch 1 and 32 of 16K
#                                     -> profile/step_grid_merged_h200.json, profile/step_grid_merged_off_h200.json
# step-grid-graphs the step grid's batch 1 and 32 of 16K with decode steps as CUDA-graph replays (as serve-bench
#                 runs them), launched ahead of the previous step's tokens and one at a time, 30 costliest kernels
#                               -> profile/step_grid_graphs_h200.json, profile/step_grid_graphs_no_overlap_h200.json
# graph-units-grid graph decode steps at batches that pad their bucket (5, 9, 13) and fill it (8, 16), 16K contexts, four
#                 formats, the bucket's units dealt out by length and the same to every row, one process each
#                               -> profile/step_grid_graph_units_{length,rows}_h200.json
# graph-units-long the tight long job (1.26 GiB; FP8, INT4/INT4, INT2/INT4) with the units dealt by length and by row
#                               -> serving/long_1.26gib_graph_units_{length,rows}_h200.json
# prefill-graph-cap the tight long job (units by length) with prefill graphs up to 16384 tokens, against tight-long
#                 (up to 4096, the default)  -> serving/long_1.26gib_prefill_graphs_16384_h200.json
# mixed-decode-graphs the tight long job (FP8, INT4/INT4, INT2/INT4) with decode rows replaying their graphs beside
#                 eager prompt chunks of up to 8192 tokens, against tight-long  -> serving/long_1.26gib_mixed_decode_graphs_h200.json
# long-chunks     the tight long job (FP8, INT4/INT4) with 4096- and 8192-token chunk budgets, one process each, against
#                 tight-long's 16384: decode rows ride along more, shorter prefilling steps
#                 -> serving/long_1.26gib_chunks_{4096,8192}_h200.json (long-chunks-4096, long-chunks-8192: one call each)
# long-budgets    the long job at two more budgets where BF16 holds 1 to 2 requests, four formats, one process (and one
#                 device call) each: 0.98 and 1.14 GiB, where the budget model (budget_model.py,
#                 serving/budget_model_long.json) puts INT4/INT4 over FP8 at its highest (2.00x) and lowest (1.72x) of
#                 that band; checks the model's swing between budgets
#                 -> serving/long_{0.98,1.14}gib_h200.json (long-0.98, long-1.14: one call each)
# short-0.1       the short job at 0.1 GiB (BF16 holds about 2 requests), four formats, one process, with the step logs
#                 that budget_model.py prices other budgets from   -> serving/short_0.1gib_h200.json
# step-grid-ctas  graph decode steps at the tight long job's batches (4, 7, 13 of 20480 tokens), FP8 and INT4/INT4, with
#                 the decode schedule at 1 and at 2 programs an SM      -> profile/step_grid_long_ctas{1,2}_h200.json
# step-grid-full  the whole grid (batches 1-64 x contexts 2K-64K x four formats) as the jobs run decode steps: graph
#                 replays launched ahead                              -> profile/step_grid_full_graphs_h200.json
# step-grid-2k    graph decode steps at the short job's shape (1 and 8 rows of 2K), four formats, 20 costliest kernels:
#                 the append and decode calls' share of a step                -> profile/step_grid_2k_h200.json
# greedy-kernels  the greedy tokens' Triton kernels against torch's tokens on the GPU (tests/test_sampling.py, the engine's
#                 graph and agreement tests), then the equal-batch step grid (32 x 16K, four formats) with them
#                 -> serving/greedy_kernels_gpu_tests_h200.log, profile/step_grid_greedy_kernels_h200.json
# step-anatomy    host against GPU time of each step of a pressured job       -> step_overhead/step_anatomy_h200.json
# step-overhead   graph decode step wall time against its replay's GPU time -> step_overhead/splits_128_h200.json
# splits-ab       the same with 256- and 128-token decode split floors, three formats, batches 1-16
#                                                                           -> step_overhead/splits_256_vs_128_h200.json
# splits-64       the same with 128- and 64-token decode split floors (one 64-token tile a unit on the tokens-as-M
#                 kernel), batches 1, 4 and 8       -> step_overhead/splits_128_vs_64_h200.json
# decode-splits   decode kernel latency at batches 1-16 of 1900 tokens, by shortest split -> decode_splits/h200.json
# capture-cost    each CUDA-graph capture of a short serve job timed, in a first and a second process
#                 (the first compiles the Triton kernels on a fresh machine)
#                                     -> capture_cost/fresh_machine_h200.json, capture_cost/triton_cache_warm_h200.json
# warm-cold       one short job twice per engine (graphs captured on first use, then all captured) and
#                 without graphs                                             -> capture_cost/warm_cold_h200.json
#
# Files go under $OUT/<topic>/ (default OUT=/tmp/out), named as in lab/results/; the console goes to
# $OUT/console.log too.
# On a GPU other than an H200 the files a run writes are renamed when it exits (a step's failure or timeout too) to
# that GPU's tag, h100 for h200 (lab/scripts/device_names.sh); the commands recorded inside them keep the h200 paths.
set -uo pipefail
# shellcheck source=lab/scripts/device_names.sh
source "$(dirname "$0")/device_names.sh"
start_run
mkdir -p "$OUT"/{agreement,serving,profile,prefill,step_overhead,decode_splits,capture_cost}
export TRITON_INTERPRET=0 PYTHONPATH=src:lab:tests PYTHONUNBUFFERED=1
LOG="$OUT/console.log"
trap 'name_by_device | tee -a "$LOG"' EXIT
M=models/qmla-ref-deepseek-v3
GRP=(--content-group 128 --rope-group 64)
quiet() { grep -v -i warn | tail -"$1" | tee -a "$LOG"; }

gpu-tests() {
  timeout 150 python3 -m pytest -q -x tests/test_kernels.py tests/test_kernels_prefill.py tests/test_serving.py tests/test_kernels_gpu.py \
    tests/test_engine_observers.py tests/test_norms.py tests/test_fused_rope.py tests/test_merged.py tests/test_overlap.py \
    tests/test_latent_range.py -k "read_matches or static_graph or on_gpu or prefill or silu_mul or mlp_attach or merge or wide_latents" 2>&1 | tail -5 | tee -a "$LOG"
}

greedy-kernels() {
  timeout 200 python3 -m pytest -q tests/test_sampling.py tests/test_serving.py tests/test_engine_observers.py \
    -k "sampling or greedy or tokens or static_graph or on_gpu" -rfs 2>&1 | tail -8 \
    | tee "$OUT/serving/greedy_kernels_gpu_tests_h200.log" | tee -a "$LOG"
  timeout 200 python3 -m quantmla_lab.bench.serving.step_grid --batches 32 --contexts 16384 --warm 12 --top 20 \
    --out "$OUT/profile/step_grid_greedy_kernels_h200.json" 2>&1 | quiet 20
}

agreement() {
  timeout 150 python3 -m quantmla.cli serve-bench --check-only --check-families deepseek_v2 \
    --check-methods bf16 int4/int4 int2/int4 --out "$OUT/agreement/check_h200.json" 2>&1 | tail -25 | tee -a "$LOG"
}

budget-curve() {
  timeout 545 python3 -m quantmla.cli serve-bench --requests 64 --budgets-gib 0.075 0.1 0.125 0.25 0.5 1 "${GRP[@]}" \
    --max-batched-tokens 8192 --max-seconds 440 --out "$OUT/serving/budget_curve_h200.json" 2>&1 | quiet 24
}

point-0.1() {
  timeout 300 python3 -m quantmla.cli serve-bench --requests 64 --budgets-gib 0.1 "${GRP[@]}" --max-batched-tokens 8192 \
    --out "$OUT/serving/point_0.1gib_decode_splits_128_h200.json" 2>&1 | quiet 8
}

job-shapes() {
  timeout 280 python3 -m quantmla.cli serve-bench --requests 64 --prompt-len 3072 4096 --output-len 256 384 \
    --budgets-gib 0.1817 "${GRP[@]}" --max-batched-tokens 8192 --out "$OUT/serving/job_prompts_3072-4096_h200.json" 2>&1 \
    | quiet 6
  timeout 200 python3 -m quantmla.cli serve-bench --requests 64 --prompt-len 256 512 --output-len 256 384 \
    --budgets-gib 0.0273 "${GRP[@]}" --max-batched-tokens 8192 --out "$OUT/serving/job_prompts_256-512_h200.json" 2>&1 \
    | quiet 6
}

short() {
  timeout "${SHORT_TIMEOUT:-560}" python3 -m quantmla.cli serve-bench --job short --budgets-gib 0.075 0.1 0.43 1.72 \
    --methods bf16 fp8 int4/int4 int2/int4 "${GRP[@]}" --max-batched-tokens 8192 --max-seconds "${SHORT_SECONDS:-480}" \
    --out "$OUT/serving/short_h200.json" 2>&1 | quiet 20
}

jobs() {
  local job
  for job in short long longest; do
    timeout "${JOB_TIMEOUT:-540}" python3 -m quantmla.cli serve-bench --job "$job" --methods bf16 fp8 int4/int4 int2/int4 \
      "${GRP[@]}" --max-seconds "${JOB_SECONDS:-420}" --out "$OUT/serving/${job}_budgets_h200.json" 2>&1 | quiet 16
  done
}

long-fp8-int4() {
  timeout 300 python3 -m quantmla.cli serve-bench --job long --budgets-gib 1.26 --methods fp8 int4/int4 "${GRP[@]}" \
    --out "$OUT/serving/long_1.26gib_fp8_int4_h200.json" 2>&1 | quiet 8
}

tight-long() {
  timeout 400 python3 -m quantmla.cli serve-bench --job long --budgets-gib 1.26 --methods bf16 fp8 int4/int4 int2/int4 \
    "${GRP[@]}" --out "$OUT/serving/long_1.26gib_h200.json" 2>&1 | quiet 8
}

tight-longest() {
  timeout 400 python3 -m quantmla.cli serve-bench --job longest --budgets-gib 3.74 --methods bf16 fp8 int4/int4 int2/int4 \
    "${GRP[@]}" --out "$OUT/serving/longest_3.74gib_h200.json" 2>&1 | quiet 8
}

tight() {
  tight-long
  tight-longest
}

long-fp8-repeats() {
  timeout 500 python3 -m quantmla.cli serve-bench --job long --budgets-gib 1.26 --methods fp8 int4/int4 --repeats 3 \
    --max-seconds 380 "${GRP[@]}" --out "$OUT/serving/long_1.26gib_fp8_int4_repeats_h200.json" 2>&1 | quiet 10
}

long-partials() {
  QUANTMLA_PARTIALS=fp16 timeout 300 python3 -m quantmla.cli serve-bench --job long --budgets-gib 1.26 --methods fp8 \
    int4/int4 "${GRP[@]}" --out "$OUT/serving/long_1.26gib_partials_fp16_h200.json" 2>&1 | quiet 8
  QUANTMLA_PARTIALS=fp32 timeout 200 python3 -m quantmla.cli serve-bench --job long --budgets-gib 1.26 --methods int4/int4 \
    "${GRP[@]}" --out "$OUT/serving/long_1.26gib_partials_fp32_h200.json" 2>&1 | quiet 8
}

long() {
  timeout 480 python3 -m quantmla.cli serve-bench --job long --budgets-gib 5.04 --methods bf16 fp8 int4/int4 int2/int4 \
    int4/int4-page int2/int4-page "${GRP[@]}" --max-batched-tokens 16384 --out "$OUT/serving/long_5.04gib_h200.json" 2>&1 | quiet 10
}

longest() {
  timeout 290 python3 -m quantmla.cli serve-bench --job longest --budgets-gib 14.95 --methods bf16 fp8 int4/int4 int2/int4 \
    "${GRP[@]}" --max-batched-tokens 16384 --out "$OUT/serving/longest_14.95gib_h200.json" 2>&1 | quiet 8
}

serve-cli() {
  local work
  work=$(mktemp -d)
  python3 - <<'PY' > "$work/prompts.txt"
import random
random.seed(0)
words = "the cache holds a latent and a rope key per token for every layer of the model".split()
for i in range(48):
    print(" ".join(random.choice(words) for _ in range(random.randint(20, 200))))
PY
  for fmt in "" "--content-bits 4 --rope-bits 4" "--content-bits 2 --rope-bits 4"; do
    /usr/bin/time -f "serve [$fmt]: %e s wall" timeout 120 python3 -m quantmla.cli serve $M --prompts "$work/prompts.txt" \
      --out "$work/out.jsonl" --kv-budget-gib 0.002 --max-new-tokens 96 $fmt --no-progress 2>&1 | grep -v "Loading" \
      | tail -3 | tee -a "$LOG"
    python3 -c "import json, sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(len(r), 'outputs,', sum(x['finish_reason']!='error' for x in r), 'ok,', sum(len(x['output_ids']) for x in r), 'tokens')" \
      "$work/out.jsonl" | tee -a "$LOG"
  done
}

decode-profile() {
  timeout 150 python3 -m quantmla_lab.bench.serving.step_profile --methods bf16 int4/int4 --out "$OUT/profile/decode_batch64_h200.json" 2>&1 | quiet 60
  for b in 1 8; do
    timeout 150 python3 -m quantmla_lab.bench.serving.step_profile --batch $b --prompt 1900 --steps 24 --methods bf16 int4/int4 "${GRP[@]}" \
      --out "$OUT/profile/decode_batch${b}_h200.json" 2>&1 | quiet 40
  done
}

step-grid() {
  timeout 300 python3 -m quantmla_lab.bench.serving.step_grid --eager --warm 3 --max-seconds 240 --out "$OUT/profile/step_grid_h200.json" \
    2>&1 | quiet 56
}

prefill-rates() {
  timeout 200 python3 -m quantmla_lab.bench.serving.step_profile --phase prefill --batched-tokens 16384 --batch 4 \
    --prompt 20480 --steps 4 --kv-budget-gib 8 --methods bf16 int4/int4 "${GRP[@]}" \
    --out "$OUT/prefill/rates_long_h200.json" 2>&1 | quiet 40
}

prefill-profile() {
  for T in 2048 8192; do
    timeout 100 python3 -m quantmla_lab.bench.serving.step_profile --phase prefill --batched-tokens $T --batch 16 --prompt 2048 \
      --steps $((32768 / T / 2)) --methods bf16 int4/int4 "${GRP[@]}" --out "$OUT/prefill/profile_${T}_tokens_h200.json" 2>&1 \
      | quiet 36
  done
  timeout 120 python3 -m quantmla_lab.bench.serving.step_profile --phase prefill --batched-tokens 2048 --batch 6 --prompt 1531 --steps 3 \
    --methods bf16 int4/int4 "${GRP[@]}" --shapes 25 --out "$OUT/prefill/profile_1531_tokens_h200.json" 2>&1 | quiet 90
}

prefill-kernel() {
  timeout 150 python3 -m quantmla_lab.bench.serving.step_anatomy --skip-anatomy --out "$OUT/prefill/attention_variants_h200.json" 2>&1 | quiet 12
}

prefill-split() {
  timeout 150 python3 -m quantmla_lab.bench.serving.step_anatomy --skip-anatomy --kernel-only \
    --prefill-shapes 16384x16384 4096x20480 8192x8192 1536x1536 --out "$OUT/prefill/split_diagonal_h200.json" 2>&1 | quiet 6
}

prefill-tilings() {
  timeout 150 python3 -m quantmla_lab.bench.serving.step_anatomy --skip-anatomy --kernel-only \
    --prefill-shapes 16384x16384 4096x20480 2048x18432 4096x4096 1536x1536 \
    --prefill-configs "M128 N64 w8 s3" "M128 N64 w8 s3 tma" "M64 N64 w4 s2 tma" "M128 N64 w8 s4 tma" "M128 N128 w8 s2 tma" \
    --out "$OUT/prefill/tilings_tma_h200.json" 2>&1 | grep "^{'n'" | tee -a "$LOG"
}

prefill-sdpa() {
  timeout 300 python3 -m quantmla_lab.bench.serving.prefill_sdpa --out "$OUT/prefill/sdpa_backends_h200.json" 2>&1 \
    | quiet 40
}

host-profile() {
  timeout 300 python3 -m quantmla_lab.bench.serving.host_profile --prompt 20000 --batched-tokens 16384 \
    --kv-budget-gib 1.26 --methods bf16 fp8 int4/int4 \
    --out "$OUT/profile/host_prefill_steps_h200.json" 2>&1 | quiet 120
}

projection-gemms() {
  timeout 200 python3 -m quantmla_lab.bench.serving.projection_gemms --rows 1 8 32 64 --triton \
    --out "$OUT/profile/projection_gemms_triton_h200.json" 2>&1 | quiet 200
}

step-grid-merged() {
  timeout 200 python3 -m quantmla_lab.bench.serving.step_grid --eager --warm 3 --max-seconds 140 --top 20 \
    --out "$OUT/profile/step_grid_merged_h200.json" 2>&1 | quiet 56
  timeout 100 python3 -m quantmla_lab.bench.serving.step_grid --eager --warm 3 --batches 1 32 --contexts 16384 \
    --no-merged-projections --top 20 --out "$OUT/profile/step_grid_merged_off_h200.json" 2>&1 | quiet 14
}

step-grid-graphs() {
  timeout 150 python3 -m quantmla_lab.bench.serving.step_grid --batches 1 32 --contexts 16384 --warm 12 \
    --top 30 --out "$OUT/profile/step_grid_graphs_h200.json" 2>&1 | quiet 14
  timeout 150 python3 -m quantmla_lab.bench.serving.step_grid --batches 1 32 --contexts 16384 --warm 12 \
    --no-overlap --top 30 --out "$OUT/profile/step_grid_graphs_no_overlap_h200.json" 2>&1 | quiet 14
}

graph-units-grid() {
  for u in length rows; do
    timeout 200 python3 -m quantmla_lab.bench.serving.step_grid --batches 5 8 9 13 16 --contexts 16384 --warm 12 \
      --graph-units $u --out "$OUT/profile/step_grid_graph_units_${u}_h200.json" 2>&1 | quiet 24
  done
}

graph-units-long() {
  for u in length rows; do
    timeout 280 python3 -m quantmla.cli serve-bench --job long --budgets-gib 1.26 --methods fp8 int4/int4 int2/int4 \
      "${GRP[@]}" --graph-units $u --out "$OUT/serving/long_1.26gib_graph_units_${u}_h200.json" 2>&1 | quiet 8
  done
}

prefill-graph-cap() {
  timeout 400 python3 -m quantmla.cli serve-bench --job long --budgets-gib 1.26 --methods bf16 fp8 int4/int4 int2/int4 \
    "${GRP[@]}" --prefill-graph-max 16384 --out "$OUT/serving/long_1.26gib_prefill_graphs_16384_h200.json" 2>&1 | quiet 8
}

mixed-decode-graphs() {
  timeout 400 python3 -m quantmla.cli serve-bench --job long --budgets-gib 1.26 --methods fp8 int4/int4 int2/int4 \
    "${GRP[@]}" --mixed-decode-graphs 8192 --out "$OUT/serving/long_1.26gib_mixed_decode_graphs_h200.json" 2>&1 | quiet 8
}

long-chunks-4096() {
  timeout 290 python3 -m quantmla.cli serve-bench --job long --budgets-gib 1.26 --methods fp8 int4/int4 "${GRP[@]}" \
    --max-batched-tokens 4096 --out "$OUT/serving/long_1.26gib_chunks_4096_h200.json" 2>&1 | quiet 8
}

long-chunks-8192() {
  timeout 260 python3 -m quantmla.cli serve-bench --job long --budgets-gib 1.26 --methods fp8 int4/int4 "${GRP[@]}" \
    --max-batched-tokens 8192 --out "$OUT/serving/long_1.26gib_chunks_8192_h200.json" 2>&1 | quiet 8
}

long-chunks() {
  long-chunks-4096
  long-chunks-8192
}

long-at() {
  timeout 560 python3 -m quantmla.cli serve-bench --job long --budgets-gib "$1" --methods bf16 fp8 int4/int4 int2/int4 \
    "${GRP[@]}" --out "$OUT/serving/long_${1}gib_h200.json" 2>&1 | quiet 8
}

long-0.98() { long-at 0.98; }
long-1.14() { long-at 1.14; }

long-budgets() {
  long-0.98
  long-1.14
}

short-0.1() {
  timeout 400 python3 -m quantmla.cli serve-bench --job short --budgets-gib 0.1 --methods bf16 fp8 int4/int4 int2/int4 \
    "${GRP[@]}" --out "$OUT/serving/short_0.1gib_h200.json" 2>&1 | quiet 8
}

step-grid-ctas() {
  local k
  for k in 1 2; do
    timeout 270 python3 -m quantmla_lab.bench.serving.step_grid --cuda-graphs --batches 4 7 13 --contexts 20480 \
      --methods fp8 int4/int4 --warm 12 --ctas-per-sm "$k" --top 20 --max-seconds 200 \
      --out "$OUT/profile/step_grid_long_ctas${k}_h200.json" 2>&1 | quiet 10
  done
}

step-grid-full() {
  timeout 400 python3 -m quantmla_lab.bench.serving.step_grid --max-seconds 330 --top 20 \
    --out "$OUT/profile/step_grid_full_graphs_h200.json" 2>&1 | quiet 56
}

step-grid-2k() {
  timeout 150 python3 -m quantmla_lab.bench.serving.step_grid --batches 1 8 --contexts 2048 --top 20 --max-seconds 120 \
    --out "$OUT/profile/step_grid_2k_h200.json" 2>&1 | quiet 14
}

step-anatomy() {
  timeout 200 python3 -m quantmla_lab.bench.serving.step_anatomy --out "$OUT/step_overhead/step_anatomy_h200.json" 2>&1 | quiet 12
}

step-overhead() {
  timeout 240 python3 -m quantmla_lab.bench.serving.step_overhead --out "$OUT/step_overhead/splits_128_h200.json" 2>&1 | quiet 6
}

splits-ab() {
  timeout 300 python3 -m quantmla_lab.bench.serving.step_overhead --methods bf16 int4/int4 int2/int4 --batches 1 4 8 16 --min-chunks 256 128 \
    --out "$OUT/step_overhead/splits_256_vs_128_h200.json" 2>&1 | quiet 26
}

splits-64() {
  timeout 300 python3 -m quantmla_lab.bench.serving.step_overhead --methods bf16 int4/int4 int2/int4 --batches 1 4 8 --min-chunks 128 64 \
    --out "$OUT/step_overhead/splits_128_vs_64_h200.json" 2>&1 | quiet 20
}

decode-splits() {
  timeout 240 python3 -m quantmla_lab.bench.kernels.decode_splits --out "$OUT/decode_splits/h200.json" 2>&1 | quiet 22
}

capture-cost() {
  timeout 200 python3 -m quantmla_lab.bench.serving.capture_cost $M --out "$OUT/capture_cost/fresh_machine_h200.json" 2>&1 | grep -v "Loading" \
    | quiet 40
  echo "-- again, in a new process: Triton's on-disk cache now holds every kernel" | tee -a "$LOG"
  timeout 200 python3 -m quantmla_lab.bench.serving.capture_cost $M --out "$OUT/capture_cost/triton_cache_warm_h200.json" 2>&1 | grep -v "Loading" \
    | quiet 40
}

warm-cold() {
  timeout 200 python3 -m quantmla_lab.bench.serving.warm_vs_cold $M --out "$OUT/capture_cost/warm_cold_h200.json" 2>&1 | grep -v "Loading" \
    | quiet 8
}

for s in "$@"; do
  echo "== $(date -u +%T) $s" | tee -a "$LOG"
  "$s"
done
echo "== $(date -u +%T) done" | tee -a "$LOG"
