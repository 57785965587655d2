#!/usr/bin/env bash
# One device call on the H200: full-shape kernel tests, then `quantmla bench-kernel`.
# Writes kernel_tests_h200.log, kernel_h200.json and bench_h200.log under $OUT (default bench/results).
# Extra arguments go to bench-kernel (e.g. --peer /path/to/triton_decode_attention.py).
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONPATH=src PYTHONUNBUFFERED=1
LOG="$OUT/kernel_tests_h200.log"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$LOG"
XDIST=""
python3 -c "import xdist" 2>/dev/null && XDIST="-n ${TEST_WORKERS:-8}"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/test_kernels_gpu.py -v -rA -p no:cacheprovider $XDIST 2>&1 | tee -a "$LOG"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$LOG"
timeout "${BENCH_TIMEOUT:-330}" python3 -m quantmla.cli bench-kernel --out "$OUT/kernel_h200.json" "$@" 2>&1 | tee "$OUT/bench_h200.log"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench_h200.log"
