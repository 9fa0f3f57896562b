#!/usr/bin/env bash
# Set up, then run every test lane, each in its own virtual environment:
#   core: torch 2.13 CPU (.venv, ~1.3 GB) - unit tests, doctests in ampfx/, the docs' examples, the examples'
#   smoke tests, and a headless-Chromium check of the HTML report (skipped with a message when no Chromium is
#   found; this script installs no system packages: see tests/test_html.py's find_chromium).
#   models: torch 2.14.1 + torchvision + timm + transformers (.venv-models, ~5.7 GB), scripts/test-models.sh.
#   dgl: torch 2.2.1 + dgl 2.1.0 (.venv-dgl, ~5.3 GB), scripts/test-dgl.sh.
#   trainers: torch 2.13 + pytorch-lightning 2.6 + accelerate 1.x + transformers 4.57 (.venv-trainers, ~1.2 GB),
#   and the wheel installed into a fresh venv, scripts/test-trainers.sh.
# Arguments go to the core lane's pytest; SKIP_LANES="models" (or "models dgl trainers") skips those lanes.
set -euo pipefail
cd "$(dirname "$0")/.."
case " ${SKIP_LANES:-} " in
  *" models "*" dgl "*" trainers "*) echo "core lane only (about 1.3 GB of disk in .venv)" ;;
  *) echo "all lanes: about 13.5 GB of disk on first use (.venv, .venv-models, .venv-dgl, .venv-trainers); SKIP_LANES=\"models dgl trainers\" runs the core lane only" ;;
esac
bash scripts/setup.sh
.venv/bin/python -m pytest -q ampfx tests "$@"
bash scripts/test-models.sh
bash scripts/test-dgl.sh
bash scripts/test-trainers.sh
