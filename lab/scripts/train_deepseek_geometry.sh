#!/usr/bin/env bash
# The fifth reference model: DeepSeek-V2-Lite's cache geometry (d_c 512, d_r 64, 16 heads, no query
# LoRA, deepseek_v2 family, about 10 M parameters), trained on one GPU on the same data as the four
# shipped models and evaluated in the same call. Its weights (about 20 MB) stay out of git: this
# script trains it deterministically wherever it is needed (400 s of training, as the others).
#
#   lab/scripts/train_deepseek_geometry.sh                  # train, then eval (extra args go to eval)
#   TIME_BUDGET=40 lab/scripts/train_deepseek_geometry.sh   # a short smoke run
#
# Env: PYTHON (default python3), WORK (scratch, default /tmp/quantmla-train-dsgeo), OUT_DIR (default
# /tmp/quantmla-models), RESULTS (default out/training/deepseek_geometry.json), EVAL_OUT (default
# out/eval/deepseek_geometry.json), TIME_BUDGET (training seconds, default 400).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="src:lab${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
PY=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-/tmp/quantmla-models}
"$PY" -m quantmla.cli train-reference --stage all --families deepseek_v2 --size deepseek-geometry \
  --work "${WORK:-/tmp/quantmla-train-dsgeo}" --out "$OUT_DIR" \
  --results "${RESULTS:-out/training/deepseek_geometry.json}" --time-budget "${TIME_BUDGET:-400}"
"$PY" -m quantmla.cli eval "$OUT_DIR/qmla-ref-deepseek-v2-deepseek-geometry" --device cuda \
  --out "${EVAL_OUT:-out/eval/deepseek_geometry.json}" "$@"
