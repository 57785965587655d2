# Sourced by the *_on_h200.sh scripts. Their steps name every result file `..._h200...` (the device they are written
# for); `name_by_device` renames what a run wrote under $OUT to the GPU it ran on (`_h100` on an H100), so that no
# file names another device than the one that measured it.

# h100, h200, ... from nvidia-smi's name of GPU 0 (h200 where it cannot tell)
device_tag() {
  local name
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  case "$name" in
    *H100*) echo h100 ;;
    *H200*) echo h200 ;;
    *H800*) echo h800 ;;
    *H20*) echo h20 ;;
    *) echo h200 ;;
  esac
}

name_by_device() {
  local tag f to
  tag=$(device_tag)
  [ "$tag" = h200 ] && return 0
  while IFS= read -r -d '' f; do
    to="$(dirname "$f")/$(basename "$f" | sed "s/_h200/_${tag}/g")"
    if [ -e "$to" ]; then
      echo "name_by_device: $to exists; $f keeps its name" >&2
    else
      mv "$f" "$to" && echo "renamed for the device ($tag): ${f#"$OUT"/} -> ${to#"$OUT"/}"
    fi
  done < <(find "$OUT" -name '*_h200*' -newer "$NAME_SINCE" -print0)
}
