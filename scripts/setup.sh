#!/usr/bin/env bash
# Create (or reuse) the core virtual environment .venv with torch 2.13 (CPU) and ampfx installed.
# Quiet unless a step fails: then that step's whole output is shown.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
source scripts/quietly.sh
# passes/ moved out of ampfx/: a checkout from before keeps ampfx/passes/__pycache__, which Python would
# import as an empty namespace package in place of the real ampfx.passes
if [ -d ampfx/passes ] && [ -z "$(git ls-files ampfx/passes 2>/dev/null)" ]; then rm -rf ampfx/passes; fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
quietly .venv/bin/python -m pip install "torch==2.13.0"
quietly .venv/bin/python -m pip install -e ".[test]"
.venv/bin/python -c "import torch, ampfx; print('ampfx', ampfx.__version__, 'on torch', torch.__version__)"
