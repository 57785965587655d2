#!/usr/bin/env bash
# Are the decode kernels correct at full shapes, and how fast are they? One named step per argument, in order:
#
#   OUT=/tmp/out bash lab/scripts/kernels_on_h200.sh tests bench serving-shapes
#
# tests           the kernel tests on the GPU (full shapes, CUDA host side, interpreter tests) -> kernels/gpu_tests_h200.log
# bench           `quantmla bench-kernel`: every format against BF16 at DeepSeek shapes, with the
#                 config sweep; extra arguments after `--` go to bench-kernel   -> kernels/decode_h200.json
# serving-shapes  the decode kernel at the serving job's shapes (16 heads)      -> kernels/decode_serving_shapes_h200.json
#
# Files go under $OUT/kernels/ (default OUT=/tmp/out), named as in lab/results/kernels/.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/kernels"
export TRITON_INTERPRET=0 PYTHONPATH=src:lab PYTHONUNBUFFERED=1
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
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/test_kernels_gpu.py tests/test_kernels_cuda.py tests/test_kernels.py -q -rfs -p no:cacheprovider $xdist 2>&1 | tee -a "$log"
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

for s in "${STEPS[@]}"; do
  echo "== $(date -u +%T) $s"
  "$s"
done
