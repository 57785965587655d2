#!/usr/bin/env bash
# One device call (nvidia-h200-x2): serving agreement on the shipped models after the prefill fix,
# a per-kernel profile of decode steps, the GPU calibration paths (in-memory, streamed, 2-process
# NCCL), and the calibration scaling benchmark. Everything lands in $OUT (at most 8 files).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONPATH=src PYTHONUNBUFFERED=1
LOG="$OUT/session2a.log"
step() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$LOG"

step "serving agreement (shipped models, bf16 + int4/int4 + int2/int4)"
timeout 150 python3 -m quantmla.cli serve-bench --check-only --check-families deepseek_v2 \
  --check-methods bf16 int4/int4 int2/int4 --out "$OUT/serving_check_h200.json" 2>&1 | tail -25 | tee -a "$LOG"

step "decode-step profile (v2-lite geometry, 64 rows)"
timeout 150 python3 bench/profile_serving.py --out "$OUT/profile_serving_h200.json" 2>&1 | grep -v Warning | tail -60 | tee -a "$LOG"

step "GPU calibration paths on qmla-ref-deepseek-v3"
M=models/qmla-ref-deepseek-v3
/usr/bin/time -f "calibrate cuda: %e s wall" timeout 120 python3 -m quantmla.cli calibrate $M --content-bits 4 --rope-bits 4 \
  --device cuda --out /tmp/cal_mem --no-progress 2>&1 | grep -v "Loading\|Writing" | tail -9 | tee -a "$LOG"
/usr/bin/time -f "stream 1 proc cuda: %e s wall" timeout 120 python3 -m quantmla.cli calibrate $M --content-bits 4 --rope-bits 4 \
  --device cuda --stream --out /tmp/cal_s1 --no-progress 2>&1 | tail -3 | tee -a "$LOG"
/usr/bin/time -f "stream 2 proc nccl: %e s wall" timeout 150 python3 -m quantmla.cli calibrate $M --content-bits 4 --rope-bits 4 \
  --device cuda --stream --nproc 2 --out /tmp/cal_s2 --no-progress 2>&1 | tail -3 | tee -a "$LOG"
python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import glob, hashlib, json, os
def digest(d):
    return {os.path.basename(f): hashlib.sha256(open(f, "rb").read()).hexdigest()[:16]
            for f in sorted(glob.glob(d + "/*.safetensors"))}
a, b = digest("/tmp/cal_s1"), digest("/tmp/cal_s2")
print("stream 1-proc vs 2-proc NCCL shards identical:", a == b and bool(a), len(a), "shards")
qa = json.load(open("/tmp/cal_s1/config.json"))["quantization_config"]
qb = json.load(open("/tmp/cal_s2/config.json"))["quantization_config"]
print("quantization_config identical:", qa == qb)
json.dump({"stream_1proc": a, "stream_2proc_nccl": b, "identical": a == b, "config_identical": qa == qb},
          open(os.environ.get("OUT", "/tmp/out") + "/nccl_equality_h200.json", "w"), indent=1)
EOF

step "calibration scaling (cuda)"
timeout 250 python3 bench/calibration_scaling.py --device cuda --in-process --with-dsv3 --time-limit 220 \
  --out "$OUT/calibration_scaling_cuda.json" 2>&1 | tail -30 | tee -a "$LOG"
step "done"
