#!/usr/bin/env bash
# Device call C (nvidia-h200-x2): streamed GPU calibration (1 process vs 2 over NCCL) after the
# fuse-device fix, then the QuantMLA accuracy rows (RoPE-key centring) of all four reference
# models at n=100 retrieval, merged into a copy of results/.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONPATH=src PYTHONUNBUFFERED=1
LOG="$OUT/session2c.log"
step() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
step "GPU streamed calibration on qmla-ref-deepseek-v3"
M=models/qmla-ref-deepseek-v3
/usr/bin/time -f "stream 1 proc cuda: %e s wall" timeout 100 python3 -m quantmla.cli calibrate $M --content-bits 4 --rope-bits 4 \
  --device cuda --stream --out /tmp/cal_s1 --no-progress > /tmp/s1.log 2>&1; tail -12 /tmp/s1.log | tee -a "$LOG"
/usr/bin/time -f "stream 2 proc nccl: %e s wall" timeout 120 python3 -m quantmla.cli calibrate $M --content-bits 4 --rope-bits 4 \
  --device cuda --stream --nproc 2 --out /tmp/cal_s2 --no-progress > /tmp/s2.log 2>&1; grep -v "unbatched P2P" /tmp/s2.log | tail -12 | tee -a "$LOG"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import glob, hashlib, json, os
def digest(d):
    return {os.path.basename(f): hashlib.sha256(open(f, "rb").read()).hexdigest()[:16]
            for f in sorted(glob.glob(d + "/*.safetensors"))}
a, b = digest("/tmp/cal_s1"), digest("/tmp/cal_s2")
qa = json.load(open("/tmp/cal_s1/config.json"))["quantization_config"] if os.path.exists("/tmp/cal_s1/config.json") else None
qb = json.load(open("/tmp/cal_s2/config.json"))["quantization_config"] if os.path.exists("/tmp/cal_s2/config.json") else None
r = {"stream_1proc": a, "stream_2proc_nccl": b, "shards_identical": a == b and len(a) > 1, "config_identical": qa == qb and qa is not None,
     "rope_offsets_slots": sorted((qa or {}).get("rope_offsets", {}))}
print(r)
json.dump(r, open(os.environ.get("OUT", "/tmp/out") + "/nccl_equality_h200.json", "w"), indent=1)
PY
step "QuantMLA accuracy rows (cuda, n=100)"
rm -rf /tmp/acc && mkdir -p /tmp/acc && cp results/accuracy.json /tmp/acc/
timeout 400 python3 -m quantmla.cli eval --all --config INT4/INT4 INT2/INT4 --method quantmla --device cuda --out /tmp/acc 2>&1 \
  | grep "bpb\|error\|Error" | tail -20 | tee -a "$LOG"
cp /tmp/acc/accuracy.json /tmp/acc/accuracy.md "$OUT/"
step done
