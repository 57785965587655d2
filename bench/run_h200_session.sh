#!/usr/bin/env bash
# GPU measurements of sessions 2 and 3 (2026-11-29/30), one named step per argument, in the order given:
#
#   OUT=... bash bench/run_h200_session.sh check profile stream accuracy serving scaling kernel-shapes
#
# check          serving agreement with generate() on the shipped models (bf16, int4/int4, int2/int4)
# profile        per-kernel GPU time of decode steps (bench/profile_serving.py)
# stream         `quantmla calibrate` in memory, streamed (1 process) and streamed over NCCL (2 processes;
#                needs 2 GPUs): the two streamed outputs must be byte-identical
# accuracy       the QuantMLA rows of all four reference models (n=50), merged into a copy of results/
# serving        serve-bench at groups 128/64 over 0.25/0.5/1 GiB budgets
# scaling        bench/calibration_scaling.py on the GPU (+ one DeepSeek-V3-geometry layer)
# kernel-shapes  decode-kernel configs at serving shapes (16 heads)
# prefill        per-kernel GPU time of prefill steps at 2048 and 8192 batched tokens (session 3)
# serving3       serve-bench at groups 128/64 over 0.1/0.125/0.25/0.5/1 GiB, 8192 batched tokens (session 3)
# gputests       the GPU cases of the read / graph-schedule / engine tests (session 3)
# serving0125    serve-bench at 0.125 GiB only, after the prefill-graph bucket and probe changes (session 3)
# prefill5       per-kernel and per-op (with shapes) GPU time of 1531-token prefill chunks (session 4)
# prefill-kernel the prefill attention variants and kernel configs (bench/step_anatomy.py --skip-anatomy)
# serving01      serve-bench at 0.1 GiB only (session 4)
# serve-cli      `quantmla serve` on a shipped model, 48 prompts under a 2 MiB KV budget, three formats (session 4)
# serve-warm     one small job twice per engine (graphs captured on first use, then all captured) and without graphs
# profile-small  per-kernel GPU time of decode steps at batch 1 and 8, 1900-token contexts, groups 128/64 (session 5)
# overhead       graph decode step wall time against its GPU time (bench/step_overhead.py; session 5)
# shapes         serve-bench on the two job shapes the projection rates best for INT4/INT4 (session 5)
# capture        each CUDA-graph capture of a short serve job timed, and the Triton variants it compiled (session 5)
# splits         decode kernel latency at batches 1-16 of 1900 tokens against the shortest split (session 5)
# splits-ab      graph step GPU time with 256- and 128-token decode split floors, three formats (session 5)
# serving4       the whole curve at HEAD down to 0.075 GiB, where BF16 runs one request at a time (next session)
#
# Session 2 ran: [check profile stream scaling] (stream failed: CUDA/CPU mix, fixed), [kernel-shapes
# profile] (stream failed again, fixed), [stream accuracy], [accuracy serving scaling], each one call on
# nvidia-h200-x2; results under bench/results/ and results/.
# Session 3 ran (nvidia-h200): [check prefill serving3], [bench/step_anatomy.py], [check serving3],
# [gputests check serving3], [gputests check serving0125]; results under bench/results/session3/.
# Session 4 ran (nvidia-h200): [gputests check prefill5], [gputests prefill-kernel check serving01],
# [gputests serving4], [check serve-cli], [serve-warm serving01], [gputests serve-warm]; results under
# bench/results/session4/ (serving4's curve is bench/results/serving_h200.json).
# Session 5 ran (nvidia-h200): [gputests check profile-small], [overhead shapes], [capture] twice (the first
# with a scan inside its timings), [splits], [gputests serving01] twice, [splits-ab]; results under
# bench/results/session5/.
# Next: [check serving4] (about 12 min): the check with its new engine_logic rows on the H200, and the
# whole curve at HEAD (128-token decode splits).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONPATH=src PYTHONUNBUFFERED=1
LOG="$OUT/session.log"
M=models/qmla-ref-deepseek-v3
step() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }

check() {
  timeout 150 python3 -m quantmla.cli serve-bench --check-only --check-families deepseek_v2 \
    --check-methods bf16 int4/int4 int2/int4 --out "$OUT/serving_check_h200.json" 2>&1 | tail -25 | tee -a "$LOG"
}

profile() {
  timeout 150 python3 bench/profile_serving.py --out "$OUT/profile_serving_h200.json" 2>&1 | grep -v -i warn | tail -60 | tee -a "$LOG"
}

stream() {
  /usr/bin/time -f "calibrate cuda: %e s wall" timeout 120 python3 -m quantmla.cli calibrate $M --content-bits 4 \
    --rope-bits 4 --device cuda --out /tmp/cal_mem --no-progress 2>&1 | grep -v "Loading\|Writing" | tail -9 | tee -a "$LOG"
  /usr/bin/time -f "stream 1 proc cuda: %e s wall" timeout 100 python3 -m quantmla.cli calibrate $M --content-bits 4 \
    --rope-bits 4 --device cuda --stream --out /tmp/cal_s1 --no-progress > /tmp/s1.log 2>&1; tail -12 /tmp/s1.log | tee -a "$LOG"
  /usr/bin/time -f "stream 2 proc nccl: %e s wall" timeout 120 python3 -m quantmla.cli calibrate $M --content-bits 4 \
    --rope-bits 4 --device cuda --stream --nproc 2 --out /tmp/cal_s2 --no-progress > /tmp/s2.log 2>&1
  grep -v "unbatched P2P" /tmp/s2.log | tail -12 | tee -a "$LOG"
  python3 - <<'PY' 2>&1 | tee -a "$LOG"
import datetime, glob, hashlib, json, os, torch
def digest(d):
    return {os.path.basename(f): hashlib.sha256(open(f, "rb").read()).hexdigest()[:16]
            for f in sorted(glob.glob(d + "/*.safetensors"))}
def qc(d):
    p = d + "/config.json"
    return json.load(open(p))["quantization_config"] if os.path.exists(p) else None
a, b, qa, qb = digest("/tmp/cal_s1"), digest("/tmp/cal_s2"), qc("/tmp/cal_s1"), qc("/tmp/cal_s2")
r = {"device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
     "command": "quantmla calibrate models/qmla-ref-deepseek-v3 --content-bits 4 --rope-bits 4 --device cuda --stream "
                "[--nproc 2] (bench/run_h200_session.sh stream)",
     "stream_1proc": a, "stream_2proc_nccl": b, "shards_identical": a == b and len(a) > 1,
     "config_identical": qa == qb and qa is not None, "rope_offsets_slots": sorted((qa or {}).get("rope_offsets", {}))}
print(r)
json.dump(r, open(os.environ.get("OUT", "/tmp/out") + "/nccl_equality_h200.json", "w"), indent=1)
PY
}

accuracy() {
  rm -rf /tmp/acc && mkdir -p /tmp/acc && cp results/accuracy.json /tmp/acc/
  timeout 200 python3 -m quantmla.cli eval --all --config INT4/INT4 INT2/INT4 --method quantmla --device cuda \
    --out /tmp/acc 2>&1 | grep "bpb\|rror" | tail -12 | tee -a "$LOG"
  cp /tmp/acc/accuracy.json /tmp/acc/accuracy.md "$OUT/"
}

serving() {
  timeout 230 python3 -m quantmla.cli serve-bench --requests 64 --budgets-gib 0.25 0.5 1 --content-group 128 \
    --rope-group 64 --max-seconds 170 --out "$OUT/serving_h200.json" 2>&1 | grep -v -i warn | tail -16 | tee -a "$LOG"
}

scaling() {
  timeout 170 python3 bench/calibration_scaling.py --device cuda --in-process --with-dsv3 --time-limit 150 \
    --out "$OUT/calibration_scaling_cuda.json" 2>&1 | tail -14 | tee -a "$LOG"
}

kernel-shapes() {
  timeout 240 python3 -m quantmla.cli bench-kernel --heads 16 --methods int4/int4,int2/int4 \
    --shapes 64x1536,20x2048,6x2048,32x16384 --sweep-shape 64x1536 --out "$OUT/kernel_serving_shapes_h200.json" 2>&1 \
    | grep -v "^check " | tail -30 | tee -a "$LOG"
}

prefill() {
  for T in 2048 8192; do
    timeout 100 python3 bench/profile_serving.py --phase prefill --batched-tokens $T --batch 16 --prompt 2048 \
      --steps $((32768 / T / 2)) --methods bf16 int4/int4 --content-group 128 --rope-group 64 \
      --out "$OUT/profile_prefill_${T}_h200.json" 2>&1 | grep -v -i warn | tail -36 | tee -a "$LOG"
  done
}

gputests() {
  timeout 150 python3 -m pytest -q -x tests/test_kernels.py tests/test_serving.py tests/test_kernels_gpu.py \
    -k "read_matches or static_graph or on_gpu or prefill" 2>&1 | tail -5 | tee -a "$LOG"
}

serving0125() {
  timeout 200 python3 -m quantmla.cli serve-bench --requests 64 --budgets-gib 0.125 --content-group 128 \
    --rope-group 64 --max-batched-tokens 8192 --out "$OUT/serving_h200_0125.json" 2>&1 | grep -v -i warn \
    | tail -8 | tee -a "$LOG"
}

prefill5() {
  timeout 120 python3 bench/profile_serving.py --phase prefill --batched-tokens 2048 --batch 6 --prompt 1531 \
    --steps 3 --methods bf16 int4/int4 --content-group 128 --rope-group 64 --shapes 25 \
    --out "$OUT/profile_prefill_1531_h200.json" 2>&1 | grep -v -i warn | tail -90 | tee -a "$LOG"
}

prefill-kernel() {
  timeout 150 python3 bench/step_anatomy.py --skip-anatomy --out "$OUT/prefill_attention_h200.json" 2>&1 \
    | grep -v -i warn | tail -12 | tee -a "$LOG"
}

serving01() {
  timeout 300 python3 -m quantmla.cli serve-bench --requests 64 --budgets-gib 0.1 --content-group 128 \
    --rope-group 64 --max-batched-tokens 8192 --out "$OUT/serving_h200_01.json" 2>&1 | grep -v -i warn \
    | tail -8 | tee -a "$LOG"
}

serve-cli() {
  python3 - <<'PY' > /tmp/prompts.txt
import random
random.seed(0)
words = "the cache holds a latent and a rope key per token for every layer of the model".split()
for i in range(48):
    print(" ".join(random.choice(words) for _ in range(random.randint(20, 200))))
PY
  for fmt in "" "--content-bits 4 --rope-bits 4" "--content-bits 2 --rope-bits 4"; do
    /usr/bin/time -f "serve [$fmt]: %e s wall" timeout 120 python3 -m quantmla.cli serve $M --prompts /tmp/prompts.txt \
      --out /tmp/serve_out.jsonl --kv-budget-gib 0.002 --max-new-tokens 96 $fmt --no-progress 2>&1 | grep -v "Loading" \
      | tail -3 | tee -a "$LOG"
    python3 -c "import json; r=[json.loads(l) for l in open('/tmp/serve_out.jsonl')]; print(len(r), 'outputs,', sum(x['finish_reason']!='error' for x in r), 'ok,', sum(len(x['output_ids']) for x in r), 'tokens')" | tee -a "$LOG"
  done
}

serve-warm() {
  timeout 200 python3 bench/serve_warm_vs_cold.py $M --out "$OUT/serve_warm_cold_h200.json" 2>&1 | grep -v "Loading\|warn" \
    | tail -8 | tee -a "$LOG"
}

profile-small() {
  for b in 1 8; do
    timeout 150 python3 bench/profile_serving.py --batch $b --prompt 1900 --steps 24 --methods bf16 int4/int4 \
      --content-group 128 --rope-group 64 --out "$OUT/profile_decode_b${b}_h200.json" 2>&1 | grep -v -i warn \
      | tail -40 | tee -a "$LOG"
  done
}

overhead() {
  timeout 240 python3 bench/step_overhead.py --out "$OUT/step_overhead_h200.json" 2>&1 | grep -v -i warn | tail -6 | tee -a "$LOG"
}

shapes() {  # the two job shapes where the session-4 projection puts INT4/INT4 highest (4.45x, 4.36x)
  timeout 280 python3 -m quantmla.cli serve-bench --requests 64 --prompt-len 3072 4096 --output-len 256 384 \
    --budgets-gib 0.1817 --content-group 128 --rope-group 64 --max-batched-tokens 8192 \
    --out "$OUT/serving_shape_p3072_h200.json" 2>&1 | grep -v -i warn | tail -6 | tee -a "$LOG"
  timeout 200 python3 -m quantmla.cli serve-bench --requests 64 --prompt-len 256 512 --output-len 256 384 \
    --budgets-gib 0.0273 --content-group 128 --rope-group 64 --max-batched-tokens 8192 \
    --out "$OUT/serving_shape_p256_h200.json" 2>&1 | grep -v -i warn | tail -6 | tee -a "$LOG"
}

capture() {
  timeout 200 python3 bench/capture_cost.py $M --out "$OUT/capture_cost_h200.json" 2>&1 | grep -v "Loading\|warn" \
    | tail -40 | tee -a "$LOG"
  echo "-- again, in a new process: Triton's on-disk cache now holds every kernel" | tee -a "$LOG"
  timeout 200 python3 bench/capture_cost.py $M --out "$OUT/capture_cost_cached_h200.json" 2>&1 | grep -v "Loading\|warn" \
    | tail -40 | tee -a "$LOG"
}

splits() {
  timeout 240 python3 bench/decode_splits.py --out "$OUT/decode_splits_h200.json" 2>&1 | grep -v -i warn | tail -22 \
    | tee -a "$LOG"
}

splits-ab() {  # 256- against 128-token decode split floors, whole graph steps, one process
  timeout 300 python3 bench/step_overhead.py --methods bf16 int4/int4 int2/int4 --batches 1 4 8 16 \
    --min-chunks 256 128 --out "$OUT/step_overhead_splits_h200.json" 2>&1 | grep -v -i warn | tail -26 | tee -a "$LOG"
}

serving4() {
  timeout 545 python3 -m quantmla.cli serve-bench --requests 64 --budgets-gib 0.075 0.1 0.125 0.25 0.5 1 \
    --content-group 128 --rope-group 64 --max-batched-tokens 8192 --max-seconds 440 --out "$OUT/serving_h200.json" \
    2>&1 | grep -v -i warn | tail -24 | tee -a "$LOG"
}

serving3() {
  timeout 500 python3 -m quantmla.cli serve-bench --requests 64 --budgets-gib 0.1 0.125 0.25 0.5 1 --content-group 128 \
    --rope-group 64 --max-batched-tokens 8192 --max-seconds 400 --out "$OUT/serving_h200.json" 2>&1 | grep -v -i warn \
    | tail -20 | tee -a "$LOG"
}

for s in "$@"; do
  step "$s"
  "$s"
done
step done
