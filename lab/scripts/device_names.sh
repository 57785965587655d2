# Sourced by the *_on_h200.sh scripts. Their steps name every result file for the device they are written for
# (`..._h200...`, or `h200.json`); `name_by_device` renames the files a run wrote under $OUT (those newer than the
# file $NAME_SINCE) to the GPU it ran on (`_h100` on an H100), never over an existing file, so that no file names
# another device than the one that measured it. The scripts run it on exit (`trap`), a killed step included.

# Every result records the commit of its code: start_run checks that the local one is passed (the device's copy of
# the tree may carry an older git history, whose HEAD would be recorded instead), sets OUT (default /tmp/out) and
# marks the run's start for name_by_device (NAME_SINCE).
start_run() {
  if [ -z "${QUANTMLA_COMMIT:-}" ]; then
    echo "set QUANTMLA_COMMIT to the commit of the tree you send: QUANTMLA_COMMIT=\$(git rev-parse --short HEAD), run locally" >&2
    exit 2
  fi
  OUT=${OUT:-/tmp/out}
  NAME_SINCE=$(mktemp)
}

# h100, h200, a100, l40s, ... from nvidia-smi's name of GPU 0; empty where nvidia-smi gives none
device_tag() {
  local name w
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  for w in $name; do
    case "$w" in
      NVIDIA|GeForce|RTX|Tesla|Quadro) continue ;;
    esac
    echo "${w%%-*}" | tr '[:upper:]' '[:lower:]' | tr -cd 'a-z0-9'
    return 0
  done
}

name_by_device() {
  local tag f to
  tag=$(device_tag)
  if [ -z "$tag" ]; then
    echo "name_by_device: nvidia-smi names no GPU; the files keep their h200 names"
    return 0
  fi
  [ "$tag" = h200 ] && return 0
  while IFS= read -r -d '' f; do
    to="$(dirname "$f")/$(basename "$f" | sed "s/h200/${tag}/g")"
    if [ -e "$to" ]; then
      echo "name_by_device: ${to#"$OUT"/} exists; ${f#"$OUT"/} keeps its name"
    else
      mv "$f" "$to" && echo "renamed for the device ($tag): ${f#"$OUT"/} -> ${to#"$OUT"/}"
    fi
  done < <(find "$OUT" -type f -name '*h200*' -newer "$NAME_SINCE" -print0)
}
