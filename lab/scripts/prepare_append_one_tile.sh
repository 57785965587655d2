#!/usr/bin/env bash
# The append kernel before its packed layout (one [tokens, channels] tile a path, the library of cfb9bb0), for the
# A/B of `kernel_designs_on_h200.sh append-one-tile`: writes cfb9bb0's src/ into .ab/src (ignored: listed in .git/info/exclude)
# with one change, its `append_to_pages` launching `_append_kernel` with num_warps from $AB_APPEND_WARPS (default 4)
# instead of 4. Run it here, where the git history is; then carry .ab to the GPU:
#
#   bash lab/scripts/prepare_append_one_tile.sh
#   (GPU, carry .ab) QUANTMLA_COMMIT=... OUT=$OUT bash lab/scripts/kernel_designs_on_h200.sh append-one-tile
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .ab/src && mkdir -p .ab
git archive cfb9bb0 src | tar -x -C .ab
api=.ab/src/quantmla/kernels/api.py
old='R_CLIP=tok.fmt.rope.clip_exp, num_warps=4'
new="R_CLIP=tok.fmt.rope.clip_exp, num_warps=int(__import__('os').environ.get('AB_APPEND_WARPS', '4'))"
grep -qF "$old" "$api" || { echo "cfb9bb0's append launch is not where this script expects it ($api)" >&2; exit 1; }
python3 - "$api" "$old" "$new" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
open(path, "w").write(text.replace(old, new, 1))
PY
grep -qxF '/.ab/' .git/info/exclude 2>/dev/null || echo '/.ab/' >> .git/info/exclude
echo "cfb9bb0's src in .ab/src, its append launch reading AB_APPEND_WARPS"
