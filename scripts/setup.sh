#!/usr/bin/env bash
# Create (or reuse) the core virtual environment .venv with torch 2.13 (CPU) and ampfx installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import torch, ampfx; print('ampfx', ampfx.__version__, 'on torch', torch.__version__)"
