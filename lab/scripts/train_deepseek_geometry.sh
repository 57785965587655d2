#!/usr/bin/env bash
# The fifth reference model: DeepSeek-V2-Lite's cache geometry (d_c 512, d_r 64, 16 heads, no query
# LoRA, deepseek_v2 family, 10.3 M parameters), trained on one GPU on the data of the four shipped
# models (their tokenizer and held-out set as shipped, the training text rebuilt from the machine's
# Python sources as theirs was) and evaluated in the same call. Its weights (20.6 MB in bf16) stay out
# of git: this script trains it wherever it is needed (seeded data order and initialization; the step
# count follows the clock, as the shipped four's did).
#
#   lab/scripts/train_deepseek_geometry.sh               # GPU: train, pack, then the accuracy rows
#   lab/scripts/train_deepseek_geometry.sh eval          # GPU: the rows still missing, of models/NAME
#   lab/scripts/train_deepseek_geometry.sh unpack DIR    # CPU: the returned files into the repository
#   lab/scripts/train_deepseek_geometry.sh rows          # the eval rows, one a line, in their order
#   TIME_BUDGET=20 EVAL_DEVICE=cpu DEADLINE=100000 \
#     TRAIN_ARGS="--max-train-bytes 20e6 --batch-tokens 2048 --short-len 256 --long-len 512 --eval-retrieval-n 2" \
#     EVAL_ARGS="--ppl-chunks 2 --retrieval-n 1 --lengths 1024 --calib-n 2 --calib-steps 2" \
#     lab/scripts/train_deepseek_geometry.sh             # a CPU smoke run of every stage
#
# What the GPU run writes under OUT (7 files; the GPU tool returns at most 8, of 16 MiB each):
#   1. train: train-reference (prepare, TIME_BUDGET seconds of training, the card's BF16 figures);
#      OUT/training.json, the run log (data manifest and the model's card)
#   2. pack: the model directory (weights, tokenizer, config, card.json, README.md) as a tar in 15 MiB
#      parts, OUT/model.tar.part-00 and -01, with OUT/model.tar.sha256
#   3. eval: one `quantmla eval` call, its rows most important first, calibration fits on the GPU (a second
#      call with fits on the CPU takes the rows left if the first fails), stopped DEADLINE seconds after
#      the start; OUT/eval/accuracy.json and accuracy.md gain each row as it finishes
#   and OUT/console.log, the whole console.
# The rows (ROWS below): BF16, FP8, and at INT4/INT4 then INT2/INT4 RTN, KIVI-style, QuantMLA and
# quantmla-rope-channel at groups 128/32 (DeepSeek's groups per token: 4 content groups, 2 RoPE groups),
# then the same at 64/32 (the accuracy table's default), then Hadamard at both, then the two single-path
# ablations at 128/32 and at 64/32. `eval` mode runs the same list on models/NAME (carried to the GPU
# machine, git ignores its weights), skipping the rows the table under results/deepseek_geometry holds.
#
# Env: PYTHON (default python3), OUT (default out/deepseek_geometry), WORK (scratch, default
# /tmp/quantmla-train-dsgeo), MODELS (where the model directory is written, default /tmp/quantmla-models),
# TIME_BUDGET (training seconds, default 360), DEADLINE (seconds after the start by which the evaluation
# stops, default 540), EVAL_DEVICE (the eval's and the calibration fits' device, default cuda),
# TRAIN_ARGS (more train-reference flags), EVAL_ARGS (more eval flags, such as --retrieval-n 20: a data
# setting of its own, see `quantmla eval --help`).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="src:lab${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
PY=${PYTHON:-python3}
NAME=qmla-ref-deepseek-v2-deepseek-geometry
TABLE=results/deepseek_geometry
MODE=${1:-all}

ROWS=(BF16:bf16 FP8:rtn)
for g in 128/32 64/32; do
  for c in INT4/INT4 INT2/INT4; do
    for m in rtn kivi quantmla quantmla-rope-channel; do ROWS+=("$c:$m:$g"); done
  done
done
for g in 128/32 64/32; do for c in INT4/INT4 INT2/INT4; do ROWS+=("$c:hadamard:$g"); done; done
for g in 128/32 64/32; do
  for c in INT4/INT4 INT2/INT4; do
    for m in quantmla-content quantmla-rope; do ROWS+=("$c:$m:$g"); done
  done
done

if [[ "$MODE" == rows ]]; then
  printf '%s\n' "${ROWS[@]}"
  exit 0
fi
if [[ "$MODE" == unpack ]]; then
  # CPU: DIR holds what a GPU call wrote. The model directory goes to models/NAME (git ignores it:
  # a directory without its weights would pass for a model) and its README.md is written again from
  # card.json; the card and the run log go to lab/results/training, the console to lab/results/logs,
  # the accuracy rows to results/deepseek_geometry.
  back=${2:?usage: $0 unpack DIR}
  runs=lab/results/training logs=lab/results/logs
  if compgen -G "$back/model.tar.part-*" > /dev/null; then
    tmp=$(mktemp -d)
    cat "$back"/model.tar.part-* > "$tmp/model.tar"
    (cd "$tmp" && echo "$(cat "$back/model.tar.sha256")  model.tar" | sha256sum -c -)
    rm -rf "models/$NAME"
    tar -C models -xf "$tmp/model.tar"
    rm -r "$tmp"
    "$PY" -m quantmla_lab.training.card "models/$NAME"
  fi
  mkdir -p "$runs" "$logs" "$TABLE"
  if [[ -f "$back/training.json" ]]; then cp "$back/training.json" "$runs/deepseek_geometry_h200.json"; fi
  if [[ -f "models/$NAME/card.json" ]]; then  # the card in git; the model directory is ignored whole
    cp "models/$NAME/card.json" "$runs/deepseek_geometry_card.json"
    cp "models/$NAME/README.md" "$runs/deepseek_geometry_card.md"
  fi
  if [[ -f "$back/console.log" ]]; then
    cp "$back/console.log" "$logs/h200_$(date -r "$back/console.log" +%Y-%m-%dT%H%M).txt"
  fi
  if [[ -f "$back/eval/accuracy.json" ]]; then cp "$back/eval/accuracy.json" "$back/eval/accuracy.md" "$TABLE/"; fi
  git status --short models "$runs" "$logs" "$TABLE"
  exit 0
fi
[[ "$MODE" == all || "$MODE" == eval ]] || { echo "usage: $0 [eval | unpack DIR | rows]" >&2; exit 2; }

OUT=${OUT:-out/deepseek_geometry}
DEADLINE=${DEADLINE:-540}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/console.log") 2>&1
stage() { echo "== $(date +%H:%M:%S) +${SECONDS}s: $*"; }

if [[ "$MODE" == all ]]; then
  MODEL_DIR=${MODELS:-/tmp/quantmla-models}/$NAME
  stage "train (${TIME_BUDGET:-360}s of training)"
  # shellcheck disable=SC2086  # TRAIN_ARGS is a list of flags
  "$PY" -m quantmla.cli train-reference --stage all --families deepseek_v2 --size deepseek-geometry --jobs 0 \
    --tokenizer-from models/qmla-ref-deepseek-v2 --heldout-from models/heldout \
    --work "${WORK:-/tmp/quantmla-train-dsgeo}" --out "$(dirname "$MODEL_DIR")" --results "$OUT/training.json" \
    --time-budget "${TIME_BUDGET:-360}" ${TRAIN_ARGS:-}
  stage "pack"
  tar -C "$(dirname "$MODEL_DIR")" -cf "$MODEL_DIR.tar" "$NAME"
  sha256sum "$MODEL_DIR.tar" | cut -d' ' -f1 > "$OUT/model.tar.sha256"
  split -b 15M -d "$MODEL_DIR.tar" "$OUT/model.tar.part-"
  ls -l "$OUT"
else
  MODEL_DIR=models/$NAME
  mkdir -p "$OUT/eval"
  if [[ -f "$TABLE/accuracy.json" ]]; then cp "$TABLE/accuracy.json" "$OUT/eval/"; fi
fi

# the accuracy rows; calibration fits run on the eval device (d_c 512 makes CPU fits slow: about 6 min per
# QuantMLA calibration on 2 CPU cores); if a call fails for another reason than the deadline, the rows
# still missing run again with the fits on the CPU
run_eval() {
  local left=$((DEADLINE - SECONDS))
  if ((left < 20)); then stage "eval skipped: ${left}s left before the deadline"; return 124; fi
  stage "eval, ${#ROWS[@]} rows, calibration fits on $1 (at most ${left}s)"
  # shellcheck disable=SC2086  # EVAL_ARGS is a list of flags
  timeout -k 5 "$left" "$PY" -m quantmla.cli eval "$MODEL_DIR" --device "$EVAL_DEVICE" --calib-device "$1" \
    --out "$OUT/eval" --resume --rows "${ROWS[@]}" ${EVAL_ARGS:-}
}
EVAL_DEVICE=${EVAL_DEVICE:-cuda}
rc=0
run_eval "$EVAL_DEVICE" || rc=$?
if ((rc != 0 && rc != 124 && rc != 137)) && [[ "$EVAL_DEVICE" != cpu ]]; then
  stage "eval stopped (exit $rc): the rows left, with calibration fits on the CPU"
  rc=0
  run_eval cpu || rc=$?
fi
if ((rc != 0)); then stage "eval stopped (exit $rc)"; fi
stage "done"
