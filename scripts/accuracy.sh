#!/usr/bin/env bash
# Recompute the committed accuracy table (results/accuracy.{json,md}), the README's summary block
# generated from it, and the dual-path error analysis (results/analysis/<model>/) of every shipped
# reference model.
#
#   scripts/accuracy.sh                  full run on CPU (every row: BF16, FP8, RTN, KIVI, Hadamard,
#                                        QuantMLA, its ablations and its RoPE-per-page row, at groups
#                                        64/32 and 32/16)
#   scripts/accuracy.sh --device cuda    the same on a GPU
#   scripts/accuracy.sh --quick          CI-sized run into out/accuracy-quick/ (the committed files untouched)
#
# Extra arguments go to `quantmla eval` (e.g. --device cuda). The table is replaced whole (--overwrite):
# every row of it comes from this one call, on one data setting.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/quantmla ] || bash scripts/setup.sh
. .venv/bin/activate
quick=0
for a in "$@"; do [ "$a" = "--quick" ] && quick=1; done
models=$(python -c "
from quantmla.corpus.datasets import REFERENCE_MODELS, models_root
print(' '.join(n for n in REFERENCE_MODELS if (models_root() / n / 'config.json').exists()))")
if [ -z "$models" ]; then echo "no reference model under models/ (run quantmla train-reference)" >&2; exit 2; fi
if [ $quick = 1 ]; then
  for m in $models; do
    quantmla analyze "$m" --num-seqs 1 --seq-len 256 --bits 2 4 8 --out "out/accuracy-quick/analysis/$m"
  done
  quantmla eval --all --out out/accuracy-quick --overwrite "$@"
  exit 0
fi
for m in $models; do
  quantmla analyze "$m" --num-seqs 4 --seq-len 512 --out "results/analysis/$m"
done
quantmla eval --all --groups 64/32 32/16 --out results --overwrite "$@"
quantmla eval --from-json results/accuracy.json --readme README.md
