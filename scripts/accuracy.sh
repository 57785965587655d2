#!/usr/bin/env bash
# Recompute the accuracy table (results/accuracy.{json,md}) and the dual-path error analysis
# (results/analysis/<model>/) of every shipped reference model, on CPU.
#
#   scripts/accuracy.sh            full run (every row: BF16, FP8, RTN, KIVI, Hadamard, QuantMLA and ablations)
#   scripts/accuracy.sh --quick    CI-sized run into results/quick/
#   scripts/accuracy.sh --resume   keep rows already computed with the same settings
#
# Extra arguments go to `quantmla eval` (e.g. --ppl-chunks 32 --retrieval-n 20).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/quantmla ] || bash scripts/setup.sh
. .venv/bin/activate
quick=0
for a in "$@"; do [ "$a" = "--quick" ] && quick=1; done
models=$(python -c "
from quantmla.evaluation.datasets import REFERENCE_MODELS, models_root
print(' '.join(n for n in REFERENCE_MODELS if (models_root() / n / 'config.json').exists()))")
if [ -z "$models" ]; then echo "no reference model under models/ (run quantmla train-reference)" >&2; exit 2; fi
for m in $models; do
  if [ $quick = 1 ]; then
    quantmla analyze "$m" --num-seqs 1 --seq-len 256 --bits 2 4 8 --out "results/quick/analysis/$m"
  else
    quantmla analyze "$m" --num-seqs 4 --seq-len 512
  fi
done
quantmla eval --all "$@"
