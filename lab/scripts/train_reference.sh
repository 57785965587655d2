#!/usr/bin/env bash
# Reproduce the four shipped MLA reference models (deepseek_v2, deepseek_v3, minicpm3,
# glm4_moe_lite) on one GPU, all four trained in parallel processes, from the Python
# sources and docs installed on the machine (stdlib + site-packages). About 8-9 minutes on
# one H200; writes models/<name>/ (+ card.json), models/heldout/ and the run log.
#
#   lab/scripts/train_reference.sh                      # the shipped run
#   TIME_BUDGET=40 lab/scripts/train_reference.sh ...   # a short smoke run (extra args pass through)
#
# Env: PYTHON (default python3), WORK (scratch, default /tmp/quantmla-train), OUT_DIR
# (default models), RESULTS (default lab/results/training/reference_models_h200.json), TIME_BUDGET
# (training seconds per model, default 400).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="src:lab${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
PY=${PYTHON:-python3}
exec "$PY" -m quantmla.cli train-reference --stage all \
  --work "${WORK:-/tmp/quantmla-train}" \
  --out "${OUT_DIR:-models}" \
  --results "${RESULTS:-lab/results/training/reference_models_h200.json}" \
  --time-budget "${TIME_BUDGET:-400}" \
  "$@"
