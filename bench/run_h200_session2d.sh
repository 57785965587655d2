#!/usr/bin/env bash
# Device call D (nvidia-h200-x2, the session's last): QuantMLA accuracy rows with context-averaged
# RoPE-key centring (all four reference models, n=100), the serving benchmark at g128/g64 groups
# after the append-kernel change, and the calibration scaling benchmark on the GPU.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONPATH=src PYTHONUNBUFFERED=1
LOG="$OUT/session2d.log"
step() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
step "QuantMLA accuracy rows (cuda, n=100)"
rm -rf /tmp/acc && mkdir -p /tmp/acc && cp results/accuracy.json /tmp/acc/
timeout 200 python3 -m quantmla.cli eval --all --config INT4/INT4 INT2/INT4 --method quantmla --device cuda --out /tmp/acc 2>&1 \
  | grep "bpb\|rror" | tail -12 | tee -a "$LOG"
cp /tmp/acc/accuracy.json /tmp/acc/accuracy.md "$OUT/"
step "serving benchmark (g128/g64)"
timeout 230 python3 -m quantmla.cli serve-bench --requests 64 --budgets-gib 0.25 0.5 1 --content-group 128 --rope-group 64 \
  --max-seconds 170 --out "$OUT/serving_h200.json" 2>&1 | grep -v -i "warn" | tail -16 | tee -a "$LOG"
step "calibration scaling (cuda)"
timeout 170 python3 bench/calibration_scaling.py --device cuda --in-process --with-dsv3 --time-limit 150 \
  --out "$OUT/calibration_scaling_cuda.json" 2>&1 | tail -14 | tee -a "$LOG"
step done
