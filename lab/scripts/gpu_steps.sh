# Sourced with the script's arguments by the decode kernels' GPU scripts (kernels_on_h200.sh,
# kernel_designs_on_h200.sh): checks QUANTMLA_COMMIT, sets OUT (default /tmp/out) and the environment, takes the
# arguments as STEPS (those after `--` as EXTRA), and renames the files a run writes to the GPU that ran it when the
# script exits (device_names.sh); `run_steps` then runs each step, in order.
# shellcheck source=lab/scripts/device_names.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_names.sh"
start_run
trap name_by_device EXIT
mkdir -p "$OUT/kernels" "$OUT/decode_schedule"
export TRITON_INTERPRET=0 PYTHONPATH=src:lab:tests PYTHONUNBUFFERED=1
EXTRA=()
STEPS=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; EXTRA=("$@"); break; fi
  STEPS+=("$1"); shift
done

run_steps() {
  local s
  for s in "${STEPS[@]}"; do
    echo "== $(date -u +%T) $s"
    "$s"
  done
}
