#!/usr/bin/env bash
# Calibration on the GPU: does the streamed run over NCCL write the same files as one process, what do
# the calibrated reference models score, and how does calibration time scale? One named step per
# argument, in order:
#
#   QUANTMLA_COMMIT=$(git rev-parse --short HEAD) OUT=/tmp/out bash lab/scripts/calibration_on_h200.sh streamed-nccl accuracy scaling
#
# streamed-nccl  `quantmla calibrate --stream` of qmla-ref-deepseek-v3 (INT4/INT4) in one process and over
#                NCCL in two (needs 2 GPUs); the shards must be byte-identical
#                                                   -> calibration_scaling/streamed_nccl_equality_h200.json
# accuracy       the QuantMLA rows of all four reference models, merged into a copy of results/accuracy.json
#                                                   -> accuracy/accuracy.json, accuracy/accuracy.md
# ablations      the DeepSeek-groups table's remaining rows (FP8; RTN and the single-path ablations at INT4/INT4
#                and INT2/INT4), five models side by side (the DeepSeek-geometry model must be unpacked in
#                models/), merged with results/deepseek_groups/accuracy.json
#                                                   -> deepseek_groups/accuracy.json, deepseek_groups/accuracy.md
# budget-mix     the DeepSeek-groups table's row MIX2.5@g64/INT4:quantmla-rope-channel (INT2/INT4 with the layer the
#                error model picks at INT4/g64: the baselines' 72 B per token), the four shipped models side by side,
#                merged with results/deepseek_groups/accuracy.json
#                                                   -> deepseek_groups/accuracy.json, deepseek_groups/accuracy.md
# retrieval-600  key retrieval with 600 samples per length (the held-out set's first 200 and 400 more): BF16,
#                INT4/INT4 quantmla-rope-channel, MIX2.5@g64/INT4 quantmla-rope-channel, INT4/INT4 KIVI-style, four
#                shipped models side by side, groups 32/16          -> retrieval_600/accuracy.json, accuracy.md
# rope-block     INT4/INT4 and INT2/INT4 quantmla-rope-channel with the RoPE scales per channel per 16-token block
#                (--rope-block 16: the KIVI-style baseline's 104 and 72 B a token at groups 32/16), 600 retrieval samples
#                per length (the same as retrieval-600's), four shipped models side by side
#                                                   -> rope_block/accuracy.json, accuracy.md
# calib-len      the same INT4/INT4 row calibrated on 8 rows of 1024 tokens (--calib-len 1024)
#                                                   -> rope_block_long_calibration/accuracy.json, accuracy.md
# rope-block-default  the same two rows at the default groups 64/32 with 32-token blocks (the KIVI-style baseline's
#                92 and 60 B a token), 200 retrieval samples   -> rope_block_default_groups/accuracy.json, accuracy.md
# prose-a, prose-b  the issue's rows on the held-out prose at g32/g16 with 200 retrieval samples per length (the CPU
#                table in results/prose_groups/ has 16 chunks and 20 samples; quantmla-rope-channel at 16-token RoPE
#                blocks, the baselines' bytes), in two calls of about 5 minutes
#                                                   -> prose_groups_gpu_a/, prose_groups_gpu_b/; results/prose_groups_gpu/ is
#                the two merged: quantmla eval --from-json OUT/prose_groups_gpu_{a,b}/accuracy.json --out results/prose_groups_gpu
# window-a, window-b  the same rows with a 64-token full-precision window for every method, held-out code
#                                                   -> window_groups_gpu_a/, window_groups_gpu_b/ (merged the same way
#                into results/window_groups_gpu/)
# window-decode-reads  window rows read as decode steps read them (KIVI-style, Hadamard, QuantMLA, and
#                quantmla-rope-channel at 16-token blocks; WDR_GROUPS="kivi2 rc4 rc2": the three rows
#                results/window_decode_reads_gpu lacks, a row a process): a process a model and group, one thread
#                each, merged
#                                                   -> window_decode_reads_gpu_rest/ (merge it with the committed rows:
#                quantmla eval --from-json results/window_decode_reads_gpu/accuracy.json
#                OUT/window_decode_reads_gpu_rest/accuracy.json --out results/window_decode_reads_gpu)
# default-groups the same rows as window-a and the single-path ablations at the default groups 64/32, no window, 200
#                retrieval samples per length (quantmla-rope-channel at these groups is rope-block-default's)
#                                                   -> default_groups_gpu/accuracy.json, accuracy.md
# scaling        lab/quantmla_lab/bench/calibration/scaling.py on the GPU, with one DeepSeek-V3-geometry layer
#                                                   -> calibration_scaling/h200.json
#
# Files go under $OUT (default /tmp/out), named as in lab/results/ and results/.
# On a GPU other than an H200 the files a run writes are renamed when it exits (a step's failure or timeout too) to
# that GPU's tag, h100 for h200 (lab/scripts/device_names.sh); the commands recorded inside them keep the h200 paths.
set -uo pipefail
# shellcheck source=lab/scripts/device_names.sh
source "$(dirname "$0")/device_names.sh"
start_run
trap name_by_device EXIT
mkdir -p "$OUT/calibration_scaling" "$OUT/accuracy"
export TRITON_INTERPRET=0 PYTHONPATH=src:lab PYTHONUNBUFFERED=1
M=models/qmla-ref-deepseek-v3
WORK=$(mktemp -d)

streamed-nccl() {
  /usr/bin/time -f "stream 1 proc cuda: %e s wall" timeout 100 python3 -m quantmla.cli calibrate $M --content-bits 4 \
    --rope-bits 4 --device cuda --stream --out "$WORK/s1" --no-progress > "$WORK/s1.log" 2>&1; tail -12 "$WORK/s1.log"
  /usr/bin/time -f "stream 2 proc nccl: %e s wall" timeout 120 python3 -m quantmla.cli calibrate $M --content-bits 4 \
    --rope-bits 4 --device cuda --stream --nproc 2 --out "$WORK/s2" --no-progress > "$WORK/s2.log" 2>&1
  grep -v "unbatched P2P" "$WORK/s2.log" | tail -12
  WORK="$WORK" python3 - <<'PY'
import datetime, glob, hashlib, json, os, torch
work = os.environ["WORK"]
def digest(d):
    return {os.path.basename(f): hashlib.sha256(open(f, "rb").read()).hexdigest()[:16]
            for f in sorted(glob.glob(d + "/*.safetensors"))}
def qc(d):
    p = d + "/config.json"
    return json.load(open(p))["quantization_config"] if os.path.exists(p) else None
a, b, qa, qb = digest(work + "/s1"), digest(work + "/s2"), qc(work + "/s1"), qc(work + "/s2")
r = {"device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
     "command": "quantmla calibrate models/qmla-ref-deepseek-v3 --content-bits 4 --rope-bits 4 --device cuda --stream "
                "[--nproc 2] (lab/scripts/calibration_on_h200.sh streamed-nccl)",
     "stream_1proc": a, "stream_2proc_nccl": b, "shards_identical": a == b and len(a) > 1,
     "config_identical": qa == qb and qa is not None, "rope_offsets_slots": sorted((qa or {}).get("rope_offsets", {}))}
print(r)
json.dump(r, open(os.environ.get("OUT", "/tmp/out") + "/calibration_scaling/streamed_nccl_equality_h200.json", "w"), indent=1)
PY
}

accuracy() {
  cp results/accuracy.json "$WORK/"
  timeout 200 python3 -m quantmla.cli eval --all --config INT4/INT4 INT2/INT4 --method quantmla --device cuda \
    --out "$WORK" 2>&1 | grep "bpb\|rror" | tail -12
  cp "$WORK/accuracy.json" "$WORK/accuracy.md" "$OUT/accuracy/"
}

# `quantmla eval` of NAME's rows (the arguments after NAME) on the GPU, one process per model side by side
# (MODELS, default the four shipped ones; GRP, default 32/16; the DeepSeek-geometry model at groups 128/32), N
# retrieval samples per length (default 200), EXTRA arguments for every model, merged with MERGE (default
# results/deepseek_groups/accuracy.json; empty: none) into $OUT/DEST (default deepseek_groups), the models' logs
# (progress bars left out) in $OUT/DEST/eval.log
side_by_side() {
  local name=$1 m pids=() jsons=() dest=${DEST:-deepseek_groups} merge=${MERGE-results/deepseek_groups/accuracy.json}
  shift
  for m in ${MODELS:-deepseek-v2 deepseek-v3 minicpm3 glm4-moe-lite}; do
    local groups=${GRP:-32/16}
    [ "$m" = deepseek-v2-deepseek-geometry ] && groups=128/32
    OMP_NUM_THREADS=${THREADS:-3} timeout "${EVAL_TIMEOUT:-470}" python3 -m quantmla.cli eval "qmla-ref-$m" --rows "$@" \
      ${EXTRA:-} --groups $groups --retrieval-n "${N:-200}" --device cuda --calib-device cuda --out "$WORK/$name/$m" \
      > "$WORK/${name}_$m.log" 2>&1 &
    pids+=($!)
    jsons+=("$WORK/$name/$m/accuracy.json")
  done
  wait "${pids[@]}"
  grep -h "bpb\|rror" "$WORK"/"${name}"_*.log | tail -50
  mkdir -p "$WORK/merged_$name"
  [ -n "$merge" ] && cp "$merge" "$WORK/merged_$name/accuracy.json" && jsons=("$WORK/merged_$name/accuracy.json" "${jsons[@]}")
  python3 -m quantmla.cli eval --from-json "${jsons[@]}" --out "$OUT/$dest" | tail -3
  mkdir -p "$OUT/$dest" && for f in "$WORK"/"${name}"_*.log; do echo "== $f"; grep -v "it/s\]" "$f"; done > "$OUT/$dest/eval.log"
}

ablations() {
  MODELS="deepseek-v2 deepseek-v3 minicpm3 glm4-moe-lite deepseek-v2-deepseek-geometry" side_by_side ablations \
    FP8:rtn INT4/INT4:rtn INT2/INT4:rtn INT4/INT4:quantmla-rope INT2/INT4:quantmla-rope INT4/INT4:quantmla-content \
    INT2/INT4:quantmla-content INT4/INT4:quantmla-content-rope-channel INT2/INT4:quantmla-content-rope-channel
}

budget-mix() {
  side_by_side budget_mix MIX2.5@g64/INT4:quantmla-rope-channel
}

retrieval-600() {
  N=600 DEST=retrieval_600 MERGE= EVAL_TIMEOUT=${EVAL_TIMEOUT:-500} side_by_side retrieval_600 BF16:bf16 \
    INT4/INT4:quantmla-rope-channel MIX2.5@g64/INT4:quantmla-rope-channel INT4/INT4:kivi
}

rope-block() {
  N=600 DEST=rope_block MERGE= EVAL_TIMEOUT=${EVAL_TIMEOUT:-540} EXTRA="--rope-block 16" side_by_side rope_block \
    INT4/INT4:quantmla-rope-channel INT2/INT4:quantmla-rope-channel
}

calib-len() {
  N=600 DEST=rope_block_long_calibration MERGE= EVAL_TIMEOUT=${EVAL_TIMEOUT:-540} EXTRA="--rope-block 16 --calib-len 1024 --calib-n 8" \
    side_by_side calib_len INT4/INT4:quantmla-rope-channel
}

rope-block-default() {
  GRP=64/32 DEST=rope_block_default_groups MERGE= EXTRA="--rope-block 32" side_by_side rope_block_default \
    INT4/INT4:quantmla-rope-channel INT2/INT4:quantmla-rope-channel
}

ROWS_A="BF16:bf16 FP8:rtn INT4/INT4:rtn INT2/INT4:rtn INT4/INT4:kivi INT2/INT4:kivi INT4/INT4:hadamard INT2/INT4:hadamard \
  INT4/INT4:quantmla INT2/INT4:quantmla"
ROWS_B="INT4/INT4:quantmla-content INT2/INT4:quantmla-content INT4/INT4:quantmla-rope INT2/INT4:quantmla-rope \
  INT4/INT4:quantmla-rope-channel INT2/INT4:quantmla-rope-channel"
window-decode-reads() {
  local m g pids=() jsons=() dest="$OUT/window_decode_reads_gpu_rest"
  # a process a model and group; WDR_GROUPS picks groups (a row alone a process fits where a pair does not: KIVI-style
  # and quantmla-rope-channel rows take 410 s or more each with 16 processes on an H100)
  declare -A rows=([kivi]="INT4/INT4:kivi INT2/INT4:kivi" [hadamard]="INT4/INT4:hadamard INT2/INT4:hadamard"
                   [quantmla]="INT4/INT4:quantmla INT2/INT4:quantmla"
                   [rc]="INT4/INT4:quantmla-rope-channel INT2/INT4:quantmla-rope-channel --rope-block 16"
                   [kivi2]="INT2/INT4:kivi" [rc4]="INT4/INT4:quantmla-rope-channel --rope-block 16"
                   [rc2]="INT2/INT4:quantmla-rope-channel --rope-block 16")
  for m in deepseek-v2 deepseek-v3 minicpm3 glm4-moe-lite; do
    for g in ${WDR_GROUPS:-kivi hadamard quantmla rc}; do
      [ -n "${rows[$g]:-}" ] || { echo "WDR_GROUPS: unknown group $g (${!rows[*]})" >&2; return 2; }
      local calib=(--calib-device cuda)
      [[ "$g" == kivi* ]] && calib=()  # reads no calibration data: the flag is refused
      # shellcheck disable=SC2086  # the rows (and rc's --rope-block) split into arguments
      OMP_NUM_THREADS=1 timeout "${EVAL_TIMEOUT:-470}" python3 -m quantmla.cli eval "qmla-ref-$m" --rows ${rows[$g]} \
        --fp-window 64 --groups 32/16 --retrieval-n "${N:-200}" --device cuda "${calib[@]}" \
        --out "$WORK/wdr_$g/$m" > "$WORK/wdr_${g}_$m.log" 2>&1 &
      pids+=($!)
      jsons+=("$WORK/wdr_$g/$m/accuracy.json")
    done
  done
  wait "${pids[@]}"
  grep -h "bpb\|rror" "$WORK"/wdr_*.log | tail -40
  local have=() j
  for j in "${jsons[@]}"; do [ -f "$j" ] && have+=("$j"); done
  python3 -m quantmla.cli eval --from-json "${have[@]}" --out "$dest" | tail -3
  mkdir -p "$dest" && for j in "$WORK"/wdr_*.log; do echo "== $j"; grep -v "it/s\]" "$j"; done > "$dest/eval.log"
}

prose-a() { DEST=prose_groups_gpu_a MERGE= EXTRA="--kind prose" side_by_side prose_a $ROWS_A; }
prose-b() { DEST=prose_groups_gpu_b MERGE= EXTRA="--kind prose --rope-block 16" side_by_side prose_b $ROWS_B; }
window-a() { DEST=window_groups_gpu_a MERGE= EXTRA="--fp-window 64" side_by_side window_a $ROWS_A; }
default-groups() {
  GRP=64/32 DEST=default_groups_gpu MERGE= EVAL_TIMEOUT=${EVAL_TIMEOUT:-540} side_by_side default_groups $ROWS_A \
    INT4/INT4:quantmla-content INT2/INT4:quantmla-content INT4/INT4:quantmla-rope INT2/INT4:quantmla-rope
}
window-b() { DEST=window_groups_gpu_b MERGE= EXTRA="--fp-window 64 --rope-block 16" side_by_side window_b $ROWS_B; }

scaling() {
  timeout 170 python3 -m quantmla_lab.bench.calibration.scaling --device cuda --in-process --with-dsv3 --time-limit 150 \
    --out "$OUT/calibration_scaling/h200.json" 2>&1 | tail -14
}

for s in "$@"; do
  echo "== $(date -u +%T) $s"
  "$s"
done
