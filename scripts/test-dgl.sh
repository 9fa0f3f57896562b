#!/usr/bin/env bash
# The DGL lane: tests_dgl/ in its own virtual environment .venv-dgl with DGL's working set
# (dgl 2.1.0 is the newest DGL wheel for Python 3.11 and imports only with torch <= 2.2.1).
# Created on first use, reused after; CPU only. Extra arguments go to pytest. SKIP_LANES="dgl" skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
case " ${SKIP_LANES:-} " in *" dgl "*) echo "dgl lane skipped (SKIP_LANES)"; exit 0;; esac
PY=${PYTHON_DGL:-$(command -v python3.11 || command -v python3)}
VENV=.venv-dgl
WORKING_SET=("torch==2.2.1" "dgl==2.1.0" "torchdata==0.7.1" "numpy<2" "pandas<2.3"
             pyyaml pydantic requests tqdm psutil scipy networkx)
export DGLBACKEND=pytorch  # dgl otherwise writes ~/.dgl/config.json and says so on every import
source scripts/quietly.sh
free_after "$VENV"
if ! "$VENV/bin/python" -c "import torch, dgl; assert torch.__version__.startswith('2.2.1'), torch.__version__" \
    >/dev/null 2>&1; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  quietly "$VENV/bin/python" -m pip install --upgrade pip
  echo "installing DGL's working set into $VENV (about 5 GB, a few minutes): ${WORKING_SET[*]}"
  quietly "$VENV/bin/python" -m pip install "${WORKING_SET[@]}"
fi
quietly "$VENV/bin/python" -m pip install pytest hypothesis rich sympy
quietly "$VENV/bin/python" -m pip install --no-deps -e .
"$VENV/bin/python" -c "import torch, dgl, ampfx; print('ampfx', ampfx.__version__, 'on torch', torch.__version__, 'dgl', dgl.__version__)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests_dgl "$@"
