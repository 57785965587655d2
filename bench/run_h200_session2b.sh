#!/usr/bin/env bash
# Device call B (nvidia-h200-x2): decode-kernel configs at serving shapes, the streamed GPU
# calibration paths (1 process, 2 processes over NCCL) after the device fix, the append kernel's
# GPU tests, and the decode-step profile after the append launch change.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONPATH=src PYTHONUNBUFFERED=1
LOG="$OUT/session2b.log"
step() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
step "append kernel GPU tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k append 2>&1 | tail -3 | tee -a "$LOG"
step "GPU streamed calibration on qmla-ref-deepseek-v3"
M=models/qmla-ref-deepseek-v3
/usr/bin/time -f "stream 1 proc cuda: %e s wall" timeout 100 python3 -m quantmla.cli calibrate $M --content-bits 4 --rope-bits 4 \
  --device cuda --stream --out /tmp/cal_s1 --no-progress 2>&1 | tail -4 | tee -a "$LOG"
/usr/bin/time -f "stream 2 proc nccl: %e s wall" timeout 120 python3 -m quantmla.cli calibrate $M --content-bits 4 --rope-bits 4 \
  --device cuda --stream --nproc 2 --out /tmp/cal_s2 --no-progress 2>&1 | grep -v "Warning: An unbatched" | tail -4 | tee -a "$LOG"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import glob, hashlib, json, os
def digest(d):
    return {os.path.basename(f): hashlib.sha256(open(f, "rb").read()).hexdigest()[:16]
            for f in sorted(glob.glob(d + "/*.safetensors"))}
a, b = digest("/tmp/cal_s1"), digest("/tmp/cal_s2")
qa = json.load(open("/tmp/cal_s1/config.json"))["quantization_config"] if os.path.exists("/tmp/cal_s1/config.json") else None
qb = json.load(open("/tmp/cal_s2/config.json"))["quantization_config"] if os.path.exists("/tmp/cal_s2/config.json") else None
r = {"stream_1proc": a, "stream_2proc_nccl": b, "shards_identical": a == b and bool(a), "config_identical": qa == qb and qa is not None,
     "rope_offsets_slots": sorted((qa or {}).get("rope_offsets", {}))}
print(r)
json.dump(r, open(os.environ.get("OUT", "/tmp/out") + "/nccl_equality_h200.json", "w"), indent=1)
PY
step "decode kernel configs at serving shapes (16 heads)"
timeout 240 python3 -m quantmla.cli bench-kernel --heads 16 --methods int4/int4,int2/int4 \
  --shapes 64x1536,20x2048,6x2048,32x16384 --sweep-shape 64x1536 --out "$OUT/kernel_serving_shapes_h200.json" 2>&1 \
  | grep -v "^check " | tail -30 | tee -a "$LOG"
step "decode-step profile after the append launch change"
timeout 120 python3 bench/profile_serving.py --methods bf16 int4/int4 --out "$OUT/profile_serving_h200_b.json" 2>&1 | grep -v -i warn | tail -34 | tee -a "$LOG"
step done
