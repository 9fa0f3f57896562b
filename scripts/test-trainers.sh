#!/usr/bin/env bash
# The trainers lane: tests_trainers/ (PyTorch Lightning, Accelerate, HF Trainer through ampfx) and the wheel
# test, in their own virtual environment .venv-trainers: torch 2.13 (CPU), lightning 2.6 and pytorch-lightning 2.6,
# accelerate 1.x, transformers 4.57. Created on first use, reused after; quiet unless a step fails. No model, tokenizer or
# data set is downloaded (models are built from configs, data is synthetic). Extra arguments go to pytest.
# SKIP_LANES="trainers" skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
case " ${SKIP_LANES:-} " in *" trainers "*) echo "trainers lane skipped (SKIP_LANES)"; exit 0;; esac
PY=${PYTHON:-python3}
VENV=.venv-trainers
source scripts/quietly.sh
free_after "$VENV"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first and pinned in every later install: anything that lets pip choose would fetch a CUDA build
quietly "$VENV/bin/python" -m pip install "torch==2.13.0"
quietly "$VENV/bin/python" -m pip install "torch==2.13.0" "lightning==2.6.*" "pytorch-lightning==2.6.*" "accelerate>=1,<2" \
  "transformers==4.57.*" build pytest
quietly "$VENV/bin/python" -m pip install "torch==2.13.0" -e .
"$VENV/bin/python" -c "import torch, lightning, pytorch_lightning, accelerate, transformers, ampfx; print('trainers lane: \
torch', torch.__version__, 'lightning', lightning.__version__, 'pytorch-lightning', pytorch_lightning.__version__, \
'accelerate', accelerate.__version__, \
'transformers', transformers.__version__)"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  -o addopts="-ra" -o log_level=WARNING tests_trainers "$@"
