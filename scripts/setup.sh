#!/usr/bin/env bash
# Create .venv with pinned dependencies (idempotent). CPU machines: torch 2.13.0 CPU wheel from local disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.quantmla-setup-$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
if [ -f "$stamp" ]; then exit 0; fi
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned exactly, so nothing later pulls a multi-GB CUDA build
python -m pip install -q "torch==2.13.0"
python -m pip install -q -c constraints.txt -e ".[test,kernels,eval]"
rm -f .venv/.quantmla-setup-*
touch "$stamp"
