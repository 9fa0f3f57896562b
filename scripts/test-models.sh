#!/usr/bin/env bash
# The real-model lane: torchvision, timm and HF transformers (built from configs, random init, no
# downloads) on torch 2.14.1, in its own virtual environment .venv-models (torchvision 0.29.1 does not
# import beside the core lane's torch 2.13). SKIP_LANES="models" skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
case " ${SKIP_LANES:-} " in *" models "*) echo "models lane skipped (SKIP_LANES)"; exit 0;; esac
PY=${PYTHON:-python3}
if [ ! -x .venv-models/bin/python ]; then
  "$PY" -m venv .venv-models
fi
source scripts/quietly.sh
free_after ".venv-models"
.venv-models/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
quietly .venv-models/bin/python -m pip install "torch==2.14.1" "torchvision==0.29.1"
quietly .venv-models/bin/python -m pip install "timm" "transformers==4.57.*" pytest
quietly .venv-models/bin/python -m pip install -e .
.venv-models/bin/python -c "import torch, torchvision, timm, transformers; print('models lane: torch', torch.__version__, \
'torchvision', torchvision.__version__, 'timm', timm.__version__, 'transformers', transformers.__version__)"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv-models/bin/python -m pytest -q -p no:cacheprovider \
  -o addopts="-ra" tests_models "$@"
